"""Size estimates that pick an item's coding before anything is compressed.

A frame compresses each section once (:mod:`~dcr_ray.codec.encode`), so the exact compressed size of
one item's bytes is never known on its own. What zstd does with these near-memoryless streams is
Huffman-code their bytes (long matches are rare), so the zero-order entropy of an item's byte streams
is the estimate: ``sum over streams of len * H(byte histogram) / 8``. It ranks two codings of the same
item (XOR or ADD values, flat or class-order positions) the way the compressed frame does, at the cost
of one byte histogram per stream; a long stream is estimated from an evenly strided sample of
:data:`SAMPLE_BYTES` of its bytes (deterministic, so both codings of an item are judged on the same
positions).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

#: Streams of at most this many bytes are counted in Python.
SMALL_BYTES = 64
#: Streams longer than this are estimated from a strided sample of about this many bytes.
SAMPLE_BYTES = 1 << 16


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
        if n <= SMALL_BYTES:  # a few bytes: counting in Python beats numpy's per-call cost
            total += sum(-c * math.log2(c / n) for c in Counter(b.tobytes()).values()) / 8
            continue
        sample = b[::n // SAMPLE_BYTES] if n > 2 * SAMPLE_BYTES else b
        c = np.bincount(sample, minlength=256)
        c = c[c > 0].astype(np.float64)
        k = len(sample)
        total += float(k * np.log2(k) - (c * np.log2(c)).sum()) / 8 * (n / k)
    return total


def planes_bytes(planes) -> float:
    """Estimated compressed size of value byte planes."""
    return entropy_bytes(*planes)
