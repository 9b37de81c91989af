"""Finding changes: where two flat bit arrays differ, in cache-sized blocks, and nothing else.

The sender's first pass over a chunk (:mod:`~dcr_ray.codec.encoding.diff`) and over a pack's tensors without the
pointer kernels (:mod:`~dcr_ray.codec.encoding.packdiff`). It returns positions, and the XOR masks ``new ^ old``
and new bits there when asked; how those are coded is decided above it.

The scan works one block of :data:`SCAN_BLOCK_ELEMS` at a time: a compiled branch-free compaction
(:func:`dcr_ray.codec.compiled.kernels.changed_in_block`) where numba is available, else numpy comparing 64-bit
words (four BF16 elements at a time) and splitting only the differing words into lanes. A long array's
blocks are shared out to the codec threads (:mod:`~dcr_ray.codec.compiled.threads`) in contiguous runs. Equality
is always on integer views, so ``-0 != +0`` and NaN payloads are compared by their bits. Nothing
array-sized is allocated besides the positions found: each block's positions may be kept as int32
(``narrow``) so no int64 copy of a chunk's positions exists while it is coded.
"""

from __future__ import annotations

import threading

import numpy as np

from dcr_ray.codec.compiled import kernels
from dcr_ray.codec.compiled.threads import codec_threads, run_all

#: Elements scanned per block: a BF16 block of old + new bits is 512 KiB, so the gathers that follow the
#: word comparison hit a cache-resident block, and the block's index temporaries (per differing word and
#: per change) stay a small fraction of the tensor even where many elements changed.
SCAN_BLOCK_ELEMS = 1 << 17
#: Arrays of at least this many elements are scanned by several threads (numpy releases the GIL).
PARALLEL_MIN_ELEMS = 1 << 19
#: Positions per step of :func:`gather` (bounds its index-conversion temporary).
GATHER_BLOCK = 1 << 12

_scratch = threading.local()


def _scan_compiled(old: np.ndarray, new: np.ndarray, values: bool):
    """:func:`_scan_words` by the compiled kernels, into this thread's block-sized scratch buffer (reused,
    so its pages stay mapped), copied out at the changes' size."""
    out = getattr(_scratch, "pos", None)
    if out is None or len(out) < len(old):  # the kernel checks no bounds: the buffer must hold the block
        out = _scratch.pos = np.empty(max(SCAN_BLOCK_ELEMS, len(old)), np.int32)
    pos = out[:kernels.changed_in_block(old, new, out[:len(old)])].copy()
    if not values:
        return pos, None, None
    return (pos, *kernels.gather_changes(old, new, pos))


