"""Change detection on stored bits, in bounded chunks.

:func:`diff_tensor` compares a tensor's committed bits with its current bits chunk by chunk (never a
full-size temporary: the scan works in cache-sized blocks) and returns the *changed set*: for
each chunk with changes, the coded positions, the XOR masks ``new ^ old`` and the absolute new bits,
or, when sparse coding would not be smaller than the whole chunk, the chunk's new bits (``DENSE``).

The fast path compares 64-bit words (four BF16 elements at a time), finds the differing words and only
then splits those few words into lanes, one cache-sized block at a time. The codec threads
(:mod:`~dcr_ray.codec.threads`) take one chunk each when a tensor has several, or share a lone
chunk's blocks; equality is always on integer views, so
``-0 != +0`` and NaN payloads are compared by their bits. Nothing chunk-sized is allocated besides
the changed set itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dcr_ray.codec import context, locations
from dcr_ray.codec.threads import codec_threads, run_all
from dcr_ray.codec.bits import bits_view, wire_name

#: Default chunk: 4 Mi elements (8 MiB of BF16).
DEFAULT_CHUNK_ELEMS = 1 << 22
#: Sparse coding is kept while its raw size is below this fraction of the dense chunk's raw size.
DEFAULT_DENSE_CROSSOVER = 0.9


@dataclass(slots=True)
class ChunkDelta:
    """The changes of one chunk ``[lo, hi)`` of one tensor (flat element indices).

    Exactly one of ``dense`` (all new bits of the chunk) or the sparse triple (``loc``, ``xor``,
    ``new``) is set. A sparse chunk of a float tensor diffed against its old bits also carries ``ctx``,
    its positions coded in the class order of those old bits (:mod:`~dcr_ray.codec.context`); the
    frame builder uses whichever coding is smaller. Chunks made elsewhere (projections) may lack it.
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
        return self.loc.nbytes + self.xor.nbytes + self.new.nbytes


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


#: Elements scanned per block: a BF16 block of old + new bits is 1 MiB, so the gathers that follow the
#: word comparison hit a cache-resident block instead of going back to memory.
SCAN_BLOCK_ELEMS = 1 << 18
#: Chunks of at least this many elements are scanned by several threads (numpy releases the GIL).
PARALLEL_MIN_ELEMS = 1 << 19


def _scan_words(old: np.ndarray, new: np.ndarray):
    """(positions, xor, new bits) of one block whose length is a multiple of ``8 // itemsize``.

    Compares 64-bit words (four BF16 elements at a time) without writing a full-size XOR, finds the
    few differing words and only splits those into lanes.
    """
    s = old.dtype.itemsize
    if s == 8:
        pos = np.flatnonzero(old != new)
        nv = new[pos]
        return pos, np.bitwise_xor(old[pos], nv), nv
    o64, n64 = old.view(np.uint64), new.view(np.uint64)
    wi = np.flatnonzero(o64 != n64)  # a bool mask has numpy's fast nonzero path
    if not len(wi):
        return wi, np.empty(0, old.dtype), np.empty(0, old.dtype)
    nw = n64[wi]
    xw = o64[wi]
    np.bitwise_xor(xw, nw, out=xw)
    lanes = xw.view(old.dtype)
    nz = np.flatnonzero(lanes != 0)
    shift = (8 // s).bit_length() - 1  # log2(lanes per word)
    pos = np.take(wi, nz >> shift)
    pos <<= shift
    pos |= nz & ((1 << shift) - 1)
    return pos, lanes[nz], nw.view(old.dtype)[nz]


def _scan_range(old: np.ndarray, new: np.ndarray, lo: int, hi: int):
    """Scan ``[lo, hi)`` block by block; positions relative to the start of ``old``."""
    parts = []
    for a in range(lo, hi, SCAN_BLOCK_ELEMS):
        b = min(hi, a + SCAN_BLOCK_ELEMS)
        p, x, v = _scan_words(old[a:b], new[a:b])
        if len(p):
            if a:
                p += a
            parts.append((p, x, v))
    return parts


def _scan(old: np.ndarray, new: np.ndarray, threads: int | None = None):
    """Positions (int64, relative), XOR masks and new bits where ``old`` and ``new`` differ."""
    n = len(old)
    k = 8 // old.dtype.itemsize
    m = n - n % k
    if threads is None:
        threads = codec_threads()
    if threads > 1 and m >= PARALLEL_MIN_ELEMS:
        # one contiguous share of whole blocks per thread
        nblocks = -(-m // SCAN_BLOCK_ELEMS)
        per = -(-nblocks // threads) * SCAN_BLOCK_ELEMS
        shares = run_all([lambda a=a: _scan_range(old, new, a, min(m, a + per)) for a in range(0, m, per)])
        parts = [p for share in shares for p in share]
    else:
        parts = _scan_range(old, new, 0, m)
    if m < n:
        x = np.bitwise_xor(old[m:], new[m:])
        nz = np.flatnonzero(x)
        if len(nz):
            parts.append((nz + m, x[nz], new[m:][nz]))
    if not parts:
        return np.empty(0, np.int64), np.empty(0, old.dtype), np.empty(0, old.dtype)
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate(col) for col in zip(*parts))


def changed_positions(old: np.ndarray, new: np.ndarray):
    """Positions (int64, relative) where ``old`` and ``new`` differ, and the XOR masks there.

    The scan compares words in cache-sized blocks and never materialises a chunk-sized XOR.
    """
    pos, xor, _ = _scan(old, new)
    return pos, xor


def _diff_chunk(o: np.ndarray, w: np.ndarray, lo: int, dense_crossover: float,
                threads: int | None, wire_dtype: str | None = None) -> ChunkDelta | None:
    """The :class:`ChunkDelta` of chunk ``[lo, lo + len(o))``, or None when it did not change."""
    rel, xor, nv = _scan(o, w, threads)
    if not len(rel):
        return None
    span = len(o)
    itemsize = o.dtype.itemsize
    # raw sparse cost: positions + one value per change; dense: every element's value
    # (values alone over the limit: dense without coding the positions)
    dense = len(rel) * itemsize >= dense_crossover * span * itemsize
    if not dense:
        loc = locations.encode(rel, 0)
        dense = loc.nbytes + len(rel) * itemsize >= dense_crossover * span * itemsize
    if dense:
        return ChunkDelta(lo, lo + span, span, dense=np.array(w, copy=True))
    ctx = context.encode(o, rel, wire_dtype) if wire_dtype is not None and context.promising(o, rel, wire_dtype) \
        else None
    return ChunkDelta(lo, lo + span, len(rel), loc=loc, xor=xor, new=nv, ctx=ctx)


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
