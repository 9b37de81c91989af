"""Shard specs: how one local tensor of a training shard maps onto canonical (checkpoint) tensors.

A local tensor is cut by a grid (interior cut points per local dimension) into *cells*; each cell maps
affinely onto one canonical tensor, or onto nothing (padding rows that have no canonical home)::

    canonical flat index = target.base + sum_d (local_index_d - cell_start_d) * target.strides[d]

Every layout a trainer uses is such a grid: a whole tensor (one cell, canonical strides), a slice along
any dimension at any offset (FSDP2 ``Shard(d)``, tensor-parallel column/row splits, uneven last
shards), a transposed copy (strides permuted), fused QKV with grouped-query heads interleaved (cells
along dim 0 alternating between q/k/v), fused gate/up halves, stacked experts (one cell per expert) and
vocab padding (a cell with no target). :mod:`dcr_ray.sharding.layouts` builds these.

Because each cell is a box of its canonical tensor, ownership is checkable per element without
enumerating elements (:meth:`ShardSpec.boxes`, :func:`dcr_ray.sharding.coverage.check_tiling`).

What is not affine (a value-changing conversion such as a norm stored as ``w - 1``, scales of
quantized weights) is *residual*: the owner converts it to the canonical tensor itself and marks it
``overwrite_only`` (:meth:`ShardSpec.residual`), so it is diffed in canonical values and always sent
as OVERWRITE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dcr_ray.errors import ConfigError


class ShardSpecError(ConfigError):
    """A shard spec that does not describe a valid mapping (out of bounds, wrong sizes, overlap)."""


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    out, s = [], 1
    for n in reversed(shape):
        out.append(s)
        s *= n
    return tuple(reversed(out))


@dataclass(frozen=True, slots=True)
class Target:
    """Where one cell goes: canonical tensor ``name`` of ``shape``; ``base`` is the canonical flat index
    of the cell's first element and ``strides[d]`` the canonical step of local dimension ``d``."""

    name: str
    shape: tuple[int, ...]
    base: int
    strides: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Box:
    """A box ``[start, stop)`` per dimension of canonical tensor ``name``."""

    name: str
    start: tuple[int, ...]
    stop: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(b - a for a, b in zip(self.start, self.stop))


