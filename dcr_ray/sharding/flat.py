"""Flat ranges: a 1-D local shard that is a contiguous run ``[start, stop)`` of a canonical tensor's flat
(row-major) elements, as veRL's ``get_per_tensor_param_shard`` and FSDP1-style flat parameters export them.

A flat range is not one box when it starts or ends inside a row, so it cannot be one cell of a
:class:`~dcr_ray.sharding.spec.ShardSpec`. It is, however, always a short list of boxes that are each
contiguous in flat order: along dimension 0 a range splits into a partial leading slice, a run of whole
slices, and a partial trailing slice, and each partial slice splits the same way one dimension down.
An n-dimensional range therefore needs at most ``2n - 1`` boxes (a 2-D range: partial row, full rows,
partial row). Because every box is flat-contiguous, its local tensor is a *view* of the flat shard
(``flat[lo:hi].view(box_shape)``): nothing is copied, nothing is gathered, and each piece maps onto its
box with an ordinary :meth:`ShardSpec.box` spec, so the owner's diff, projection (a shift, since every
piece is one contiguous canonical run), coverage check and frames are the ones every other layout uses.

Coverage: owners whose flat ranges tile a tensor declare boxes that tile it
(:func:`~dcr_ray.sharding.coverage.check_tiling` accepts them); a gap or an overlap between ranges is an
uncovered or twice-owned box there, reported with the tensor's name.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from dcr_ray.sharding.local import Shard
from dcr_ray.sharding.spec import ShardSpec, ShardSpecError

if TYPE_CHECKING:  # annotations only: torch is imported where it runs
    import torch


class FlatPiece(NamedTuple):
    """One flat-contiguous box of a flat range: local elements ``[lo, hi)`` of the range (relative to its
    start) are the box at ``offset`` of shape ``box_shape`` (extent 1 in the dimensions it is fixed in)."""

    lo: int
    hi: int
    offset: tuple[int, ...]
    box_shape: tuple[int, ...]
    spec: ShardSpec


#: ``(flat_lo, flat_hi, offset, box_shape)`` of one flat-contiguous box.
FlatBox = tuple[int, int, tuple[int, ...], tuple[int, ...]]


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[FlatBox]:
    """Decompose canonical flat range ``[start, stop)`` of a tensor of ``shape`` into flat-contiguous boxes.

    Returns ``(flat_lo, flat_hi, offset, box_shape)`` in flat order (canonical flat indices); at most
    ``2 * ndim - 1`` boxes, none for an empty range.
    """
    shape = tuple(int(n) for n in shape)
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ShardSpecError(f"flat range [{start}, {stop}) is outside a tensor of shape {shape} ({numel} elements)")
    out: list = []
    _split(shape, start, stop, (), 0, out)
    return out


def _split(shape: tuple[int, ...], a: int, b: int, prefix: tuple[int, ...], base: int, out: list) -> None:
    """Boxes of range ``[a, b)`` (relative to the sub-tensor at ``prefix``, whose first flat index is
    ``base``), appended to ``out`` in flat order."""
    if a >= b:
        return
    if not shape:  # a 0-d tensor: its one element
        out.append((base, base + 1, prefix, ()))
        return
    inner = math.prod(shape[1:])
    lead = (1,) * len(prefix)
    if inner == 0:
        return
    r0, r1 = a // inner, b // inner
    if a % inner == 0 and b % inner == 0:  # whole slices r0..r1 of this dimension
        out.append((base + a, base + b, prefix + (r0,) + (0,) * (len(shape) - 1), lead + (r1 - r0,) + shape[1:]))
        return
    if r0 == r1 or (r1 == r0 + 1 and b % inner == 0):  # inside one slice: one dimension down
        _split(shape[1:], a - r0 * inner, b - r0 * inner, prefix + (r0,), base + r0 * inner, out)
        return
    full_lo = r0
    if a % inner:  # partial leading slice
        _split(shape[1:], a - r0 * inner, inner, prefix + (r0,), base + r0 * inner, out)
        full_lo = r0 + 1
    if r1 > full_lo:
        _split(shape, full_lo * inner, r1 * inner, prefix, base, out)
    if b % inner:  # partial trailing slice
        _split(shape[1:], 0, b - r1 * inner, prefix + (r1,), base + r1 * inner, out)


def flat_range(name: str, shape: tuple[int, ...], start: int, stop: int) -> list[FlatPiece]:
    """The pieces that map local flat elements ``[0, stop - start)`` onto canonical ``name`` of ``shape``
    at flat offset ``start``: one :class:`FlatPiece` (with its :meth:`ShardSpec.box` spec) per box."""
    shape = tuple(int(n) for n in shape)
    out = []
    for lo, hi, offset, box in flat_boxes(shape, start, stop):
        full_offset = tuple(offset) + (0,) * (len(shape) - len(offset))
        local = tuple(box)
        out.append(FlatPiece(lo - start, hi - start, full_offset, local,
                             ShardSpec.box(name, shape, full_offset, local)))
    return out


def flat_shards(name: str, local: torch.Tensor, shape: tuple[int, ...], start: int) -> dict[str, Shard]:
    """Local name -> :class:`~dcr_ray.sharding.local.Shard` for a flat local shard ``local`` that holds
    canonical ``name``'s flat elements ``[start, start + local.numel())``: views of ``local``, no copy.

    Local names are ``"<name>@<flat lo>"`` (unique within one owner as long as its ranges of one tensor
    do not overlap, which coverage requires anyway).
    """
    flat = local.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    pieces = flat_range(name, shape, int(start), int(start) + flat.numel())
    return {f"{name}@{start + p.lo}": Shard(flat[p.lo:p.hi].view(p.box_shape), p.spec) for p in pieces}


__all__ = ["FlatBox", "FlatPiece", "flat_boxes", "flat_range", "flat_shards"]
