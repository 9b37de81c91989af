"""One measured step of a case: wire bytes of every coding, the bounds, throughput, bit-exactness."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from dcr_ray.bench.codec.settings import _log


@dataclass
class Step:
    """One change to encode: committed bits (numpy, flat) and the new tensors, by name."""

    old: dict  # name -> np.ndarray (flat unsigned bit view, owned copy)
    new: dict  # name -> torch.Tensor


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
    encode_s: float = 0.0
    encode_cpu_s: float = 0.0
    apply_cpu_s: float = 0.0
    diff_s: float = 0.0
    apply_s: float = 0.0
    #: the same four times of the other coding
    other_encode_s: float = 0.0
    other_encode_cpu_s: float = 0.0
    other_apply_s: float = 0.0
    other_apply_cpu_s: float = 0.0
    frames: int = 0
    exact: bool = True
    peers_exact: bool = True
    peers: dict = field(default_factory=dict)
    rates: list = field(default_factory=list)


def _meta():
    from dcr_ray.codec import FrameMeta

    return FrameMeta(transfer="bench", attempt=0, producer="bench", payload=0, base=0, target=1)


def _entropy_bits(counts) -> float:
    """Empirical entropy (bits per symbol) of a histogram."""
    import numpy as np

    c = counts[counts > 0].astype(np.float64)
    p = c / c.sum()
    return float(-(p * np.log2(p)).sum())


def _h2(p: float) -> float:
    return 0.0 if p <= 0 or p >= 1 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def _best(fn, repeats: int, setup=None, cpu: list | None = None):
    """(best wall seconds, last result) of ``fn()`` over ``repeats`` runs; ``setup()`` runs untimed first.

    ``cpu``, when given, receives the least CPU time (all threads of the process) of one run.
    """
    best, best_cpu, out = float("inf"), float("inf"), None
    for _ in range(repeats):
        arg = setup() if setup else None
        c = time.process_time()
        t = time.perf_counter()
        out = fn(arg) if setup else fn()
        best = min(best, time.perf_counter() - t)
        best_cpu = min(best_cpu, time.process_time() - c)
    if cpu is not None:
        cpu.append(best_cpu)
    return best, out


def _encode(step: Step, *, mode="mixed", zstd_level=None, coding="context"):
    """(deltas, frames) of ``step``: the owner's encode path (diff every tensor, then frames; class-order
    positions only for the context coding, as owners do)."""
    from dcr_ray.codec import diff_tensor, encode_frames
    from dcr_ray.codec.encode import DEFAULT_ZSTD_LEVEL

    deltas = [diff_tensor(n, step.old[n], t, class_order=coding == "context") for n, t in step.new.items()]
    frames = list(encode_frames(deltas, _meta(), mode=mode, coding=coding,
                                zstd_level=DEFAULT_ZSTD_LEVEL if zstd_level is None else zstd_level))
    return deltas, frames


def _fresh_targets(step: Step) -> dict:
    """Receiver tensors holding the committed bits (a new copy each call)."""
    import torch

    from dcr_ray.codec import bits_view

    out = {}
    for n, t in step.new.items():
        x = torch.empty_like(t)
        bits_view(x)[:] = step.old[n]
        out[n] = x
    return out


def _decode_apply(frames, targets) -> None:
    from dcr_ray.codec import apply_decoded, read_frame

    for f in frames:
        apply_decoded(read_frame(f, targets), targets)


def _exact(targets: dict, step: Step) -> bool:
    """Bit-exact: every receiver tensor's integer view equals the new tensor's."""
    import numpy as np

    from dcr_ray.codec import bits_view

    return all(np.array_equal(bits_view(targets[n]), bits_view(t)) for n, t in step.new.items())


def _class_pos_bits(old, pos, dtype: str) -> float:
    """``sum over exponent classes c of n_c * H(p_c)`` for one tensor: positions coded knowing each old
    value's class (:mod:`dcr_ray.codec.classorder`), zero-order within a class."""
    import numpy as np

    from dcr_ray.codec.classorder import EXPONENT_FIELDS

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

    from dcr_ray.bench import peers
    from dcr_ray.codec import bits_view, diff_tensor, intdiff
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

    # encode: diff + frames (best of repeats), and diff alone for the breakdown; both codings
    other_coding = "plain" if coding == "context" else "context"
    cpu: list[float] = []
    t_enc, (deltas, frames) = _best(lambda: _encode(step, coding=coding), repeats, cpu=cpu)
    t_diff, _ = _best(lambda: [diff_tensor(n, step.old[n], t, class_order=coding == "context")
                               for n, t in step.new.items()], repeats)
    other_cpu: list[float] = []
    t_other, (other_deltas, other) = _best(lambda: _encode(step, coding=other_coding), repeats, cpu=other_cpu)
    if coding == "plain":
        deltas = other_deltas  # with class-order positions: the context frames below need them
    del other_deltas
    got = {d.name: d for d in deltas}
    for n, (pos, _nb) in changes.items():
        d = got[n]
        if not any(c.is_dense for c in d.chunks) and (d.changed != len(pos) or (
                len(pos) and not np.array_equal(np.concatenate([c.positions() for c in d.chunks]), pos))):
            acc.exact = False
            _log(f"  MISMATCH: diff of {n} found {d.changed} changes, numpy finds {len(pos)}")
    acc.encode_s += t_enc
    acc.diff_s += t_diff
    acc.wire += sum(map(len, frames))
    acc.frames += len(frames)

    # decode + apply into fresh receiver copies (copy untimed), then check every bit; both codings
    t_app, _ = _best(lambda tg: _decode_apply(frames, tg), repeats, setup=lambda: _fresh_targets(step), cpu=cpu)
    t_other_app, _ = _best(lambda tg: _decode_apply(other, tg), repeats, setup=lambda: _fresh_targets(step),
                           cpu=other_cpu)
    acc.apply_s += t_app
    acc.encode_cpu_s += cpu[0]
    acc.apply_cpu_s += cpu[1]
    acc.other_encode_s += t_other
    acc.other_apply_s += t_other_app
    acc.other_encode_cpu_s += other_cpu[0]
    acc.other_apply_cpu_s += other_cpu[1]
    for fr in (frames, other):
        tg = _fresh_targets(step)
        _decode_apply(fr, tg)
        acc.exact &= _exact(tg, step)

    from dcr_ray.codec import encode_frames

    ctx_frames, plain_frames = (frames, other) if coding == "context" else (other, frames)
    acc.wire = acc.wire - sum(map(len, frames)) + sum(map(len, ctx_frames))
    acc.wire_plain += sum(map(len, plain_frames))

    # overwrite-only (what a retry sends) from the same changed set

    ow = list(encode_frames(deltas, _meta(), mode="overwrite"))
    acc.overwrite += sum(map(len, ow))
    tg = _fresh_targets(step)
    _decode_apply(ow, tg)
    acc.exact &= _exact(tg, step)

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
        "encode_gbps": acc.canon_bytes / acc.encode_s / 1e9,
        "diff_gbps": acc.canon_bytes / acc.diff_s / 1e9,
        "apply_gbps": acc.canon_bytes / acc.apply_s / 1e9,
        "encode_cpu_gbps": acc.canon_bytes / acc.encode_cpu_s / 1e9,
        "apply_cpu_gbps": acc.canon_bytes / acc.apply_cpu_s / 1e9,
        "other_encode_gbps": acc.canon_bytes / acc.other_encode_s / 1e9,
        "other_apply_gbps": acc.canon_bytes / acc.other_apply_s / 1e9,
        "other_encode_cpu_gbps": acc.canon_bytes / acc.other_encode_cpu_s / 1e9,
        "other_apply_cpu_gbps": acc.canon_bytes / acc.other_apply_cpu_s / 1e9,
        "canonical_bytes": acc.canon_bytes,
        "frames": acc.frames,
        "bit_exact": bool(acc.exact),
        "peers_bit_exact": bool(acc.peers_exact),
        "peers": dict(acc.peers),
        "peers_bytes_per_change": {k: v / c for k, v in acc.peers.items()},
        **extra,
    }