def box_target(name: str, shape: tuple[int, ...], offset: tuple[int, ...], dims: tuple[int, ...] | None = None,
               local_ndim: int | None = None) -> Target:
    """The target of a cell that is the box of ``name`` starting at ``offset``.

    ``dims[d]`` is the canonical dimension local dimension ``d`` runs along (identity by default; a
    permutation for a transposed copy; ``None`` entries for local dimensions of extent 1 that have no
    canonical counterpart, such as the expert axis of a stacked tensor mapped onto per-expert tensors).
    """
    shape, offset = tuple(shape), tuple(offset)
    if len(offset) != len(shape):
        raise ShardSpecError(f"{name}: offset {offset} has {len(offset)} dims, the tensor has {len(shape)}")
    cs = contiguous_strides(shape)
    if dims is None:
        extra = 0 if local_ndim is None else local_ndim - len(shape)
        if extra < 0:
            raise ShardSpecError(f"{name}: a {local_ndim}-d cell cannot fill a {len(shape)}-d box without dims=")
        dims = (None,) * extra + tuple(range(len(shape)))
    base = sum(o * s for o, s in zip(offset, cs))
    return Target(name, shape, base, tuple(0 if k is None else cs[k] for k in dims))


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """How a local tensor of ``local_shape`` maps onto canonical tensors (see the module docstring).

    ``cuts[d]``: interior cut points of local dimension ``d`` (sorted, in ``(0, local_shape[d])``);
    the cells are the grid they make, in row-major order, ``cells[i]`` their targets (``None``: padding,
    never sent). ``overwrite_only``: a residual tensor, always sent as OVERWRITE.
    """

    local_shape: tuple[int, ...]
    cells: tuple[Target | None, ...]
    cuts: tuple[tuple[int, ...], ...] = field(default=())
    overwrite_only: bool = False

    def __post_init__(self):
        shape = tuple(int(n) for n in self.local_shape)
        object.__setattr__(self, "local_shape", shape)
        cuts = tuple(tuple(int(c) for c in cd) for cd in self.cuts) or ((),) * len(shape)
        object.__setattr__(self, "cuts", cuts)
        object.__setattr__(self, "cells", tuple(self.cells))
        if len(cuts) != len(shape):
            raise ShardSpecError(f"cuts has {len(cuts)} dims, local shape {shape} has {len(shape)}")
        for d, cd in enumerate(cuts):
            if any(not 0 < c < shape[d] for c in cd) or list(cd) != sorted(set(cd)):
                raise ShardSpecError(f"cuts of dim {d} must be increasing and inside (0, {shape[d]}), got {cd}")
        if len(self.cells) != math.prod(len(cd) + 1 for cd in cuts):
            raise ShardSpecError(f"{len(self.cells)} cells for a grid of "
                                 f"{math.prod(len(cd) + 1 for cd in cuts)}")
        for box in self.boxes():  # validates every cell against its canonical tensor
            pass

    # -- constructors ------------------------------------------------------------------------------
    @classmethod
    def direct(cls, name: str, shape: tuple[int, ...]) -> "ShardSpec":
        """The local tensor *is* canonical tensor ``name``."""
        shape = tuple(shape)
        return cls(shape, (box_target(name, shape, (0,) * len(shape)),))

    @classmethod
    def residual(cls, name: str, shape: tuple[int, ...]) -> "ShardSpec":
        """A canonical tensor the owner converted itself (not affine): always sent as OVERWRITE."""
        shape = tuple(shape)
        return cls(shape, (box_target(name, shape, (0,) * len(shape)),), overwrite_only=True)

    @classmethod
    def box(cls, name: str, canonical_shape: tuple[int, ...], offset: tuple[int, ...],
            local_shape: tuple[int, ...]) -> "ShardSpec":
        """The local tensor is the box of ``name`` at ``offset`` with ``local_shape`` (a slice along any
        dimensions: FSDP ``Shard(d)``, TP column/row splits, uneven last shards)."""
        return cls(tuple(local_shape), (box_target(name, tuple(canonical_shape), tuple(offset)),))

    # -- geometry ----------------------------------------------------------------------------------
    def cell_bounds(self) -> list[list[tuple[int, int]]]:
        """Per local dimension, the ``[start, stop)`` ranges of its grid slots."""
        out = []
        for n, cd in zip(self.local_shape, self.cuts):
            pts = (0, *cd, n)
            out.append([(pts[i], pts[i + 1]) for i in range(len(pts) - 1)])
        return out

    def cell_boxes(self):
        """Yield (cell index, local starts, local extents, target) for every cell, row-major."""
        bounds = self.cell_bounds()
        for i, t in enumerate(self.cells):
            idx, rest = [], i
            for b in reversed(bounds):
                idx.append(rest % len(b))
                rest //= len(b)
            idx.reverse()
            starts = tuple(bounds[d][k][0] for d, k in enumerate(idx))
            ext = tuple(bounds[d][k][1] - bounds[d][k][0] for d, k in enumerate(idx))
            yield i, starts, ext, t

    def boxes(self) -> list[Box]:
        """The canonical box each cell covers (raises :class:`ShardSpecError` for a cell that is not a box
        inside its canonical tensor)."""
        out = []
        for _, _, ext, t in self.cell_boxes():
            if t is None:
                continue
            out.append(_target_box(t, ext))
        return out

    @property
    def names(self) -> tuple[str, ...]:
        """Canonical tensors this local tensor contributes to, in first-cell order."""
        return tuple(dict.fromkeys(t.name for t in self.cells if t is not None))

    @property
    def is_direct(self) -> bool:
        """One cell that is a whole canonical tensor laid out like the local tensor."""
        if len(self.cells) != 1 or self.cells[0] is None:
            return False
        t = self.cells[0]
        return t.base == 0 and t.shape == self.local_shape and t.strides == contiguous_strides(t.shape)

    def contiguous_offset(self) -> int | None:
        """The canonical flat offset if the whole local tensor is one contiguous run of one canonical tensor
        (a whole tensor, or a ``Shard(0)`` slice), else None: then projection is a shift."""
        if len(self.cells) != 1 or self.cells[0] is None:
            return None
        t = self.cells[0]
        ls = contiguous_strides(self.local_shape)
        if any(n > 1 and s != l for n, s, l in zip(self.local_shape, t.strides, ls)):
            return None
        return t.base


def _target_box(t: Target, ext: tuple[int, ...]) -> Box:
    """The canonical box a cell of extents ``ext`` covers through target ``t``."""
    cs = contiguous_strides(t.shape)
    if len(t.strides) != len(ext):
        raise ShardSpecError(f"{t.name}: target has {len(t.strides)} strides for a {len(ext)}-d cell")
    if not 0 <= t.base < max(1, math.prod(t.shape)):
        raise ShardSpecError(f"{t.name}: base {t.base} outside the tensor of shape {t.shape}")
    start, rem = [], t.base
    for s in cs:
        start.append(rem // s)
        rem %= s
    stop = [a + 1 for a in start]
    used: set[int] = set()
    for d, (n, s) in enumerate(zip(ext, t.strides)):
        if n == 1:
            continue
        if s not in cs:
            raise ShardSpecError(f"{t.name}: local dim {d} steps {s} elements, not a dimension of {t.shape}")
        ks = [k for k, c in enumerate(cs) if c == s and t.shape[k] > 1 and k not in used]
        if not ks:
            raise ShardSpecError(f"{t.name}: local dim {d} steps {s} elements, not a free dimension of {t.shape}")
        k = ks[0]
        used.add(k)
        stop[k] = start[k] + n
    if any(b > n for b, n in zip(stop, t.shape)):
        raise ShardSpecError(f"{t.name}: cell box {start}..{stop} exceeds the canonical shape {t.shape}")
    return Box(t.name, tuple(start), tuple(stop))
