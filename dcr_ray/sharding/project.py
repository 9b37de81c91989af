"""Projection: a local shard's changed set, re-expressed in canonical (name, flat index) coordinates.

The owner diffs its *local* shard against a baseline of that shard (:mod:`dcr_ray.codec.encoding.diff`), then
:func:`project` maps the changed local positions through the :class:`~dcr_ray.sharding.spec.ShardSpec`:

* a local tensor that is one contiguous run of its canonical tensor (a whole tensor, an FSDP
  ``Shard(0)`` slice) is a shift: each chunk keeps its coded positions and values, only ``lo``/``hi``
  move (O(chunks));
* a local tensor whose cells are each a stack of rows that are contiguous on both sides (fused QKV,
  gate/up, stacked experts, column-split boxes) goes canonical tensor by canonical tensor: each cell's
  changes are a slice of the sorted local positions (one binary search per cell) and map by a shift
  plus one division by the row length; only one canonical tensor's positions exist at a time;
* anything else goes cell by cell, vectorized: unravel the changed positions (O(changes)), find each
  one's cell by a binary search per dimension, apply the cell's affine map, sort per canonical tensor
  when the map is not monotone, and cut into canonical chunks on the codec's chunk grid.

Cost grows with the shard's chunks and its changes, never with the canonical tensor: nothing
canonical-sized is allocated. Values are carried, not recomputed, so bits are exact by construction.
Dense local chunks (most elements changed) become sparse canonical chunks that list every position;
their XOR masks are taken against the local baseline the caller passes, as are the masks of pending
chunks, which keep none (:meth:`~dcr_ray.codec.encoding.diff.ChunkDelta.pending_form`).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator, NamedTuple

import numpy as np

from dcr_ray.codec.encoding.diff import NARROW_SPAN, ChunkDelta, TensorDelta
from dcr_ray.codec.encoding.packdiff import PackDelta
from dcr_ray.codec.primitives import locations
from dcr_ray.sharding.spec import ShardSpec, contiguous_strides


def project(td: TensorDelta, spec: ShardSpec, *, chunk_elems: int,
            old_bits: Callable[[], np.ndarray] | None = None, with_xor: bool = True) -> Iterator[TensorDelta]:
    """Yield the canonical changed sets of local changed set ``td`` (one per canonical tensor touched).

    ``old_bits()`` returns the local baseline's flat bits; it is needed only for XOR masks the chunks do
    not carry (dense chunks, pending chunks). Without it those masks are the new bits, fine for
    OVERWRITE-only sends such as bootstrap; ``with_xor=False`` (OVERWRITE-only sends) never takes masks.
    """
    masks = old_bits if with_xor else None
    off = spec.contiguous_offset()
    t0 = spec.cells[0]
    if off is not None:
        if off == 0 and t0.name == td.name and t0.shape == td.shape:
            yield _with_masks(td, masks)  # the local tensor is its canonical tensor
            return
        out = TensorDelta(t0.name, td.dtype, t0.shape, math.prod(t0.shape))
        for c in td.chunks:
            out.chunks.append(ChunkDelta(c.lo + off, c.hi + off, c.count, loc=c.loc, xor=_mask_of(c, masks),
                                         new=c.new, dense=c.dense))
        yield out
        return
    pos, xor, new = _changes(td, old_bits, with_xor)
    if not len(pos):
        return
    runs = _row_runs(spec)
    mapped = _map(pos, xor, new, spec) if runs is None else _map_runs(pos, xor, new, runs)
    for name, shape, cpos, cx, cn in mapped:
        out = TensorDelta(name, td.dtype, shape, math.prod(shape))
        out.chunks.extend(_grid_chunks(cpos, cx, cn, chunk_elems, math.prod(shape)))
        del cpos, cx, cn
        yield out


def project_all(deltas: Iterable[TensorDelta], specs: dict[str, ShardSpec], *, chunk_elems: int,
                old_bits: Callable[[str], np.ndarray] | None = None,
                with_xor: bool = True) -> Iterator[TensorDelta]:
    """:func:`project` every local changed set of ``deltas`` through ``specs[td.name]``; packs of small
    tensors (:class:`~dcr_ray.codec.encoding.packdiff.PackDelta`) hold only direct tensors and pass through."""
    for td in deltas:
        if isinstance(td, PackDelta):
            yield td
            continue
        yield from project(td, specs[td.name], chunk_elems=chunk_elems, with_xor=with_xor,
                           old_bits=None if old_bits is None else (lambda n=td.name: old_bits(n)))


def _mask_of(c: ChunkDelta, old_bits) -> np.ndarray | None:
    """The XOR masks of sparse chunk ``c``: its own, else taken against ``old_bits()`` (None without it);
    None for a dense chunk."""
    if c.is_dense or c.xor is not None or old_bits is None:
        return c.xor
    return np.bitwise_xor(old_bits()[c.positions()], c.new)


def _with_masks(td: TensorDelta, old_bits) -> TensorDelta:
    """``td``, or a copy whose sparse chunks carry XOR masks taken against ``old_bits()`` where they had
    none (a pending set on its way into a first attempt's frames)."""
    if old_bits is None or all(c.is_dense or c.xor is not None for c in td.chunks):
        return td
    chunks = [c if c.is_dense or c.xor is not None else
              ChunkDelta(c.lo, c.hi, c.count, loc=c.loc, xor=_mask_of(c, old_bits), new=c.new)
              for c in td.chunks]
    return TensorDelta(td.name, td.dtype, td.shape, td.numel, chunks)


def _changes(td: TensorDelta, old_bits, with_xor: bool = True):
    """All changed local positions of ``td`` (int64) with their XOR masks (None when ``with_xor`` is
    False) and new bits, in increasing order."""
    ps, xs, ns = [], [], []
    for c in td.chunks:
        if c.is_dense:
            n = c.dense
            if old_bits is None:
                p, x = np.arange(c.lo, c.hi, dtype=np.int64), n
            else:
                x = np.bitwise_xor(old_bits()[c.lo:c.hi], n)
                keep = np.flatnonzero(x)
                p, x, n = keep + c.lo, x[keep], n[keep]
            ps.append(p), xs.append(x), ns.append(n)
        else:
            p = c.positions()
            ps.append(p), ns.append(c.new)
            xs.append(c.xor if c.xor is not None or not with_xor else
                      (c.new if old_bits is None else np.bitwise_xor(old_bits()[p], c.new)))
    if not ps:  # a changed set with no chunks: nothing to project
        return np.empty(0, np.int64), None if not with_xor else np.empty(0, np.uint8), np.empty(0, np.uint8)
    if len(ps) == 1:
        return ps[0], xs[0] if with_xor else None, ns[0]
    pos = np.concatenate(ps)
    del ps
    xor = np.concatenate(xs) if with_xor else None
    del xs
    return pos, xor, np.concatenate(ns)


class _Run(NamedTuple):
    """One cell that is a stack of rows contiguous in both the local and the canonical flat order:
    local flat ``[lo, hi)`` -> canonical ``base + (i // row) * step + i % row`` for ``i = local - lo``."""

    lo: int
    hi: int
    row: int
    step: int
    base: int
    name: str
    shape: tuple[int, ...]


def _row_runs(spec: ShardSpec) -> list[_Run] | None:
    """The cells of ``spec`` (padding left out) as :class:`_Run`, in local order; None when a cell is
    not such a stack (then the general map applies)."""
    shape = spec.local_shape
    if not shape:
        return None
    lstrides = contiguous_strides(shape)
    out = []
    for _, starts, ext, t in spec.cell_boxes():
        big = [d for d, n in enumerate(ext) if n > 1]
        d0 = big[0] if big else len(shape) - 1
        if any(ext[d] != shape[d] for d in range(d0 + 1, len(shape))):
            return None  # rows of this cell are not contiguous locally
        if t is None:
            continue
        inner = contiguous_strides(ext)
        if any(ext[d] > 1 and t.strides[d] != inner[d] for d in range(d0 + 1, len(shape))):
            return None  # nor in the canonical tensor
        lo = sum(a * s for a, s in zip(starts, lstrides))
        row = math.prod(ext[d0 + 1:])
        out.append(_Run(lo, lo + math.prod(ext), row, t.strides[d0] if ext[d0] > 1 else row, t.base, t.name,
                        t.shape))
    return out


def _map_runs(pos: np.ndarray, xor: np.ndarray | None, new: np.ndarray, runs: list[_Run]):
    """:func:`_map` for specs made of :class:`_Run` cells, one canonical tensor at a time: each cell's
    changes are a slice of ``pos``; positions of a tensor are made only when it is yielded."""
    edges = np.searchsorted(pos, [b for r in runs for b in (r.lo, r.hi)])
    by_name: dict[str, list] = {r.name: [] for r in runs}  # tensors in first-cell order, as _map yields them
    for k, r in enumerate(runs):
        a, b = int(edges[2 * k]), int(edges[2 * k + 1])
        if a < b:
            by_name[r.name].append((a, b, r))
    for name, segs in by_name.items():
        if not segs:
            continue
        cp = np.empty(sum(b - a for a, b, _ in segs), dtype=np.int64)
        at = 0
        for a, b, r in segs:
            out = cp[at:at + b - a]
            np.subtract(pos[a:b], r.lo, out=out)
            if r.step != r.row:  # rows are spread apart in the canonical tensor
                out += (out // r.row) * (r.step - r.row)
            out += r.base
            at += b - a
        cx = None if xor is None else _take_segments(xor, segs)
        cn = _take_segments(new, segs)
        yield (name, segs[0][2].shape, *_in_order(cp, cx, cn))


def _in_order(cp: np.ndarray, cx: np.ndarray | None, cn: np.ndarray):
    """Canonical positions with their masks and new bits, sorted by position where the map was not
    monotone."""
    if len(cp) > 1 and not (cp[1:] > cp[:-1]).all():
        order = np.argsort(cp, kind="stable")
        cp, cx, cn = cp[order], None if cx is None else cx[order], cn[order]
    return cp, cx, cn


def _take_segments(a: np.ndarray, segs) -> np.ndarray:
    """``a[lo:hi]`` of every segment, joined (a view when there is one segment)."""
    if len(segs) == 1:
        return a[segs[0][0]:segs[0][1]]
    return np.concatenate([a[lo:hi] for lo, hi, _ in segs])


def _map(pos: np.ndarray, xor: np.ndarray | None, new: np.ndarray, spec: ShardSpec):
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
    del idx
    owner = tid[cell]
    del cell
    single = len(names) == 1 and (tid >= 0).all()
    for name, k in names.items():
        if single:
            cp, cx, cn = canon, xor, new
        else:
            sel = np.flatnonzero(owner == k)
            cp, cx, cn = canon[sel], None if xor is None else xor[sel], new[sel]
        if len(cp) == 0:
            continue
        yield (name, shapes[k], *_in_order(cp, cx, cn))


def _grid_chunks(pos: np.ndarray, xor: np.ndarray | None, new: np.ndarray, chunk_elems: int,
                 numel: int) -> Iterator[ChunkDelta]:
    """Sparse chunks on the canonical chunk grid ``[k * chunk_elems, (k + 1) * chunk_elems)``; ``pos``
    increasing. Chunk boundaries come from a binary search per grid line, so nothing per change is made
    besides each chunk's own location symbols."""
    first, last = int(pos[0]) // chunk_elems, int(pos[-1]) // chunk_elems
    cuts = np.searchsorted(pos, np.arange(first + 1, last + 1, dtype=np.int64) * chunk_elems).tolist()
    for a, b in zip([0] + cuts, cuts + [len(pos)]):
        if a == b:
            continue
        lo = int(pos[a]) // chunk_elems * chunk_elems
        hi = min(numel, lo + chunk_elems)
        rel = np.empty(b - a, dtype=np.int32 if chunk_elems < NARROW_SPAN else np.int64)
        np.subtract(pos[a:b], lo, out=rel, casting="unsafe")  # every value is below chunk_elems
        loc = locations.encode_in_place(rel)
        del rel
        yield ChunkDelta(lo, hi, b - a, loc=loc, xor=None if xor is None else xor[a:b], new=new[a:b])


__all__ = ["contiguous_strides", "project", "project_all"]
