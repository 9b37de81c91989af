"""Dispatch between the CuPy kernels (:mod:`cuda_ext.kernels`) and the numpy path."""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from dcr_ray.codec.bits import bits_view, np_uint
from dcr_ray.errors import IndexOutOfRangeError, TargetMismatchError

#: ``device="auto"`` uploads host arrays to the GPU from this many elements on.
UPLOAD_MIN_ELEMS = 1 << 22
_GRID_MAX = 65535


@functools.lru_cache(maxsize=1)
def cupy_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device (cached)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "is_cuda")


def _is_cupy(x) -> bool:
    return type(x).__module__.startswith("cupy")


def on_gpu(x) -> bool:
    """Whether ``x`` lives in GPU memory (a CuPy array or a CUDA torch tensor)."""
    return _is_cupy(x) or (_is_torch(x) and x.is_cuda)


def _stream_for(*xs):
    """CuPy's stream context matching torch's current stream when torch CUDA tensors are involved."""
    if any(_is_torch(x) and x.is_cuda for x in xs):
        import cupy
        import torch

        return cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    return contextlib.nullcontext()


def _host_bits(x, *, inplace: bool = False) -> np.ndarray:
    """A flat unsigned-integer numpy view of a host array / CPU tensor (zero-copy where possible;
    ``inplace`` demands zero-copy, since writes must reach ``x``)."""
    if _is_torch(x):
        if not x.is_contiguous():
            if inplace:
                raise TargetMismatchError("cuda_ext writes need a contiguous destination tensor")
            x = x.contiguous()
        return bits_view(x.detach())
    a = np.asarray(x)
    if inplace and not a.flags.c_contiguous:
        raise TargetMismatchError("cuda_ext writes need a C-contiguous destination array")
    a = a.reshape(-1)
    return a.view(np_uint(a.dtype.itemsize))


def _device_bits(x):
    """A flat unsigned-integer CuPy view of a device array / CUDA tensor (zero-copy)."""
    import cupy

    if _is_torch(x):
        if not x.is_contiguous():
            raise TargetMismatchError("cuda_ext needs contiguous CUDA tensors")
        a = cupy.asarray(x.detach().reshape(-1))
    else:
        a = x.reshape(-1)
    return a.view(np_uint(a.dtype.itemsize))


# ---------------------------------------------------------------------------------------------------
# owner side: fused compare + compaction
# ---------------------------------------------------------------------------------------------------
def diff_compact(old, new, *, device: str = "auto"):
    """``(positions int64, xor, new)`` where the bits of ``old`` and ``new`` differ, sorted by position.

    Results live where the inputs live (numpy for host inputs, CuPy for device inputs). ``device``:
    ``auto`` (GPU for device inputs, or host inputs of at least :data:`UPLOAD_MIN_ELEMS` elements when
    a GPU is usable), ``gpu`` or ``cpu``.
    """
    if device not in ("auto", "gpu", "cpu"):
        raise ValueError(f"device must be 'auto', 'gpu' or 'cpu', got {device!r}")
    dev_in = on_gpu(old) or on_gpu(new)
    if dev_in and not (on_gpu(old) and on_gpu(new)):
        raise TargetMismatchError("diff_compact needs both arrays on the same side (host or GPU)")
    if dev_in:
        return _diff_gpu(old, new)
    o, n = _host_bits(old), _host_bits(new)
    _check_pair(o, n)
    use_gpu = device == "gpu" or (device == "auto" and len(o) >= UPLOAD_MIN_ELEMS and cupy_available())
    if use_gpu:
        import cupy

        p, x, v = _diff_gpu(cupy.asarray(o), cupy.asarray(n))
        return cupy.asnumpy(p), cupy.asnumpy(x), cupy.asnumpy(v)
    from dcr_ray.codec.encoding.scan import changed_positions

    pos, xor = changed_positions(o, n)
    return pos, xor, n[pos]


def _check_pair(o, n) -> None:
    if o.dtype != n.dtype or o.shape != n.shape:
        raise TargetMismatchError(f"diff_compact: arrays differ: {o.dtype}{o.shape} vs {n.dtype}{n.shape}")


def _diff_gpu(old, new):
    import cupy

    from cuda_ext import kernels

    with _stream_for(old, new):
        o, n = _device_bits(old), _device_bits(new)
        _check_pair(o, n)
        w = o.dtype.itemsize
        size = int(o.size)
        nblocks = max(1, -(-size // kernels.TILE))
        counts = cupy.empty(nblocks, dtype=cupy.uint32)
        kernels.kernel("count", w)((nblocks,), (kernels.BLOCK,), (o, n, cupy.int64(size), counts))
        incl = cupy.cumsum(counts, dtype=cupy.uint64)
        total = int(incl[-1])
        first = incl - counts.astype(cupy.uint64)
        pos = cupy.empty(total, dtype=cupy.int64)
        xor = cupy.empty(total, dtype=o.dtype)
        vals = cupy.empty(total, dtype=o.dtype)
        if total:
            kernels.kernel("compact", w)((nblocks,), (kernels.BLOCK,),
                                         (o, n, cupy.int64(size), first, pos, xor, vals))
        return pos, xor, vals


# ---------------------------------------------------------------------------------------------------
# receiver side: scatter XOR / OVERWRITE
# ---------------------------------------------------------------------------------------------------
def scatter_xor(dst, positions, values, *, check: bool = True) -> None:
    """``dst[positions] ^= values`` in place (positions unique, flat element indices)."""
    _scatter(dst, positions, values, "scatter_xor", check)


def scatter_overwrite(dst, positions, values, *, check: bool = True) -> None:
    """``dst[positions] = values`` in place (positions unique, flat element indices)."""
    _scatter(dst, positions, values, "scatter_set", check)


def _scatter(dst, positions, values, name: str, check: bool) -> None:
    if on_gpu(dst):
        _scatter_gpu(dst, positions, values, name, check)
        return
    d = _host_bits(dst, inplace=True)
    p = np.asarray(positions.cpu() if _is_torch(positions) else positions, dtype=np.int64).reshape(-1)
    v = _host_bits(values.cpu() if _is_torch(values) else values)
    _check_scatter(d.dtype.itemsize, len(d), p, v, check)
    if name == "scatter_xor":
        d[p] ^= v
    else:
        d[p] = v


def _check_scatter(width: int, size: int, p, v, check: bool) -> None:
    if v.dtype.itemsize != width:
        raise TargetMismatchError(f"values of {v.dtype.itemsize} bytes for {width}-byte elements")
    if len(p) != len(v):
        raise TargetMismatchError(f"{len(p)} positions but {len(v)} values")
    if check and len(p) and (int(p.min()) < 0 or int(p.max()) >= size):
        raise IndexOutOfRangeError(f"positions [{int(p.min())}, {int(p.max())}] outside the {size} elements")


def _scatter_gpu(dst, positions, values, name: str, check: bool) -> None:
    import cupy

    from cuda_ext import kernels

    with _stream_for(dst, positions, values):
        d = _device_bits(dst)
        p = cupy.asarray(positions.detach() if _is_torch(positions) else positions).reshape(-1)
        if p.dtype != cupy.int64:
            p = p.astype(cupy.int64)
        v = _device_bits(values if on_gpu(values) else cupy.asarray(_host_bits(values)))
        _check_scatter(d.dtype.itemsize, int(d.size), p, v, check)
        m = int(p.size)
        if m:
            grid = min(_GRID_MAX, -(-m // kernels.BLOCK))
            kernels.kernel(name, d.dtype.itemsize)((grid,), (kernels.BLOCK,), (d, p, v, cupy.int64(m)))
