"""Size estimates that pick an item's coding before anything is compressed.

A frame compresses each section once (:mod:`~dcr_ray.codec.encoding.encode`), so the exact compressed size of
one item's bytes is never known on its own. What zstd does with these near-memoryless streams is
Huffman-code their bytes (long matches are rare), so the zero-order entropy of an item's byte streams
is the estimate: ``sum over streams of len * H(byte histogram) / 8``. It ranks two codings of the same
item (XOR or ADD values, flat or class-order positions) the way the compressed frame does, at the cost
of one byte histogram per stream; a long stream is estimated from an evenly strided sample of
:data:`SAMPLE_BYTES` of its bytes (deterministic, so both codings of an item are judged on the same
positions).

:func:`class_order_promising` answers an earlier question the same way: whether a chunk's positions are
worth walking into class order (:mod:`~dcr_ray.codec.primitives.classorder`) at all, from the classes of its
changed elements and of a sample of its old bits, before the walk is paid for.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from dcr_ray.codec.primitives import classorder

#: Streams of at most this many bytes are counted in Python.
SMALL_BYTES = 64
#: Streams longer than this are estimated from a strided sample of about this many bytes.
SAMPLE_BYTES = 1 << 16
#: Old elements sampled by :func:`class_order_promising`, and the share of the flat estimate class order
#: must beat.
CLASS_SAMPLE_ELEMS = 4096
CLASS_PROMISE = 0.9
#: Items of at most this many elements always get class-order positions computed (cheaper than judging).
CLASS_ALWAYS_ELEMS = 1 << 14


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


def class_order_promising(old: np.ndarray, rel: np.ndarray, dtype: str) -> bool:
    """Whether class order is likely to code ``rel`` in clearly fewer bits than flat order: a zero-order
    estimate from the classes of the changed elements (exact) and of a strided sample of
    :data:`CLASS_SAMPLE_ELEMS` old elements (scaled), so a sender skips the full class walk where changes
    do not depend on magnitude (uniform noise, integer-like tensors). Cost O(changes + sample)."""
    n, k = len(old), len(rel)
    if not classorder.supports(dtype) or k == 0 or k == n:
        return False
    if n <= CLASS_ALWAYS_ELEMS:  # the walk itself costs less than this estimate
        return True
    ncls = classorder.class_count(dtype)
    sample = old[::max(1, n // CLASS_SAMPLE_ELEMS)]
    share = np.bincount(classorder.classes(sample, dtype), minlength=ncls) * (n / len(sample))
    hits = np.bincount(classorder.classes(old[rel], dtype), minlength=ncls).astype(np.float64)
    size = np.maximum(share, hits)
    live = size > 0
    p = np.clip(hits[live] / size[live], 1e-12, 1 - 1e-12)
    class_bits = float((size[live] * -(p * np.log2(p) + (1 - p) * np.log2(1 - p))).sum())
    q = k / n
    flat_bits = n * -(q * np.log2(q) + (1 - q) * np.log2(1 - q))
    return class_bits < CLASS_PROMISE * flat_bits
