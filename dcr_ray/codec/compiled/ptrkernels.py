"""Compiled kernels over many small tensors at once, addressed by their data pointers.

A *pack* (:mod:`~dcr_ray.codec.packed`) treats ``k`` tensors of one dtype as one flat space: tensor
``t`` holds pack positions ``offsets[t] .. offsets[t + 1]``. Each tensor keeps its own storage (a model's
parameters, a baseline's slices), so the kernels take one base address per tensor (``data_ptr()``) and
walk the pack's sorted positions once, advancing the tensor index as they go: one call per pack, not one
Python round trip per tensor. That is what makes 10^5 expert tensors cost milliseconds instead of seconds.

Addresses are raw: the kernels check no bounds. Callers guarantee that every address points at a live,
contiguous CPU buffer of at least ``offsets[t + 1] - offsets[t]`` elements of the values' width, and that
the positions are validated (sorted, unique, inside ``[0, offsets[-1])``); :mod:`~dcr_ray.codec.decoding.decode`
validates frames and :mod:`~dcr_ray.codec.decoding.apply` checks every target before the first write.

Without numba (or with ``DCR_RAY_JIT=0``, :mod:`~dcr_ray.codec.compiled.jit`) :data:`ENABLED` is false and callers
use their numpy paths (one view per tensor: correct, and as slow as per-tensor items).
"""

from __future__ import annotations

import numpy as np

from dcr_ray.codec.arena import address
from dcr_ray.codec.compiled.jit import ENABLED, once

__all__ = ["ENABLED", "scan", "xor_into", "add_into", "put_into", "swap_into", "take_from"]


def _build() -> dict:
    """The pointer-walk and scan kernels (:mod:`~dcr_ray.codec.compiled.ptrkernels_numba`, imported on first use)."""
    from dcr_ray.codec.compiled import ptrkernels_numba as k

    return {"walk": k.walk, "walk_swap": k.walk_swap, "scan": k.scan}


#: The kernels by name, compiled on first use (numba is slow to import; most processes never need them).
_compiled = once(_build)


def compiled() -> dict:
    """The compiled kernels by name (numba dispatchers, compiled on first use): for inspection, e.g. the
    signatures each holds and its on-disk cache's hits and misses."""
    return _compiled()


def xor_into(addrs: np.ndarray, offsets: np.ndarray, pos: np.ndarray, vals: np.ndarray) -> None:
    """``tensor_t[p - offsets[t]] ^= v`` for every pack position ``p`` (in tensor ``t``) and value ``v``."""
    _compiled()["walk"](addrs, offsets, pos, vals, 0)


def add_into(addrs: np.ndarray, offsets: np.ndarray, pos: np.ndarray, vals: np.ndarray) -> None:
    """``tensor_t[p - offsets[t]] += v`` modulo the word size."""
    _compiled()["walk"](addrs, offsets, pos, vals, 1)


def put_into(addrs: np.ndarray, offsets: np.ndarray, pos: np.ndarray, vals: np.ndarray) -> None:
    """``tensor_t[p - offsets[t]] = v``."""
    _compiled()["walk"](addrs, offsets, pos, vals, 2)


#: :func:`swap_into`'s operation per encoding name (the walk's op codes).
_SWAP_OPS = {"xor": 0, "add": 1, "overwrite": 2}


def swap_into(addrs: np.ndarray, offsets: np.ndarray, pos: np.ndarray, vals: np.ndarray, op: str) -> np.ndarray:
    """:func:`xor_into` (``op="xor"``), :func:`add_into` (``"add"``) or :func:`put_into` (``"overwrite"``),
    returning the bits each write replaced, in pack order: the write and its undo record in one pass."""
    old = np.empty(len(pos), vals.dtype)
    _compiled()["walk_swap"](addrs, offsets, pos, vals, old, _SWAP_OPS[op])
    return old


def take_from(addrs: np.ndarray, offsets: np.ndarray, pos: np.ndarray, dtype) -> np.ndarray:
    """The bits at every pack position (``tensor_t[p - offsets[t]]``), as ``dtype``."""
    out = np.empty(len(pos), dtype)
    _compiled()["walk"](addrs, offsets, pos, out, 3)
    return out


def scan(old_addrs: np.ndarray, new_addrs: np.ndarray, offsets: np.ndarray, dtype):
    """Pack positions, XOR masks and new bits where the tensors at ``new_addrs`` differ from those at
    ``old_addrs`` (both of elements ``dtype``, an unsigned integer type), in increasing order.

    The outputs start at 1/32 of the pack (at least its largest tensor) and double when a scan fills
    them; each part is copied down to its size, so memory follows the changes, not the pack."""
    k = len(offsets) - 1
    if k <= 0:
        return np.empty(0, np.int64), np.empty(0, dtype), np.empty(0, dtype)
    cap = max(1 << 12, int(np.max(np.diff(offsets))), int(offsets[-1]) >> 5)
    kernel = _compiled()["scan"]
    parts = []
    t = 0
    while t < k:
        pos, xor, new = np.empty(cap, np.int64), np.empty(cap, dtype), np.empty(cap, dtype)
        t, n = kernel(old_addrs, new_addrs, offsets, t, pos, xor, new)
        parts.append((pos[:n].copy(), xor[:n].copy(), new[:n].copy()))
        cap *= 2
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate(col) for col in zip(*parts))


def warm_up() -> None:
    """Load (or compile) the kernels for every element width, as :func:`dcr_ray.codec.compiled.kernels.warm_up`
    does for the per-tensor kernels (which calls this). Writes only zeros into scratch arrays."""
    offsets = np.array([0, 4], np.int64)
    pos = np.arange(2, dtype=np.int64)
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        a, b = np.zeros(4, dt), np.zeros(4, dt)
        addrs, other = (np.array([address(x)], np.int64) for x in (a, b))
        scan(addrs, other, offsets, dt)
        take_from(addrs, offsets, pos, dt)
        vals = np.zeros(2, dt)  # (one kernel also reads into its values, so they are always writable)
        xor_into(addrs, offsets, pos, vals)
        add_into(addrs, offsets, pos, vals)
        put_into(addrs, offsets, pos, vals)
        for op in _SWAP_OPS:
            swap_into(addrs, offsets, pos, vals, op)
