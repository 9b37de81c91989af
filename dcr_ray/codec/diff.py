"""Change detection on stored bits, in bounded chunks.

:func:`diff_tensor` compares a tensor's committed bits with its current bits chunk by chunk (never a
full-size temporary: the scan works in cache-sized blocks) and returns the *changed set*: for
each chunk with changes, the coded positions, the XOR masks ``new ^ old`` and the absolute new bits,
or, when sparse coding would not be smaller than the whole chunk, the chunk's new bits (``DENSE``).

The scan works one cache-sized block at a time: a compiled branch-free compaction
(:func:`dcr_ray.codec.kernels.changed_in_block`) where numba is available, else numpy comparing 64-bit
words (four BF16 elements at a time) and splitting only the differing words into lanes. The codec threads
(:mod:`~dcr_ray.codec.threads`) take one chunk each when a tensor has several, or share a lone
chunk's blocks; equality is always on integer views, so
``-0 != +0`` and NaN payloads are compared by their bits. Nothing chunk-sized is allocated besides
the changed set itself, and the per-change working set stays small: each block's positions are kept as
int32 and the location symbols are computed in that buffer, so no int64 copy
of a chunk's positions exists while it is coded (:func:`~dcr_ray.codec.locations.encode_in_place`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from dcr_ray.codec import context, kernels, locations
from dcr_ray.codec.threads import codec_threads, run_all
from dcr_ray.codec.bits import bits_view, np_uint, wire_name
from dcr_ray.codec.format import LocationMode

#: Default chunk: 4 Mi elements (8 MiB of BF16).
DEFAULT_CHUNK_ELEMS = 1 << 22
#: Sparse coding is kept while its raw size is below this fraction of the dense chunk's raw size.
DEFAULT_DENSE_CROSSOVER = 0.9


@dataclass(slots=True)
class ChunkDelta:
    """The changes of one chunk ``[lo, hi)`` of one tensor (flat element indices).

    Exactly one of ``dense`` (all new bits of the chunk) or the sparse pair (``loc``, ``new``) is set.
    ``xor`` (``new ^ old`` at each position) rides along with a fresh diff for the first attempt's
    frames; a *pending* chunk (:meth:`pending_form`, what an owner keeps for promote and retries) has
    none, since both need only positions and new bits and the masks can be taken again from the
    committed baseline (:func:`dcr_ray.sharding.project.project` does so when a frame needs them).
    A sparse chunk of a float tensor diffed against its old bits may also carry ``ctx``, its positions
    coded in the class order of those old bits (:mod:`~dcr_ray.codec.context`); the frame builder uses
    whichever coding is smaller. Chunks made elsewhere (projections, pending sets) may lack it.
    """

    lo: int
    hi: int
    count: int
    loc: locations.EncodedLocations | None = None
    xor: np.ndarray | None = None
    new: np.ndarray | None = None
    dense: np.ndarray | None = None
    ctx: locations.EncodedLocations | None = None

    @property
    def is_dense(self) -> bool:
        return self.dense is not None

    def positions(self) -> np.ndarray:
        """Absolute flat positions of the changes (decoded from ``loc``; all positions if dense)."""
        if self.dense is not None:
            return np.arange(self.lo, self.hi, dtype=np.int64)
        return locations.decode(self.loc, self.lo, self.hi, self.count)

    @property
    def nbytes(self) -> int:
        if self.dense is not None:
            return self.dense.nbytes
        return self.loc.nbytes + (0 if self.xor is None else self.xor.nbytes) + self.new.nbytes

    def pending_form(self) -> "ChunkDelta":
        """This chunk as an owner keeps it pending: positions and new bits (shared, not copied), no XOR
        masks and no class-order positions (only a first attempt's frames use either)."""
        if self.dense is not None or (self.xor is None and self.ctx is None):
            return self
        return ChunkDelta(self.lo, self.hi, self.count, loc=self.loc, new=self.new)


@dataclass(slots=True)
class TensorDelta:
    """Changed set of one named tensor: its chunks that changed, in increasing ``lo`` order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    chunks: list[ChunkDelta] = field(default_factory=list)

    @property
    def changed(self) -> int:
        return sum(c.count for c in self.chunks)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def pending_form(self) -> "TensorDelta":
        """The changed set as an owner keeps it pending (see :meth:`ChunkDelta.pending_form`)."""
        return TensorDelta(self.name, self.dtype, self.shape, self.numel, [c.pending_form() for c in self.chunks])


#: Elements scanned per block: a BF16 block of old + new bits is 512 KiB, so the gathers that follow the
#: word comparison hit a cache-resident block, and the block's index temporaries (per differing word and
#: per change) stay a small fraction of the tensor even where many elements changed.
SCAN_BLOCK_ELEMS = 1 << 17
#: Chunks of at least this many elements are scanned by several threads (numpy releases the GIL).
PARALLEL_MIN_ELEMS = 1 << 19
#: Chunks shorter than this keep their positions as int32 while they are scanned and coded.
NARROW_SPAN = 1 << 31


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


def _scan_parts(old: np.ndarray, new: np.ndarray, threads: int | None = None, narrow: bool = False,
                values: bool = True):
    """Per-block (positions relative to ``old``, XOR masks, new bits) where ``old`` and ``new`` differ,
    blocks in increasing order; see :func:`_scan_range` for ``narrow`` and ``values``."""
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


def _join(parts: list, col: int, dtype=None) -> np.ndarray:
    """Concatenate column ``col`` of ``parts`` and release the parts' arrays of that column as it goes,
    so a chunk's arrays are never held twice over."""
    out = parts[0][col] if len(parts) == 1 else np.concatenate([p[col] for p in parts])
    if dtype is not None and out.dtype != dtype:
        out = out.astype(dtype)
    for i, p in enumerate(parts):
        parts[i] = p[:col] + (None,) + p[col + 1:]
    return out


def _scan(old: np.ndarray, new: np.ndarray, threads: int | None = None):
    """Positions (int64, relative), XOR masks and new bits where ``old`` and ``new`` differ."""
    parts = _scan_parts(old, new, threads)
    if not parts:
        return np.empty(0, np.int64), np.empty(0, old.dtype), np.empty(0, old.dtype)
    return _join(parts, 0, np.int64), _join(parts, 1), _join(parts, 2)


def changed_positions(old: np.ndarray, new: np.ndarray):
    """Positions (int64, relative) where ``old`` and ``new`` differ, and the XOR masks there.

    The scan compares words in cache-sized blocks and never materialises a chunk-sized XOR.
    """
    pos, xor, _ = _scan(old, new)
    return pos, xor


#: Positions per step of :func:`_gather` (bounds its index-conversion temporary).
GATHER_BLOCK = 1 << 12


def _gather(old: np.ndarray, new: np.ndarray, rel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


def _diff_chunk(o: np.ndarray, w: np.ndarray, lo: int, dense_crossover: float,
                threads: int | None, wire_dtype: str | None = None) -> ChunkDelta | None:
    """The :class:`ChunkDelta` of chunk ``[lo, lo + len(o))``, or None when it did not change.

    Working set besides the result: the chunk's positions once (int32 where the span allows) and one
    block's temporaries. The scan keeps positions only; the new bits and XOR masks are gathered once
    the class-order positions (which need only positions) are done, and the location symbols are then
    coded in the positions' own buffer."""
    span = len(o)
    parts = _scan_parts(o, w, threads, narrow=span < NARROW_SPAN, values=False)
    if not parts:
        return None
    itemsize = o.dtype.itemsize
    # raw sparse cost: positions + one value per change; dense: every element's value
    # (values alone over the limit: dense without coding the positions)
    if sum(len(p[0]) for p in parts) * itemsize >= dense_crossover * span * itemsize:
        return ChunkDelta(lo, lo + span, span, dense=np.array(w, copy=True))
    rel = _join(parts, 0)
    del parts
    ctx = context.encode(o, rel, wire_dtype) if wire_dtype is not None and context.promising(o, rel, wire_dtype) \
        else None
    xor, nv = _gather(o, w, rel)
    count = len(rel)
    loc = locations.encode_in_place(rel)
    del rel
    if loc.nbytes + count * itemsize >= dense_crossover * span * itemsize:
        return ChunkDelta(lo, lo + span, span, dense=np.array(w, copy=True))
    return ChunkDelta(lo, lo + span, count, loc=loc, xor=xor, new=nv, ctx=ctx)


def diff_arrays(
    old: np.ndarray,
    new: np.ndarray,
    *,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    dense_crossover: float = DEFAULT_DENSE_CROSSOVER,
    wire_dtype: str | None = None,
):
    """Yield a :class:`ChunkDelta` for every chunk of the flat bit arrays that changed.

    ``wire_dtype`` (the arrays' dtype on the wire) lets float chunks carry class-order positions too.

    With several codec threads and several chunks, each thread takes a whole chunk (scan, location
    coding and the dense decision), a window of one chunk per thread at a time, so memory stays
    bounded by that window; a lone chunk is scanned by all threads instead.
    """
    n = len(old)
    bounds = [(lo, min(n, lo + chunk_elems)) for lo in range(0, n, chunk_elems)]
    n_threads = codec_threads()
    if n_threads > 1 and len(bounds) > 1 and n >= PARALLEL_MIN_ELEMS:
        for a in range(0, len(bounds), n_threads):
            window = bounds[a:a + n_threads]
            done = run_all([lambda lo=lo, hi=hi: _diff_chunk(old[lo:hi], new[lo:hi], lo, dense_crossover, 1,
                                                             wire_dtype)
                            for lo, hi in window])
            yield from (c for c in done if c is not None)
        return
    for lo, hi in bounds:
        c = _diff_chunk(old[lo:hi], new[lo:hi], lo, dense_crossover, None, wire_dtype)
        if c is not None:
            yield c


def diff_tensor(
    name: str,
    old: np.ndarray,
    new: torch.Tensor,
    *,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    dense_crossover: float = DEFAULT_DENSE_CROSSOVER,
    class_order: bool = True,
) -> TensorDelta:
    """Changed set of tensor ``name``: ``old`` is its committed flat bit view, ``new`` the tensor now.

    ``class_order=False`` skips the class-order positions (``ChunkDelta.ctx``): senders that code plain
    frames need not pay for them."""
    nv = bits_view(new.detach().contiguous() if not new.is_contiguous() else new.detach())
    if nv.shape != old.shape or nv.dtype != old.dtype:
        raise ValueError(f"{name}: baseline has {old.shape}/{old.dtype}, tensor has {nv.shape}/{nv.dtype}")
    td = TensorDelta(name, wire_name(new.dtype), tuple(new.shape), len(nv))
    td.chunks.extend(
        diff_arrays(old, nv, chunk_elems=chunk_elems, dense_crossover=dense_crossover,
                    wire_dtype=td.dtype if class_order else None)
    )
    return td


def full_delta(name: str, new: torch.Tensor, *, chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> TensorDelta:
    """A changed set that rewrites every element densely (bootstrap of an engine with no baseline)."""
    nv = bits_view(new.detach().contiguous())
    td = TensorDelta(name, wire_name(new.dtype), tuple(new.shape), len(nv))
    for lo in range(0, len(nv), chunk_elems):
        hi = min(len(nv), lo + chunk_elems)
        td.chunks.append(ChunkDelta(lo, hi, hi - lo, dense=np.array(nv[lo:hi], copy=True)))
    return td
