"""Value planes: split fixed-width integers into byte planes so a compressor sees their structure.

The XOR mask of a small BF16 update has a near-zero high byte (sign and exponent rarely flip) and a
busy low byte (mantissa). Interleaved, a byte-oriented compressor sees one noisy stream; split into
plane 0 (all low bytes) and plane 1 (all high bytes), the high plane shrinks to almost nothing.
Plane ``j`` holds byte ``j`` (little-endian) of every value.
"""

from __future__ import annotations

import numpy as np

from dcr_ray.codec.compiled import kernels


def split(values: np.ndarray) -> list[np.ndarray]:
    """Byte planes (uint8 arrays, little-endian byte order) of an unsigned integer array."""
    w = values.dtype.itemsize
    if w == 1:
        return [np.ascontiguousarray(values).view(np.uint8)]
    b = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<")).view(np.uint8).reshape(-1, w)
    return [np.ascontiguousarray(b[:, j]) for j in range(w)]


def join(planes: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """Inverse of :func:`split`: values of ``dtype`` (native byte order) from equal-length planes."""
    dtype = np.dtype(dtype)
    w = dtype.itemsize
    if w == 1:
        return planes[0].view(dtype)
    if w == 2 and dtype == np.uint16 and kernels.ENABLED:
        return kernels.join2(planes[0], planes[1])
    n = len(planes[0])
    b = np.empty((n, w), np.uint8)
    for j, p in enumerate(planes):
        b[:, j] = p
    return b.reshape(-1).view(dtype.newbyteorder("<")).astype(dtype, copy=False)