def _scan_words(old: np.ndarray, new: np.ndarray, values: bool = True):
    """(positions, xor, new bits) of one block (at most :data:`SCAN_BLOCK_ELEMS` elements) whose length is
    a multiple of ``8 // itemsize``; positions int32, relative to the block; xor and new bits None unless
    ``values``.

    With numba, :func:`_scan_compiled`. Otherwise numpy compares 64-bit words (four BF16 elements at a
    time) without writing a full-size XOR, finds the few differing words and only splits those into
    lanes. Indices are narrowed to int32 as soon as they exist, and the per-word copies are released
    before the per-change positions are made.
    """
    if kernels.ENABLED:
        return _scan_compiled(old, new, values)
    s = old.dtype.itemsize
    if s == 8:
        pos = np.flatnonzero(old != new).astype(np.int32)
        if not values:
            return pos, None, None
        nv = new[pos]
        return pos, np.bitwise_xor(old[pos], nv), nv
    o64, n64 = old.view(np.uint64), new.view(np.uint64)
    wi = np.flatnonzero(o64 != n64)  # a bool mask has numpy's fast nonzero path
    if not len(wi):
        return wi.astype(np.int32), np.empty(0, old.dtype), np.empty(0, old.dtype)
    nw = n64[wi]
    xw = o64[wi]
    wi = wi.astype(np.int32)
    np.bitwise_xor(xw, nw, out=xw)
    lanes = xw.view(old.dtype)
    nz = np.flatnonzero(lanes != 0).astype(np.int32)
    xor, nv = (lanes[nz], nw.view(old.dtype)[nz]) if values else (None, None)
    del xw, lanes, nw
    shift = (8 // s).bit_length() - 1  # log2(lanes per word)
    pos = np.take(wi, nz >> shift)
    del wi
    pos <<= shift
    nz &= (1 << shift) - 1
    pos |= nz
    return pos, xor, nv


def _scan_range(old: np.ndarray, new: np.ndarray, lo: int, hi: int, narrow: bool = False, values: bool = True):
    """Scan ``[lo, hi)`` block by block: a list of (positions relative to the start of ``old``, xor, new
    bits) per block with changes; positions int32 when ``narrow`` (the caller's span fits), else int64;
    xor and new bits None unless ``values`` (a caller that gathers them later holds positions only)."""
    parts = []
    for a in range(lo, hi, SCAN_BLOCK_ELEMS):
        b = min(hi, a + SCAN_BLOCK_ELEMS)
        p, x, v = _scan_words(old[a:b], new[a:b], values)
        if len(p):
            if not narrow:
                p = p.astype(np.int64)
            if a:
                p += a
            parts.append((p, x, v))
    return parts


def scan_parts(old: np.ndarray, new: np.ndarray, threads: int | None = None, narrow: bool = False,
               values: bool = True) -> list[tuple]:
    """Per-block (positions relative to ``old``, XOR masks, new bits) where ``old`` and ``new`` differ,
    blocks in increasing order; positions int32 when ``narrow`` (the span fits), else int64; masks and
    new bits None unless ``values``. ``threads``: the codec's threads unless given."""
    n = len(old)
    k = 8 // old.dtype.itemsize
    m = n - n % k
    if threads is None:
        threads = codec_threads()
    if threads > 1 and m >= PARALLEL_MIN_ELEMS:
        # one contiguous share of whole blocks per thread
        nblocks = -(-m // SCAN_BLOCK_ELEMS)
        per = -(-nblocks // threads) * SCAN_BLOCK_ELEMS
        shares = run_all([lambda a=a: _scan_range(old, new, a, min(m, a + per), narrow, values)
                          for a in range(0, m, per)])
        parts = [p for share in shares for p in share]
    else:
        parts = _scan_range(old, new, 0, m, narrow, values)
    if m < n:
        x = np.bitwise_xor(old[m:], new[m:])
        nz = np.flatnonzero(x)
        if len(nz):
            p = (nz + m).astype(np.int32 if narrow else np.int64)
            parts.append((p, x[nz], new[m:][nz]) if values else (p, None, None))
    return parts


def join_column(parts: list, col: int, dtype=None) -> np.ndarray:
    """Concatenate column ``col`` of ``parts`` and release the parts' arrays of that column as it goes,
    so a chunk's arrays are never held twice over."""
    out = parts[0][col] if len(parts) == 1 else np.concatenate([p[col] for p in parts])
    if dtype is not None and out.dtype != dtype:
        out = out.astype(dtype)
    for i, p in enumerate(parts):
        parts[i] = p[:col] + (None,) + p[col + 1:]
    return out


def changes(old: np.ndarray, new: np.ndarray, threads: int | None = None):
    """Positions (int64, relative), XOR masks and new bits where ``old`` and ``new`` differ."""
    parts = scan_parts(old, new, threads)
    if not parts:
        return np.empty(0, np.int64), np.empty(0, old.dtype), np.empty(0, old.dtype)
    return join_column(parts, 0, np.int64), join_column(parts, 1), join_column(parts, 2)


def changed_positions(old: np.ndarray, new: np.ndarray):
    """Positions (int64, relative) where ``old`` and ``new`` differ, and the XOR masks there.

    The scan compares words in cache-sized blocks and never materialises a chunk-sized XOR.
    """
    pos, xor, _ = changes(old, new)
    return pos, xor


def gather(old: np.ndarray, new: np.ndarray, rel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(XOR masks, new bits) at positions ``rel``: one compiled pass, or numpy a block of positions at a
    time."""
    if kernels.ENABLED:
        return kernels.gather_changes(old, new, rel)
    nv = np.empty(len(rel), new.dtype)
    xor = np.empty(len(rel), old.dtype)
    for a in range(0, len(rel), GATHER_BLOCK):
        r = rel[a:a + GATHER_BLOCK]
        v, x = nv[a:a + GATHER_BLOCK], xor[a:a + GATHER_BLOCK]
        np.take(new, r, out=v)
        np.take(old, r, out=x)
        np.bitwise_xor(x, v, out=x)
    return xor, nv
