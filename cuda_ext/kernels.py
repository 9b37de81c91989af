"""CUDA C sources of the codec's hot loops and their CuPy compilation (lazy, cached per element width).

Owner side, **fused compare + compaction** (two launches, one pass over the data each):

1. ``dcr_count_<w>``: every block counts the changed elements (``old != new`` on the integer bits) of
   its tile of ``TILE`` consecutive elements;
2. an exclusive prefix sum over the per-block counts (CuPy ``cumsum``) gives each block its first
   output slot;
3. ``dcr_compact_<w>``: every block walks its tile again in ``ITEMS`` rounds of ``BLOCK`` elements and
   writes, for each changed element, its position, ``old ^ new`` and ``new`` — warp ballots and a
   per-round prefix over the warps keep the output **sorted by position**, exactly as the numpy path
   (``dcr_ray.codec.encoding.scan.changed_positions``) returns it, so the location coder sees the same input.

Receiver side: ``dcr_scatter_xor_<w>`` (``dst[pos[i]] ^= val[i]``) and ``dcr_scatter_set_<w>``
(``dst[pos[i]] = val[i]``), grid-stride loops; positions within one call are unique (frames reject
overlapping items), so no atomics are needed — CUDA stores of 1- and 2-byte elements do not tear
neighbouring bytes.

Element types are the unsigned integers of width 1/2/4/8 bytes: every float format is compared and
written as its bits.
"""

from __future__ import annotations

import functools

BLOCK = 256
ITEMS = 16
TILE = BLOCK * ITEMS

CTYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}

_SOURCE = r"""
#define BLOCK __BLOCK__
#define ITEMS __ITEMS__
#define TILE (BLOCK * ITEMS)
typedef __CTYPE__ T;

extern "C" __global__ void dcr_count___W__(const T* __restrict__ old_, const T* __restrict__ new_,
                                            const long long n, unsigned int* __restrict__ counts) {
    __shared__ unsigned int total;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    const long long base = (long long)blockIdx.x * TILE;
    unsigned int c = 0;
    for (int r = 0; r < ITEMS; ++r) {
        const long long i = base + (long long)r * BLOCK + threadIdx.x;
        if (i < n && old_[i] != new_[i]) ++c;
    }
    for (int off = 16; off > 0; off >>= 1) c += __shfl_down_sync(0xffffffffu, c, off);
    if ((threadIdx.x & 31) == 0) atomicAdd(&total, c);
    __syncthreads();
    if (threadIdx.x == 0) counts[blockIdx.x] = total;
}

extern "C" __global__ void dcr_compact___W__(const T* __restrict__ old_, const T* __restrict__ new_,
                                              const long long n,
                                              const unsigned long long* __restrict__ first_slot,
                                              long long* __restrict__ pos, T* __restrict__ xor_out,
                                              T* __restrict__ new_out) {
    __shared__ unsigned int warp_count[BLOCK / 32];
    __shared__ unsigned long long running;
    if (threadIdx.x == 0) running = first_slot[blockIdx.x];
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const long long base = (long long)blockIdx.x * TILE;
    for (int r = 0; r < ITEMS; ++r) {
        const long long i = base + (long long)r * BLOCK + threadIdx.x;
        T o = 0, w = 0;
        bool changed = false;
        if (i < n) {
            o = old_[i];
            w = new_[i];
            changed = (o != w);
        }
        const unsigned int ballot = __ballot_sync(0xffffffffu, changed);
        if (lane == 0) warp_count[warp] = __popc(ballot);
        __syncthreads();
        unsigned int before = 0, round_total = 0;
        for (int k = 0; k < BLOCK / 32; ++k) {
            const unsigned int c = warp_count[k];
            if (k < warp) before += c;
            round_total += c;
        }
        if (changed) {
            const unsigned long long slot = running + before + __popc(ballot & ((1u << lane) - 1u));
            pos[slot] = i;
            xor_out[slot] = (T)(o ^ w);
            new_out[slot] = w;
        }
        __syncthreads();
        if (threadIdx.x == 0) running += round_total;
        __syncthreads();
    }
}

extern "C" __global__ void dcr_scatter_xor___W__(T* __restrict__ dst, const long long* __restrict__ pos,
                                                  const T* __restrict__ val, const long long m) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < m;
         i += (long long)gridDim.x * blockDim.x) {
        dst[pos[i]] ^= val[i];
    }
}

extern "C" __global__ void dcr_scatter_set___W__(T* __restrict__ dst, const long long* __restrict__ pos,
                                                  const T* __restrict__ val, const long long m) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < m;
         i += (long long)gridDim.x * blockDim.x) {
        dst[pos[i]] = val[i];
    }
}
"""


def source(width: int) -> str:
    """The CUDA source specialised for ``width``-byte elements."""
    return (_SOURCE.replace("__BLOCK__", str(BLOCK)).replace("__ITEMS__", str(ITEMS))
            .replace("__CTYPE__", CTYPES[width]).replace("__W__", str(width)))


@functools.lru_cache(maxsize=None)
def module(width: int):
    """The compiled CuPy module for ``width``-byte elements (compiled on first use, cached by CuPy)."""
    import cupy

    return cupy.RawModule(code=source(width), options=("--std=c++14",))


def kernel(name: str, width: int):
    """One kernel (``count``, ``compact``, ``scatter_xor``, ``scatter_set``) for ``width``-byte elements."""
    return module(width).get_function(f"dcr_{name}_{width}")
