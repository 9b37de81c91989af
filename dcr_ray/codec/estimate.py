"""Size estimates that pick an item's coding before anything is compressed.

A frame compresses each section once (:mod:`~dcr_ray.codec.encode`), so the exact compressed size of
one item's bytes is never known on its own. What zstd does with these near-memoryless streams is
Huffman-code their bytes (long matches are rare), so the zero-order entropy of an item's byte streams
is the estimate: ``sum over streams of len * H(byte histogram) / 8``. It ranks two codings of the same
item (XOR or ADD values, flat or class-order positions) the way the compressed frame does, at the cost
of one byte histogram per stream.
"""

from __future__ import annotations

import numpy as np


def entropy_bytes(*streams) -> float:
    """Zero-order entropy, in bytes, of byte streams (``bytes`` or arrays, taken as their raw bytes)."""
    total = 0.0
    for s in streams:
        b = np.frombuffer(s, np.uint8) if isinstance(s, (bytes, bytearray, memoryview)) else \
            np.ascontiguousarray(s).view(np.uint8).reshape(-1)
        n = len(b)
        if n < 2:
            total += n
            continue
        c = np.bincount(b, minlength=256)
        c = c[c > 0].astype(np.float64)
        total += float(n * np.log2(n) - (c * np.log2(c)).sum()) / 8
    return total


def planes_bytes(planes) -> float:
    """Estimated compressed size of value byte planes."""
    return entropy_bytes(*planes)
