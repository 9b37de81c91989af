"""Measurements beside the cases: the fixed cost of many small tensors, a memory-bandwidth reference and
a zstd level sweep."""

from __future__ import annotations

import time

from benchmarks.codec.measure import Step
from benchmarks.codec.timing import decode_apply, encode, exact, fresh_targets, meta, timed
from benchmarks.codec.settings import LINK_GBITPS, ZSTD_LEVELS


def measure_fixed_cost(step: Step, coding: str) -> dict:
    """One refit of a many-tensor step, timed once (the cost is per tensor, not per byte), two ways:
    packs (what owners send for small tensors: :mod:`dcr_ray.codec.packed`) and one item per tensor.
    Each: the owner's encode (diff + frames) and the engine's decode (against a shapes table, as engines
    do) + apply; wire bytes (and those of plain per-tensor items, earlier releases' frames); bit-exact."""
    import numpy as np

    from dcr_ray.codec import apply_decoded, decode_frame, encode_frames, open_frame
    from dcr_ray.codec.bits import wire_name
    from dcr_ray.codec.arena import address
    from dcr_ray.codec.encoding.packdiff import diff_pack
    from dcr_ray.codec.packed import plan_packs

    shapes = {n: (wire_name(t.dtype), tuple(t.shape)) for n, t in step.new.items()}
    plan = plan_packs({n: t.numel() for n, t in step.new.items()})
    addrs = [np.fromiter((address(step.old[n]) for n in grp), np.int64, len(grp)) for grp in plan]  # kept by baselines

    def receive(frames, keep_packs):
        tg = fresh_targets(step)
        t0 = time.perf_counter()
        decoded = [decode_frame(open_frame(f, key=None), shapes=shapes, keep_packs=keep_packs) for f in frames]
        t_dec = time.perf_counter() - t0
        for d in decoded:
            apply_decoded(d, tg)
        return t_dec, time.perf_counter() - t0, exact(tg, step)

    def diff(grp, a):
        return diff_pack(grp, [shapes[n][1] for n in grp], [step.old[n] for n in grp], [step.new[n] for n in grp], a)

    warm = plan[0][:8]  # load the compiled kernels (numba's cache) before the clock starts
    for f in encode_frames([diff(warm, addrs[0][:8])], meta(), coding=coding):
        apply_decoded(decode_frame(open_frame(f, key=None), shapes=shapes, keep_packs=True), fresh_targets(
            Step(old={n: step.old[n] for n in warm}, new={n: step.new[n] for n in warm})))
    t0 = time.perf_counter()
    packs = [diff(grp, a) for grp, a in zip(plan, addrs)]
    frames = list(encode_frames([p for p in packs if p is not None], meta(), coding=coding))
    t_enc = time.perf_counter() - t0
    t_dec, t_app, ok = receive(frames, True)
    changed = sum(p.changed for p in packs if p is not None)
    del packs
    t0 = time.perf_counter()
    deltas, item_frames = encode(step, coding=coding)
    t_enc_items = time.perf_counter() - t0
    _, t_app_items, ok_items = receive(item_frames, False)
    plain = list(encode_frames(deltas, meta(), coding="plain")) if coding == "context" else item_frames
    n = len(step.new)
    wire = sum(map(len, frames))
    return {"tensors": n, "elements": sum(t.numel() for t in step.new.values()), "changed": changed,
            "frames": len(frames), "wire_bytes": wire, "bytes_per_change": wire / max(changed, 1),
            "items_bytes_per_change": sum(map(len, item_frames)) / max(changed, 1),
            "today_bytes_per_change": sum(map(len, plain)) / max(changed, 1),
            "encode_s": t_enc, "decode_s": t_dec, "decode_apply_s": t_app,
            "encode_us_per_tensor": t_enc / n * 1e6, "decode_apply_us_per_tensor": t_app / n * 1e6,
            "items_encode_s": t_enc_items, "items_decode_apply_s": t_app_items,
            "bit_exact": ok and ok_items}


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    """numpy copy bandwidth (bytes copied per second / 1e9) of a ``nbytes`` array (best of repeats)."""
    import numpy as np

    src = np.ones(nbytes // 8, np.uint64)
    dst = np.empty_like(src)
    t = timed(lambda: np.copyto(dst, src), max(repeats, 3)).best
    return src.nbytes / t / 1e9


def zstd_sweep(step: Step, repeats: int) -> list[dict]:
    """Wire bytes and frame encode/decode speed of each zstd level on ``step`` (same changed set).

    Every level runs with the codec's hash-table setting (``encode.ZSTD_HASH_LOG``); one more row runs
    the default level with zstd's own default table, to show what that setting buys.
    """
    from dcr_ray.codec import diff_tensor, encode_frames
    from dcr_ray.codec.encoding import encode as encode_mod

    deltas = [diff_tensor(n, step.old[n], t) for n, t in step.new.items()]
    t_diff = timed(lambda: [diff_tensor(n, step.old[n], t) for n, t in step.new.items()], repeats).best
    canon = sum(t.numel() * t.element_size() for t in step.new.values())
    changed = sum(d.changed for d in deltas)
    tuned = encode_mod.ZSTD_HASH_LOG
    variants = [(level, tuned) for level in ZSTD_LEVELS]
    if tuned is not None:
        variants.append((encode_mod.DEFAULT_ZSTD_LEVEL, None))
    out = []
    for level, hash_log in variants:
        encode_mod.ZSTD_HASH_LOG = hash_log
        try:
            got = timed(lambda: list(encode_frames(deltas, meta(), zstd_level=level, coding="context")), repeats)
        finally:
            encode_mod.ZSTD_HASH_LOG = tuned
        t_fr, frames = got.best, got.result
        t_app = timed(lambda tg: decode_apply(frames, tg), repeats, setup=lambda: fresh_targets(step)).best
        tg = fresh_targets(step)
        decode_apply(frames, tg)
        wire = sum(map(len, frames))
        row = {"level": level, "hash_log": hash_log if hash_log is not None else "zstd default",
               "wire_bytes": wire, "bytes_per_change": wire / changed,
               "frame_encode_s": t_fr, "frame_encode_gbps": canon / t_fr / 1e9,
               "encode_gbps": canon / (t_diff + t_fr) / 1e9,
               "apply_gbps": canon / t_app / 1e9, "bit_exact": exact(tg, step)}
        for gbit in LINK_GBITPS:  # serial estimate: encode + transfer + decode/apply
            row[f"refit_s_at_{gbit:g}gbit"] = t_diff + t_fr + wire * 8 / (gbit * 1e9) + t_app
        out.append(row)
    return out
