"""cuda_ext: the GPU kernels give the numpy path's results bit for bit; the host fallback is exact.

The host (numpy) tests run everywhere. Tests marked ``gpu`` need CuPy and a CUDA device and are
skipped otherwise (``cuda_ext/check_gpu.sh`` runs them on a GPU machine).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

try:
    import cuda_ext
except ImportError:  # cuda_ext sits beside dcr_ray and is not (yet) part of the installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import cuda_ext

from cuda_ext import kernels
from dcr_ray.errors import IndexOutOfRangeError, TargetMismatchError

WIDTHS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SIZES = [0, 1, 7, 31, kernels.TILE - 1, kernels.TILE + 1, 3 * kernels.TILE + 5, (1 << 18) + 3]

gpu = pytest.mark.skipif(not cuda_ext.cupy_available(), reason="needs CuPy and a CUDA device")


def _pair(width: int, size: int, density: float, seed: int = 0):
    dt = WIDTHS[width]
    rng = np.random.default_rng(seed)
    old = rng.integers(0, np.iinfo(dt).max, size=size, dtype=dt, endpoint=True)
    new = old.copy()
    k = int(round(size * density))
    if k:
        idx = rng.choice(size, size=k, replace=False)
        new[idx] ^= rng.integers(1, np.iinfo(dt).max, size=k, dtype=dt, endpoint=True)
    return old, new


def _brute(old, new):
    pos = np.flatnonzero(old != new).astype(np.int64)
    return pos, old[pos] ^ new[pos], new[pos]


@pytest.mark.parametrize("width", sorted(WIDTHS))
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
def test_host_diff_compact_finds_every_changed_bit_pattern_in_order(width, density):
    for size in SIZES[:6]:
        old, new = _pair(width, size, density, seed=size)
        got = cuda_ext.diff_compact(old, new, device="cpu")
        for a, b in zip(got, _brute(old, new)):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_host_diff_compact_compares_bits_not_values():
    old = torch.tensor([0.0, float("nan"), 1.0, -0.0], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, float("nan"), 1.0, -0.0], dtype=torch.bfloat16)
    new.view(torch.int16)[1] ^= 1  # another NaN payload
    pos, xor, vals = cuda_ext.diff_compact(old, new)
    assert pos.tolist() == [0, 1]
    assert np.array_equal(vals, new.view(torch.int16).numpy().view(np.uint16)[[0, 1]])
    assert np.array_equal(xor ^ old.view(torch.int16).numpy().view(np.uint16)[[0, 1]], vals)


@pytest.mark.parametrize("width", sorted(WIDTHS))
def test_host_scatter_xor_then_overwrite_reproduce_the_new_bits(width):
    old, new = _pair(width, 5000, 0.05, seed=width)
    pos, xor, vals = cuda_ext.diff_compact(old, new)
    dst = old.copy()
    cuda_ext.scatter_xor(dst, pos, xor)
    assert np.array_equal(dst, new)
    dst = old.copy()
    cuda_ext.scatter_overwrite(dst, pos, vals)
    assert np.array_equal(dst, new)
    t = torch.from_numpy(old.copy().view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[width]))
    cuda_ext.scatter_xor(t, torch.from_numpy(pos), xor)  # CPU tensors are written in place too
    assert np.array_equal(t.numpy().view(WIDTHS[width]), new)


def test_scatter_refuses_out_of_range_positions_and_mismatched_values_before_writing():
    dst = np.zeros(10, np.uint16)
    with pytest.raises(IndexOutOfRangeError):
        cuda_ext.scatter_xor(dst, np.array([3, 10]), np.array([1, 1], np.uint16))
    with pytest.raises(TargetMismatchError):
        cuda_ext.scatter_overwrite(dst, np.array([3]), np.array([1], np.uint32))
    with pytest.raises(TargetMismatchError):
        cuda_ext.scatter_overwrite(np.zeros((4, 4), np.uint16)[:, 1], np.array([0]), np.array([1], np.uint16))
    assert not dst.any()


def test_kernel_sources_are_specialised_for_every_width():
    for w, ctype in kernels.CTYPES.items():
        src = kernels.source(w)
        assert f"typedef {ctype} T;" in src
        for name in ("count", "compact", "scatter_xor", "scatter_set"):
            assert f"dcr_{name}_{w}(" in src
        assert "__W__" not in src and "__CTYPE__" not in src


# ---------------------------------------------------------------------------------------------------
# GPU vs host, bit for bit
# ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("width", sorted(WIDTHS))
@pytest.mark.parametrize("density", [0.0, 0.001, 0.3, 1.0])
def test_gpu_diff_compact_equals_the_numpy_path_bit_for_bit(width, density):
    import cupy

    for size in SIZES:
        old, new = _pair(width, size, density, seed=size + width)
        want = cuda_ext.diff_compact(old, new, device="cpu")
        got = cuda_ext.diff_compact(cupy.asarray(old), cupy.asarray(new))
        for a, b in zip(got, want):
            a = cupy.asnumpy(a)
            assert a.dtype == b.dtype and np.array_equal(a, b), (size, width, density)
        up = cuda_ext.diff_compact(old, new, device="gpu")  # host in, uploaded, host out
        for a, b in zip(up, want):
            assert isinstance(a, np.ndarray) and np.array_equal(a, b)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("width", sorted(WIDTHS))
def test_gpu_scatter_equals_the_numpy_path_bit_for_bit(width):
    import cupy

    old, new = _pair(width, (1 << 20) + 11, 0.02, seed=width)
    pos, xor, vals = cuda_ext.diff_compact(old, new, device="cpu")
    for fn, v in ((cuda_ext.scatter_xor, xor), (cuda_ext.scatter_overwrite, vals)):
        host = old.copy()
        fn(host, pos, v)
        dev = cupy.asarray(old)
        fn(dev, cupy.asarray(pos), cupy.asarray(v))
        assert np.array_equal(cupy.asnumpy(dev), host) and np.array_equal(host, new)
    with pytest.raises(IndexOutOfRangeError):
        cuda_ext.scatter_xor(cupy.zeros(4, cupy.uint16), cupy.asarray([4]), cupy.asarray([1], cupy.uint16))


@pytest.mark.gpu
@gpu
def test_gpu_kernels_write_torch_cuda_tensors_in_place_on_torchs_stream():
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    old = torch.randn(3 * kernels.TILE + 17, device="cuda").to(torch.bfloat16)
    new = old.clone()
    new.view(torch.int16)[::97] ^= 3
    pos, xor, vals = cuda_ext.diff_compact(old.view(torch.int16), new.view(torch.int16))
    want = cuda_ext.diff_compact(old.cpu().view(torch.int16), new.cpu().view(torch.int16), device="cpu")
    import cupy

    assert all(np.array_equal(cupy.asnumpy(a), b) for a, b in zip((pos, xor, vals), want))
    dst = old.clone()
    cuda_ext.scatter_xor(dst.view(torch.int16), torch.as_tensor(want[0], device="cuda"),
                         torch.as_tensor(want[1].view(np.int16), device="cuda"))
    assert torch.equal(dst.view(torch.int16), new.view(torch.int16))


# ---------------------------------------------------------------------------------------------------
# the CUDA sources, executed on CPU threads (no GPU here: this checks the kernels' logic, not CUDA)
# ---------------------------------------------------------------------------------------------------
_EMULATION = r"""
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>
struct Dim { unsigned x; };
thread_local Dim threadIdx, blockIdx;
Dim blockDim, gridDim;
static std::barrier<>* g_block;
struct Warp { std::barrier<>* bar; unsigned long long v[32]; };
static Warp* g_warps;
#define __global__
#define __restrict__ __restrict
#define __shared__ static
inline void __syncthreads() { g_block->arrive_and_wait(); }
inline unsigned __ballot_sync(unsigned, bool p) {
    Warp& w = g_warps[threadIdx.x / 32]; w.v[threadIdx.x % 32] = p; w.bar->arrive_and_wait();
    unsigned b = 0; for (int i = 0; i < 32; ++i) if (w.v[i]) b |= 1u << i;
    w.bar->arrive_and_wait(); return b; }
