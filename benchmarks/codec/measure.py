"""One measured step of a case: wire bytes of every coding, the bounds, throughput, bit-exactness."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from benchmarks.codec.settings import _log
from benchmarks.codec.timing import Receiver, Timed, decode_apply, encode, exact, meta, timed


@dataclass
class Step:
    """One change to encode: committed bits (numpy, flat) and the new tensors, by name."""

    old: dict  # name -> np.ndarray (flat unsigned bit view, owned copy)
    new: dict  # name -> torch.Tensor


#: What each case times, per coding: ``<coding>_encode`` (diff + frames), ``<coding>_apply`` (decode + apply
#: on a live receiver), ``context_apply_cold`` (a receiver without kept class counts), ``diff`` (the main
#: coding's diff alone).
TIMINGS = ("plain_encode", "context_encode", "plain_apply", "context_apply", "context_apply_cold", "diff")


@dataclass
class Acc:
    """Sums over the steps of one case."""

    elems: int = 0
    canon_bytes: int = 0
    changed: int = 0
    wire: int = 0
    wire_plain: int = 0
    overwrite: int = 0
    pos_bits: float = 0.0
    mask_bits: float = 0.0
    pt_pos_bits: float = 0.0
    class_pos_bits: float = 0.0
    diff_bits: float = 0.0
    #: per timing: the sum over steps of the best wall (``secs``) and CPU (``cpu``) seconds of its repeats,
    #: and every repeat's wall seconds, one list per step (``samples``)
    secs: dict = field(default_factory=lambda: dict.fromkeys(TIMINGS, 0.0))
    cpu: dict = field(default_factory=lambda: dict.fromkeys(TIMINGS, 0.0))
    samples: dict = field(default_factory=lambda: {k: [] for k in TIMINGS})
    coding: str = "plain"
    frames: int = 0
    exact: bool = True
    peers_exact: bool = True
    peers: dict = field(default_factory=dict)
    rates: list = field(default_factory=list)

    def add(self, key: str, t: Timed) -> None:
        self.secs[key] += t.best
        self.cpu[key] += t.best_cpu
        self.samples[key].append([round(x, 6) for x in t.wall])


def _entropy_bits(counts) -> float:
    """Empirical entropy (bits per symbol) of a histogram."""
    import numpy as np

    c = counts[counts > 0].astype(np.float64)
    p = c / c.sum()
    return float(-(p * np.log2(p)).sum())


def _h2(p: float) -> float:
    return 0.0 if p <= 0 or p >= 1 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def _class_pos_bits(old, pos, dtype: str) -> float:
    """``sum over exponent classes c of n_c * H(p_c)`` for one tensor: positions coded knowing each old
    value's class (:mod:`dcr_ray.codec.primitives.classorder`), zero-order within a class."""
    import numpy as np

    from dcr_ray.codec.primitives.classorder import EXPONENT_FIELDS

    if dtype not in EXPONENT_FIELDS:
        return len(old) * _h2(len(pos) / max(len(old), 1))
    shift, nbits = EXPONENT_FIELDS[dtype]
    cls = (old >> old.dtype.type(shift)) & old.dtype.type((1 << nbits) - 1)
    tot = np.bincount(cls, minlength=1 << nbits)
    hit = np.bincount(cls[pos], minlength=1 << nbits)
    return float(sum(int(tot[c]) * _h2(hit[c] / tot[c]) for c in np.flatnonzero(tot)))


