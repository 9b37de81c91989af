"""Projection: a local shard's changed set, re-expressed in canonical (name, flat index) coordinates.

The owner diffs its *local* shard against a baseline of that shard (:mod:`dcr_ray.codec.diff`), then
:func:`project` maps the changed local positions through the :class:`~dcr_ray.sharding.spec.ShardSpec`:

* a local tensor that is one contiguous run of its canonical tensor (a whole tensor, an FSDP
  ``Shard(0)`` slice) is a shift: each chunk keeps its coded positions and values, only ``lo``/``hi``
  move (O(chunks));
* anything else goes cell by cell, vectorized: unravel the changed positions (O(changes)), find each
  one's cell by a binary search per dimension, apply the cell's affine map, sort per canonical tensor
  when the map is not monotone, and cut into canonical chunks on the codec's chunk grid.

Cost grows with the shard's chunks and its changes, never with the canonical tensor: nothing
canonical-sized is allocated. Values are carried, not recomputed, so bits are exact by construction.
Dense local chunks (most elements changed) become sparse canonical chunks that list every position;
their XOR masks are taken against the local baseline the caller passes.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator

import numpy as np

from dcr_ray.codec import locations
from dcr_ray.codec.diff import ChunkDelta, TensorDelta
from dcr_ray.sharding.spec import ShardSpec, contiguous_strides


def project(td: TensorDelta, spec: ShardSpec, *, chunk_elems: int,
            old_bits: Callable[[], np.ndarray] | None = None) -> Iterator[TensorDelta]:
    """Yield the canonical changed sets of local changed set ``td`` (one per canonical tensor touched).

    ``old_bits()`` returns the local baseline's flat bits; it is needed only for dense chunks sent as XOR
    (without it their masks are the new bits, fine for OVERWRITE-only sends such as bootstrap).
    """
    off = spec.contiguous_offset()
    t0 = spec.cells[0]
    if off is not None:
        if off == 0 and t0.name == td.name and t0.shape == td.shape:
            yield td  # the local tensor is its canonical tensor
            return
        out = TensorDelta(t0.name, td.dtype, t0.shape, math.prod(t0.shape))
        for c in td.chunks:
            out.chunks.append(ChunkDelta(c.lo + off, c.hi + off, c.count, loc=c.loc, xor=c.xor, new=c.new,
                                         dense=c.dense))
        yield out
        return
    pos, xor, new = _changes(td, old_bits)
    if not len(pos):
        return
    for name, shape, cpos, cx, cn in _map(pos, xor, new, spec):
        out = TensorDelta(name, td.dtype, shape, math.prod(shape))
        out.chunks.extend(_grid_chunks(cpos, cx, cn, chunk_elems, math.prod(shape)))
        yield out


def project_all(deltas: Iterable[TensorDelta], specs: dict[str, ShardSpec], *, chunk_elems: int,
                old_bits: Callable[[str], np.ndarray] | None = None) -> Iterator[TensorDelta]:
    """:func:`project` every local changed set of ``deltas`` through ``specs[td.name]``."""
    for td in deltas:
        yield from project(td, specs[td.name], chunk_elems=chunk_elems,
                           old_bits=None if old_bits is None else (lambda n=td.name: old_bits(n)))


def _changes(td: TensorDelta, old_bits) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All changed local positions of ``td`` with their XOR masks and new bits, in increasing order."""
    ps, xs, ns = [], [], []
    for c in td.chunks:
        if c.is_dense:
            p = np.arange(c.lo, c.hi, dtype=np.int64)
            n = c.dense
            x = n if old_bits is None else np.bitwise_xor(old_bits()[c.lo:c.hi], n)
            keep = np.flatnonzero(x) if old_bits is not None else slice(None)
            ps.append(p[keep]), xs.append(x[keep]), ns.append(n[keep])
        else:
            ps.append(c.positions()), xs.append(c.xor), ns.append(c.new)
    if not ps:  # a changed set with no chunks: nothing to project
        return np.empty(0, np.int64), np.empty(0, np.uint8), np.empty(0, np.uint8)
    if len(ps) == 1:
        return ps[0], xs[0], ns[0]
    return np.concatenate(ps), np.concatenate(xs), np.concatenate(ns)


def _map(pos: np.ndarray, xor: np.ndarray, new: np.ndarray, spec: ShardSpec):
    """Yield (name, shape, canonical positions, xor, new) per canonical tensor, positions increasing."""
    shape = spec.local_shape
    idx = np.unravel_index(pos, shape) if len(shape) > 1 else (pos,)
    # the cell of each change: a binary search per dimension, then row-major cell number
    cell = np.zeros(len(pos), dtype=np.int64)
    for d, cd in enumerate(spec.cuts):
        cell *= len(cd) + 1
        if cd:
            cell += np.searchsorted(np.asarray(cd, dtype=np.int64), idx[d], side="right")
    cells = list(spec.cell_boxes())
    ncell = len(cells)
    # per cell: canonical = adj + sum_d idx_d * stride_d  (adj folds in the cell's local start)
    stride = np.zeros((ncell, len(shape)), dtype=np.int64)
    adj = np.zeros(ncell, dtype=np.int64)
    tid = np.full(ncell, -1, dtype=np.int64)
    names: dict[str, int] = {}
    shapes: list[tuple[int, ...]] = []
    for i, starts, _, t in cells:
        if t is None:
            continue
        if t.name not in names:
            names[t.name] = len(names)
            shapes.append(t.shape)
        tid[i] = names[t.name]
        stride[i] = t.strides
        adj[i] = t.base - sum(a * s for a, s in zip(starts, t.strides))
    canon = adj[cell]
    for d in range(len(shape)):
        if stride[:, d].any():
            canon += idx[d].astype(np.int64, copy=False) * stride[cell, d]
    owner = tid[cell]
    single = len(names) == 1 and (tid >= 0).all()
    for name, k in names.items():
        if single:
            sel = slice(None)
            cp, cx, cn = canon, xor, new
        else:
            sel = np.flatnonzero(owner == k)
            cp, cx, cn = canon[sel], xor[sel], new[sel]
        if len(cp) == 0:
            continue
        if len(cp) > 1 and not (np.diff(cp) > 0).all():
            order = np.argsort(cp, kind="stable")
            cp, cx, cn = cp[order], cx[order], cn[order]
        yield name, shapes[k], cp, cx, cn


def _grid_chunks(pos: np.ndarray, xor: np.ndarray, new: np.ndarray, chunk_elems: int,
                 numel: int) -> Iterator[ChunkDelta]:
    """Sparse chunks on the canonical chunk grid ``[k * chunk_elems, (k + 1) * chunk_elems)``."""
    grid = pos // chunk_elems
    cuts = np.flatnonzero(np.diff(grid)) + 1
    starts = np.concatenate(([0], cuts))
    stops = np.concatenate((cuts, [len(pos)]))
    for a, b in zip(starts.tolist(), stops.tolist()):
        lo = int(grid[a]) * chunk_elems
        hi = min(numel, lo + chunk_elems)
        rel = pos[a:b] - lo
        yield ChunkDelta(lo, hi, b - a, loc=locations.encode(rel, 0), xor=xor[a:b], new=new[a:b])


def canonical_numel(spec: ShardSpec) -> int:
    """Elements of the local tensor that have a canonical home (padding excluded)."""
    return sum(math.prod(ext) for _, _, ext, t in spec.cell_boxes() if t is not None)


__all__ = ["canonical_numel", "contiguous_strides", "project", "project_all"]
