"""Change detection on stored bits, in bounded chunks.

:func:`diff_tensor` compares a tensor's committed bits with its current bits chunk by chunk (never a
full-size temporary: at most one chunk-sized scratch word buffer) and returns the *changed set*: for
each chunk with changes, the coded positions, the XOR masks ``new ^ old`` and the absolute new bits,
or, when sparse coding would not be smaller than the whole chunk, the chunk's new bits (``DENSE``).

The fast path XORs 64-bit words (four BF16 elements at a time), finds the non-zero words and only then
splits those few words into lanes; equality is always on integer views, so ``-0 != +0`` and NaN
payloads are compared by their bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dcr_ray.codec import locations
from dcr_ray.codec.bits import bits_view, wire_name

#: Default chunk: 4 Mi elements (8 MiB of BF16).
DEFAULT_CHUNK_ELEMS = 1 << 22
#: Sparse coding is kept while its raw size is below this fraction of the dense chunk's raw size.
DEFAULT_DENSE_CROSSOVER = 0.9


@dataclass(slots=True)
class ChunkDelta:
    """The changes of one chunk ``[lo, hi)`` of one tensor (flat element indices).

    Exactly one of ``dense`` (all new bits of the chunk) or the sparse triple (``loc``, ``xor``,
    ``new``) is set.
    """

    lo: int
    hi: int
    count: int
    loc: locations.EncodedLocations | None = None
    xor: np.ndarray | None = None
    new: np.ndarray | None = None
    dense: np.ndarray | None = None

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


def changed_positions(old: np.ndarray, new: np.ndarray, scratch: np.ndarray | None = None):
    """Positions (int64, relative) where ``old`` and ``new`` differ, and the XOR masks there.

    ``scratch``, when given, is a uint64 buffer of at least ``len(old) * itemsize / 8`` words that is
    reused for the word-level XOR (no allocation per chunk).
    """
    k = 8 // old.dtype.itemsize
    n = len(old)
    m = n - n % k if k > 1 else 0
    parts_pos, parts_x = [], []
    if m:
        nw = m // k
        x = np.bitwise_xor(old[:m].view(np.uint64), new[:m].view(np.uint64),
                           out=None if scratch is None or len(scratch) < nw else scratch[:nw])
        wi = np.flatnonzero(x != 0)  # a bool mask has numpy's fast nonzero path
        if len(wi):
            lanes = x[wi].view(old.dtype)
            nz = np.flatnonzero(lanes)
            parts_pos.append(wi[nz // k] * k + (nz % k))
            parts_x.append(lanes[nz])
    if m < n:
        x = np.bitwise_xor(old[m:], new[m:])
        nz = np.flatnonzero(x)
        parts_pos.append(nz + m)
        parts_x.append(x[nz])
    if not parts_pos:
        return np.empty(0, np.int64), np.empty(0, old.dtype)
    if len(parts_pos) == 1:
        return parts_pos[0], parts_x[0]
    return np.concatenate(parts_pos), np.concatenate(parts_x)


def diff_arrays(
    old: np.ndarray,
    new: np.ndarray,
    *,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    dense_crossover: float = DEFAULT_DENSE_CROSSOVER,
    scratch: np.ndarray | None = None,
):
    """Yield a :class:`ChunkDelta` for every chunk of the flat bit arrays that changed."""
    n = len(old)
    for lo in range(0, n, chunk_elems):
        hi = min(n, lo + chunk_elems)
        o, w = old[lo:hi], new[lo:hi]
        rel, xor = changed_positions(o, w, scratch)
        if not len(rel):
            continue
        span = hi - lo
        itemsize = old.dtype.itemsize
        loc = locations.encode(rel, 0)
        # raw sparse cost: positions + one value per change; dense: every element's value
        if loc.nbytes + len(rel) * itemsize >= dense_crossover * span * itemsize:
            yield ChunkDelta(lo, hi, span, dense=np.array(w, copy=True))
        else:
            yield ChunkDelta(lo, hi, len(rel), loc=loc, xor=xor, new=w[rel])


def diff_tensor(
    name: str,
    old: np.ndarray,
    new: torch.Tensor,
    *,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    dense_crossover: float = DEFAULT_DENSE_CROSSOVER,
    scratch: np.ndarray | None = None,
) -> TensorDelta:
    """Changed set of tensor ``name``: ``old`` is its committed flat bit view, ``new`` the tensor now."""
    nv = bits_view(new.detach().contiguous() if not new.is_contiguous() else new.detach())
    if nv.shape != old.shape or nv.dtype != old.dtype:
        raise ValueError(f"{name}: baseline has {old.shape}/{old.dtype}, tensor has {nv.shape}/{nv.dtype}")
    td = TensorDelta(name, wire_name(new.dtype), tuple(new.shape), len(nv))
    td.chunks.extend(
        diff_arrays(old, nv, chunk_elems=chunk_elems, dense_crossover=dense_crossover, scratch=scratch)
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
