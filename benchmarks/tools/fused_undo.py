"""Time an engine's in-place apply with its undo record: two passes (read back, then apply) vs one
(the apply keeps the bits it replaces as it writes them), and the apply alone as the floor.

A set of BF16 tensors (``--mib`` MiB in all) changes at ``--rates``; the frames are the real codec's
(``diff_tensor`` + ``encode_frames``, decoded fresh before every repeat, untimed, so class-order
positions are resolved inside the timed step each time). Each repeat starts from the old bits. GB/s
are canonical bytes (the tensor set's size) per second of the timed step; ``ns/change`` per changed
element; ``cpu s``: process CPU seconds of the step (all threads), steadier than wall time on a
loaded machine. The bits after each variant and each rollback are checked against the expected ones.

    python -m benchmarks.tools.fused_undo --mib 256 --rates 0.01 0.03 --repeats 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from dcr_ray.codec import FrameMeta, apply_decoded, decode_frame, diff_tensor, encode_frames, open_frame
from dcr_ray.codec.bits import bits_view, wire_name
from dcr_ray.codec.compiled import kernels
from dcr_ray.codec.decoding.undo import UndoLog

META = FrameMeta(transfer="t", attempt=0, producer="o", payload=0, base=1, target=2)


class _Backend:
    def __init__(self, tensors):
        self.tensors = tensors

    def apply(self, frame) -> None:
        apply_decoded(frame, self.tensors)

    def flush(self) -> None:
        pass


def tensor_set(mib: int, n_tensors: int, rate: float, seed: int):
    per = (mib << 20) // 2 // n_tensors
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for i in range(n_tensors):
        t = (torch.randn(per, generator=g) * 0.02).to(torch.bfloat16)
        w = t.clone()
        b = bits_view(w)
        pos = rng.choice(per, int(per * rate), replace=False)
        b[pos] = (b[pos].astype(np.int64) + rng.choice([-2, -1, 1, 2], len(pos))).astype(np.uint16)
        old[f"layers.{i}.weight"], new[f"layers.{i}.weight"] = t, w
    return old, new


def run(mib: int, rate: float, coding: str, repeats: int, n_tensors: int) -> dict:
    old, new = tensor_set(mib, n_tensors, rate, seed=int(rate * 1e4))
    deltas = [diff_tensor(n, bits_view(old[n]).copy(), new[n], class_order=coding == "context") for n in old]
    frames = list(encode_frames(deltas, META, coding=coding))
    shapes = {n: (wire_name(t.dtype), tuple(t.shape)) for n, t in old.items()}
    changed = sum(d.changed for d in deltas)
    live = {n: t.clone() for n, t in old.items()}

    def same(a, b) -> bool:
        return all(np.array_equal(bits_view(a[n]), bits_view(b[n])) for n in a)

    def step(variant: str) -> tuple[float, float]:
        for n, t in old.items():
            bits_view(live[n])[:] = bits_view(t)
        decoded = [decode_frame(open_frame(f, key=None), shapes=shapes) for f in frames]
        log = UndoLog()
        t0, c0 = time.perf_counter(), time.process_time()
        for d in decoded:
            if variant == "apply only":
                apply_decoded(d, live)
            elif variant == "two-pass":
                log.record("t", d, live)
                apply_decoded(d, live)
            else:
                apply_decoded(d, live, undo=log.open("t", d))
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        assert same(live, new), variant
        if variant != "apply only":
            log.rollback(_Backend(live))
            assert same(live, old), variant
        return dt, dc

    out = {}
    variants = ["apply only", "two-pass", "fused"]
    times = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    step("fused")  # warm: kernels loaded, pages touched
    for _ in range(repeats):
        for v in variants:  # interleaved, so a change in the machine's load hits every variant alike
            dt, dc = step(v)
            times[v].append(dt)
            cpu[v].append(dc)
    size = sum(t.numel() * t.element_size() for t in old.values())
    for v in variants:
        med = statistics.median(times[v])
        out[v] = {"median_s": med, "GB/s": size / med / 1e9, "ns/change": med / changed * 1e9,
                  "min_s": min(times[v]), "max_s": max(times[v]), "cpu_s": statistics.median(cpu[v]),
                  "GB/cpu s": size / statistics.median(cpu[v]) / 1e9}
    out["changed"] = changed
    out["frames"] = len(frames)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.01, 0.03])
    ap.add_argument("--codings", nargs="+", default=["plain", "context"])
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    kernels.warm_up(background=False)
    from dcr_ray.codec.compiled import threads

    print(f"{a.mib} MiB bf16 in {a.tensors} tensors, jit={kernels.ENABLED}, codec threads={threads.codec_threads()}, "
          f"load average {os.getloadavg()[0]:.1f}, {a.repeats} repeats (median)")
    print(f"{'coding':8} {'changed':>7} {'variant':>10} {'GB/s':>7} {'ns/change':>9} {'median s':>9} "
          f"{'min..max s':>14} {'cpu s':>7} {'GB/cpu s':>8}")
    for coding in a.codings:
        for rate in a.rates:
            r = run(a.mib, rate, coding, a.repeats, a.tensors)
            for v in ("apply only", "two-pass", "fused"):
                x = r[v]
                print(f"{coding:8} {rate:7.1%} {v:>10} {x['GB/s']:7.2f} {x['ns/change']:9.2f} {x['median_s']:9.4f} "
                      f"{x['min_s']:6.4f}..{x['max_s']:6.4f} {x['cpu_s']:7.4f} {x['GB/cpu s']:8.2f}")
            two, one, bare = r["two-pass"], r["fused"], r["apply only"]
            print(f"{'':17} fused vs two-pass: median {two['median_s'] / one['median_s']:.2f}x, min "
                  f"{two['min_s'] / one['min_s']:.2f}x, cpu {two['cpu_s'] / one['cpu_s']:.2f}x; the undo record "
                  f"adds (min) {two['min_s'] - bare['min_s']:+.4f} s two-pass, "
                  f"{one['min_s'] - bare['min_s']:+.4f} s fused")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