def measure_step(step: Step, acc: Acc, repeats: int, coding: str = "plain") -> None:
    """Measure one step of a case into ``acc`` (``coding`` is what the throughput columns time)."""
    import numpy as np

    from benchmarks.peers import encodings as peers
    from dcr_ray.codec import bits_view, diff_tensor
    from dcr_ray.codec.primitives import intdiff
    from dcr_ray.codec.bits import wire_name

    # independent ground truth (naive numpy): positions, new bits and XOR values per tensor
    changes, hist, changed, elems, canon = {}, np.zeros(1 << 16, np.int64), 0, 0, 0
    dhist = np.zeros(1 << 16, np.int64)
    for n, t in step.new.items():
        nb = bits_view(t)
        x = np.bitwise_xor(step.old[n], nb)
        pos = np.flatnonzero(x)
        changes[n] = (pos, nb)
        if nb.dtype.itemsize == 2:
            hist += np.bincount(x[pos], minlength=1 << 16)
            dhist += np.bincount(intdiff.zigzag(nb[pos] - step.old[n][pos]), minlength=1 << 16)
        acc.pt_pos_bits += len(nb) * _h2(len(pos) / max(len(nb), 1))
        acc.class_pos_bits += _class_pos_bits(step.old[n], pos, wire_name(t.dtype))
        changed += len(pos)
        elems += len(nb)
        canon += nb.nbytes
    p = changed / elems
    acc.elems += elems
    acc.canon_bytes += canon
    acc.changed += changed
    acc.rates.append(p)
    acc.pos_bits += elems * _h2(p)
    acc.mask_bits += changed * _entropy_bits(hist) if changed else 0.0
    acc.diff_bits += changed * _entropy_bits(dhist) if changed else 0.0

    # encode as owners do, both codings; the main coding's diff alone for the breakdown
    acc.coding = coding
    enc = {c: timed(lambda c=c: encode(step, coding=c), repeats) for c in ("plain", "context")}
    for c, t in enc.items():
        acc.add(f"{c}_encode", t)
    acc.add("diff", timed(lambda: [diff_tensor(n, step.old[n], t, class_order=coding == "context")
                                   for n, t in step.new.items()], repeats))
    frames = {c: t.result[1] for c, t in enc.items()}
    deltas = enc["context"].result[0]  # with class-order positions
    del enc
    got = {d.name: d for d in deltas}
    for n, (pos, _nb) in changes.items():
        d = got[n]
        if not any(c.is_dense for c in d.chunks) and (d.changed != len(pos) or (
                len(pos) and not np.array_equal(np.concatenate([c.positions() for c in d.chunks]), pos))):
            acc.exact = False
            _log(f"  MISMATCH: diff of {n} found {d.changed} changes, numpy finds {len(pos)}")
    acc.wire += sum(map(len, frames["context"]))
    acc.wire_plain += sum(map(len, frames["plain"]))
    acc.frames += len(frames[coding])

    # decode + apply on a live receiver (bits and kept class counts reset untimed), then every bit checked
    rx = Receiver(step)
    for c in ("plain", "context"):
        rx.prime(frames[c])
        acc.add(f"{c}_apply", timed(lambda tg, c=c: decode_apply(frames[c], tg), repeats, setup=rx.reset))
        decode_apply(frames[c], rx.reset())
        acc.exact &= exact(rx.targets, step)
    acc.add("context_apply_cold", timed(lambda tg: decode_apply(frames["context"], tg), repeats,
                                        setup=lambda: rx.reset(keep_counts=False)))
    acc.exact &= exact(rx.targets, step)

    from dcr_ray.codec import encode_frames

    # overwrite-only (what a retry sends) from the same changed set
    ow = list(encode_frames(deltas, meta(), mode="overwrite"))
    acc.overwrite += sum(map(len, ow))
    decode_apply(ow, rx.reset())
    acc.exact &= exact(rx.targets, step)

    # peers, same data
    for name in peers.PEERS:
        payloads = peers.encode_all(name, changes)
        acc.peers[name] = acc.peers.get(name, 0) + peers.wire_bytes(payloads)
        tgt = {n: step.old[n].copy() for n in step.new}
        peers.apply_all(name, payloads, tgt)
        ok = all(np.array_equal(tgt[n], bits_view(t)) for n, t in step.new.items())
        acc.peers_exact &= ok


def case_result(name: str, source: str, acc: Acc, **extra) -> dict:
    bound = (acc.pos_bits + acc.mask_bits) / 8
    pt_bound = (acc.pt_pos_bits + acc.diff_bits) / 8
    class_bound = (acc.class_pos_bits + acc.diff_bits) / 8
    c = max(acc.changed, 1)
    return {
        "name": name,
        "source": source,
        "change_rate": acc.changed / acc.elems,
        "elements": acc.elems,
        "changed": acc.changed,
        "wire_bytes": acc.wire,
        "bytes_per_change": acc.wire / c,
        "entropy_bound_bytes": bound,
        "entropy_bound_positions_bytes": acc.pos_bits / 8,
        "entropy_bound_masks_bytes": acc.mask_bits / 8,
        "wire_over_bound": acc.wire / bound if bound else None,
        "today_wire_bytes": acc.wire_plain,
        "today_bytes_per_change": acc.wire_plain / c,
        "new_over_today": acc.wire / acc.wire_plain if acc.wire_plain else None,
        "today_over_bound": acc.wire_plain / bound if bound else None,
        "per_tensor_bound_bytes": pt_bound,
        "per_tensor_bound_positions_bytes": acc.pt_pos_bits / 8,
        "per_tensor_bound_values_bytes": acc.diff_bits / 8,
        "wire_over_per_tensor_bound": acc.wire / pt_bound if pt_bound else None,
        "class_bound_bytes": class_bound,
        "class_bound_positions_bytes": acc.class_pos_bits / 8,
        "overwrite_only_bytes": acc.overwrite,
        "mixed_saving": 1 - acc.wire / acc.overwrite if acc.overwrite else None,
        **_throughput(acc),
        "canonical_bytes": acc.canon_bytes,
        "frames": acc.frames,
        "bit_exact": bool(acc.exact),
        "peers_bit_exact": bool(acc.peers_exact),
        "peers": dict(acc.peers),
        "peers_bytes_per_change": {k: v / c for k, v in acc.peers.items()},
        "samples_s": acc.samples,
        **extra,
    }


def _throughput(acc: Acc) -> dict:
    """GB/s of canonical bytes per timing (wall, and per CPU-second), by coding, and the legacy columns:
    the main coding's (``encode_gbps``, ``apply_gbps``, ...) and the other one's (``other_*``)."""
    gb = acc.canon_bytes / 1e9
    out = {f"{k}_gbps": gb / acc.secs[k] for k in TIMINGS}
    out.update({f"{k}_cpu_gbps": gb / acc.cpu[k] for k in TIMINGS})
    main, other = acc.coding, "plain" if acc.coding == "context" else "context"
    for prefix, c in (("", main), ("other_", other)):
        for what in ("encode", "apply"):
            out[f"{prefix}{what}_gbps"] = out[f"{c}_{what}_gbps"]
            out[f"{prefix}{what}_cpu_gbps"] = out[f"{c}_{what}_cpu_gbps"]
    return out
