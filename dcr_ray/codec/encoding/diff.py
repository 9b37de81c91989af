"""Changed sets: what changed in a tensor since its committed bits, chunk by chunk, ready to code.

:func:`diff_tensor` compares a tensor's committed bits with its current bits in chunks of
:data:`DEFAULT_CHUNK_ELEMS` and returns its *changed set* (:class:`TensorDelta`): for each chunk with
changes, a :class:`ChunkDelta` with the coded positions (:mod:`~dcr_ray.codec.primitives.locations`), the XOR
masks ``new ^ old`` and the absolute new bits, or, when sparse coding would not be smaller than the
whole chunk, the chunk's new bits (``DENSE``). :func:`full_delta` is the dense changed set of a bootstrap.

Finding the changes is :mod:`~dcr_ray.codec.encoding.scan`'s. This module turns each chunk's positions into its
changed set, in an order that keeps the working set small: positions first (int32 where the span
allows), the dense test on their count, class-order positions when the sender's estimate says they
may pay (:func:`~dcr_ray.codec.primitives.estimate.class_order_promising`, :mod:`~dcr_ray.codec.primitives.classorder`),
then the masks and new bits gathered once, and the location symbols coded over the positions' own buffer
(:func:`~dcr_ray.codec.primitives.locations.encode_in_place`), so no int64 copy of a chunk's positions exists
while it is coded. Which coding a frame finally uses per item is the frame builder's choice
(:mod:`~dcr_ray.codec.encoding.encode`). The codec threads (:mod:`~dcr_ray.codec.compiled.threads`) take one chunk
each when a tensor has several, or share a lone chunk's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from dcr_ray.codec.bits import bits_view, wire_name
from dcr_ray.codec.compiled.threads import codec_threads, run_all
from dcr_ray.codec.encoding.scan import PARALLEL_MIN_ELEMS, gather, join_column, scan_parts
from dcr_ray.codec.primitives import classorder, estimate, locations

if TYPE_CHECKING:  # annotations only: torch is imported where it runs
    import torch

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
    coded in the class order of those old bits (:mod:`~dcr_ray.codec.primitives.classorder`); the frame builder uses
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


#: Chunks shorter than this keep their positions as int32 while they are scanned and coded.
NARROW_SPAN = 1 << 31


def diff_chunk(o: np.ndarray, w: np.ndarray, lo: int, dense_crossover: float,
               threads: int | None, wire_dtype: str | None = None) -> ChunkDelta | None:
    """The :class:`ChunkDelta` of chunk ``[lo, lo + len(o))``, or None when it did not change.

    Working set besides the result: the chunk's positions once (int32 where the span allows) and one
    block's temporaries. The scan keeps positions only; the new bits and XOR masks are gathered once
    the class-order positions (which need only positions) are done, and the location symbols are then
    coded in the positions' own buffer."""
    span = len(o)
    parts = scan_parts(o, w, threads, narrow=span < NARROW_SPAN, values=False)
    if not parts:
        return None
    itemsize = o.dtype.itemsize
    # raw sparse cost: positions + one value per change; dense: every element's value
    # (values alone over the limit: dense without coding the positions)
    if sum(len(p[0]) for p in parts) * itemsize >= dense_crossover * span * itemsize:
        return ChunkDelta(lo, lo + span, span, dense=np.array(w, copy=True))
    rel = join_column(parts, 0)
    del parts
    ctx = classorder.encode(o, rel, wire_dtype) \
        if wire_dtype is not None and estimate.class_order_promising(o, rel, wire_dtype) else None
    xor, nv = gather(o, w, rel)
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
            done = run_all([lambda lo=lo, hi=hi: diff_chunk(old[lo:hi], new[lo:hi], lo, dense_crossover, 1,
                                                            wire_dtype)
                            for lo, hi in window])
            yield from (c for c in done if c is not None)
        return
    for lo, hi in bounds:
        c = diff_chunk(old[lo:hi], new[lo:hi], lo, dense_crossover, None, wire_dtype)
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