inline unsigned __shfl_down_sync(unsigned, unsigned x, int off) {
    Warp& w = g_warps[threadIdx.x / 32]; int lane = threadIdx.x % 32; w.v[lane] = x; w.bar->arrive_and_wait();
    unsigned r = lane + off < 32 ? (unsigned)w.v[lane + off] : x; w.bar->arrive_and_wait(); return r; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline unsigned atomicAdd(unsigned* a, unsigned x) { return __atomic_fetch_add(a, x, __ATOMIC_SEQ_CST); }
"""

_DRIVER = r"""
static void launch(unsigned grid, const std::function<void()>& k) {
    gridDim.x = grid; blockDim.x = BLOCK;
    for (unsigned b = 0; b < grid; ++b) {
        std::barrier<> block(BLOCK); g_block = &block;
        std::vector<std::barrier<>*> bars; Warp warps[BLOCK / 32];
        for (int i = 0; i < BLOCK / 32; ++i) { warps[i].bar = new std::barrier<>(32); }
        g_warps = warps;
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < BLOCK; ++t) ts.emplace_back([&, b, t] { blockIdx.x = b; threadIdx.x = t; k(); });
        for (auto& th : ts) th.join();
        for (int i = 0; i < BLOCK / 32; ++i) delete warps[i].bar;
    }
}
template <class X> static std::vector<X> rd(const char* f, long long n) {
    std::vector<X> v(n); FILE* fp = fopen(f, "rb");
    if (n && fread(v.data(), sizeof(X), n, fp) != (size_t)n) exit(3);
    fclose(fp); return v; }
