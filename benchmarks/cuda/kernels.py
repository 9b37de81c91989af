"""GPU codec micro-benchmark: fused compare + compaction and scatter, GPU vs the numpy path.

``python -m benchmarks.cuda.kernels [--elems N] [--density D]`` — BF16-sized (2-byte) elements with a fraction
``D`` of them changed in their low mantissa bits, as after an optimizer step. Prints throughput over
the bytes read (old + new) and checks the GPU results equal the numpy ones bit for bit.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _timeit(fn, sync, repeat: int = 5) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elems", type=int, default=1 << 26)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--width", type=int, default=2, choices=(1, 2, 4, 8))
    args = ap.parse_args(argv)

    import cuda_ext
    from dcr_ray.codec.bits import np_uint

    dt = np_uint(args.width)
    rng = np.random.default_rng(0)
    old = rng.integers(0, np.iinfo(dt).max, size=args.elems, dtype=dt, endpoint=True)
    new = old.copy()
    idx = np.sort(rng.choice(args.elems, size=int(args.elems * args.density), replace=False))
    new[idx] ^= rng.integers(1, 8, size=len(idx)).astype(dt)
    nbytes = 2 * old.nbytes
    print(f"elements {args.elems:,} x {args.width} B, changed {len(idx):,} ({args.density:.2%})")

    t_cpu = _timeit(lambda: cuda_ext.diff_compact(old, new, device="cpu"), lambda: None, repeat=3)
    print(f"numpy  diff+compact : {t_cpu * 1e3:8.2f} ms  {nbytes / t_cpu / 1e9:7.2f} GB/s")
    if not cuda_ext.cupy_available():
        print("no CuPy / CUDA device: GPU part skipped")
        return 0
    import cupy

    sync = cupy.cuda.get_current_stream().synchronize
    g_old, g_new = cupy.asarray(old), cupy.asarray(new)
    t_gpu = _timeit(lambda: cuda_ext.diff_compact(g_old, g_new), sync)
    print(f"GPU    diff+compact : {t_gpu * 1e3:8.2f} ms  {nbytes / t_gpu / 1e9:7.2f} GB/s  "
          f"({t_cpu / t_gpu:.0f}x numpy)")
    p, x, v = (cupy.asnumpy(a) for a in cuda_ext.diff_compact(g_old, g_new))
    cp, cx, cv = cuda_ext.diff_compact(old, new, device="cpu")
    assert np.array_equal(p, cp) and np.array_equal(x, cx) and np.array_equal(v, cv), "GPU != numpy"

    g_pos, g_x = cupy.asarray(cp), cupy.asarray(cx)
    dst = g_old.copy()
    t_sc = _timeit(lambda: cuda_ext.scatter_xor(dst, g_pos, g_x, check=False), sync)
    print(f"GPU    scatter XOR  : {t_sc * 1e3:8.2f} ms  {len(cp) / t_sc / 1e9:7.2f} G changes/s")
    dst = g_old.copy()
    cuda_ext.scatter_xor(dst, g_pos, g_x)
    assert bool((dst == g_new).all()), "old ^ xor != new on the GPU"
    host = old.copy()
    t_np = _timeit(lambda: cuda_ext.scatter_xor(host, cp, cx, check=False), lambda: None, repeat=3)
    print(f"numpy  scatter XOR  : {t_np * 1e3:8.2f} ms  {len(cp) / t_np / 1e9:7.2f} G changes/s")
    print("GPU results equal the numpy path bit for bit")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