template <class X> static void wr(const char* f, const std::vector<X>& v) {
    FILE* fp = fopen(f, "wb"); if (!v.empty()) fwrite(v.data(), sizeof(X), v.size(), fp); fclose(fp); }
int main(int argc, char** argv) {
    long long n = atoll(argv[1]);
    auto o = rd<T>(argv[2], n), w = rd<T>(argv[3], n);
    unsigned nb = n ? (unsigned)((n + TILE - 1) / TILE) : 1;
    std::vector<unsigned> counts(nb);
    launch(nb, [&] { dcr_count_W(o.data(), w.data(), n, counts.data()); });
    std::vector<unsigned long long> first(nb); unsigned long long tot = 0;
    for (unsigned b = 0; b < nb; ++b) { first[b] = tot; tot += counts[b]; }
    std::vector<long long> pos(tot); std::vector<T> x(tot), v(tot);
    if (tot) launch(nb, [&] { dcr_compact_W(o.data(), w.data(), n, first.data(), pos.data(), x.data(), v.data()); });
    std::vector<T> a = o, s = o;
    long long m = (long long)tot;
    launch(3, [&] { dcr_scatter_xor_W(a.data(), pos.data(), x.data(), m); });
    launch(2, [&] { dcr_scatter_set_W(s.data(), pos.data(), v.data(), m); });
    wr(argv[4], pos); wr(argv[5], x); wr(argv[6], v); wr(argv[7], a); wr(argv[8], s);
    return 0;
}
"""


@pytest.mark.slow
@pytest.mark.parametrize("width", sorted(WIDTHS))
def test_cuda_kernel_sources_run_on_emulated_threads_give_the_numpy_results(width, tmp_path):
    """The kernels' own source, compiled with g++ against a small CUDA emulation (one OS thread per
    CUDA thread, real barriers for ``__syncthreads`` and warp intrinsics): sorted compaction, XOR masks,
    new bits and both scatters must equal the numpy path. A stand-in: the GPU run is ``check_gpu.sh``."""
    import shutil
    import subprocess

    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++ (C++20) to emulate the kernels")
    src = tmp_path / "emu.cpp"
    src.write_text(_EMULATION + kernels.source(width) + _DRIVER.replace("_W(", f"_{width}("))
    exe = tmp_path / "emu"
    r = subprocess.run([cxx, "-std=c++20", "-O1", "-pthread", str(src), "-o", str(exe)], capture_output=True, text=True)
    if r.returncode:
        pytest.fail(r.stderr[-3000:])
    dt = WIDTHS[width]
    for size, density in ((0, 0.0), (5, 1.0), (kernels.TILE + 1, 0.01), (2 * kernels.TILE + 37, 0.4)):
        old, new = _pair(width, size, density, seed=size)
        (tmp_path / "o").write_bytes(old.tobytes())
        (tmp_path / "n").write_bytes(new.tobytes())
        outs = [str(tmp_path / f"out{i}") for i in range(5)]
        subprocess.run([str(exe), str(size), str(tmp_path / "o"), str(tmp_path / "n"), *outs], check=True, timeout=120)
        pos, xor, vals, after_xor, after_set = (
            np.fromfile(outs[0], np.int64), *(np.fromfile(f, dt) for f in outs[1:]))
        want = cuda_ext.diff_compact(old, new, device="cpu")
        assert np.array_equal(pos, want[0]) and np.array_equal(xor, want[1]) and np.array_equal(vals, want[2])
        assert np.array_equal(after_xor, new) and np.array_equal(after_set, new)


@pytest.mark.parametrize("width", sorted(WIDTHS))
def test_cuda_kernel_sources_compile_with_nvcc_when_a_toolkit_is_installed(width, tmp_path):
    import shutil
    import subprocess

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no CUDA toolkit (nvcc) here")
    src = tmp_path / "k.cu"
    src.write_text(kernels.source(width))
    r = subprocess.run([nvcc, "--std=c++14", "-arch=sm_80", "--ptx", str(src), "-o", str(tmp_path / "k.ptx")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    ptx = (tmp_path / "k.ptx").read_text()
    for name in ("count", "compact", "scatter_xor", "scatter_set"):
        assert f"dcr_{name}_{width}" in ptx


@pytest.mark.vllm
def test_the_patch_benchmark_runs_both_paths_and_the_sparse_write_is_exact():
    """``benchmarks.cuda.patch`` on whatever device there is (CPU here: a smoke test of the GPU script)."""
    pytest.importorskip("vllm")
    from benchmarks.cuda import patch

    assert patch.main(["--elems", str(1 << 16), "--repeat", "1"]) == 0
