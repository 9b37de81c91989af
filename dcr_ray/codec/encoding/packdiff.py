"""The sender's packs: the changed set of many small tensors of one dtype, found in one scan.

A pack lays whole small tensors end to end in one pack space (:mod:`~dcr_ray.codec.packed`).
:func:`diff_pack` compares each tensor with its committed bits and returns one :class:`PackDelta` for
all of them: sorted pack positions, the XOR masks ``new ^ old`` and the new bits there. With the pointer
kernels (:mod:`~dcr_ray.codec.compiled.ptrkernels`) that is one compiled call over every tensor's data address;
without them, one :func:`~dcr_ray.codec.encoding.scan.changed_positions` per tensor, giving the same arrays.
Tensors without a change leave the pack (:func:`_compact`), so a pack lists only changed tensors.

A pack's positions are always flat pack positions (no class order across tensors); how its values
travel is the frame builder's choice (:meth:`~dcr_ray.codec.encoding.encode.FrameBuilder.add_pack`). An owner
keeps a pack pending with ``xor=None``, like a tensor's pending form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from dcr_ray.codec.arena import address
from dcr_ray.codec.bits import bits_view, wire_name
from dcr_ray.codec.compiled import ptrkernels
from dcr_ray.codec.encoding.scan import changed_positions
from dcr_ray.codec.packed import pack_offsets

if TYPE_CHECKING:  # annotations only: torch is imported where it runs
    import torch


@dataclass(slots=True)
class PackDelta:
    """The changed set of ``k`` whole tensors of one wire dtype, in pack space (sender side)."""

    dtype: str
    names: list[str]
    shapes: list[tuple[int, ...]]
    offsets: np.ndarray  #: int64, ``k + 1``: where each tensor starts in pack space, and the end
    positions: np.ndarray  #: int64, sorted and unique pack positions of the changes
    xor: np.ndarray  #: ``new ^ old`` at each position (None in an owner's pending form)
    new: np.ndarray  #: the new bits at each position

    @property
    def changed(self) -> int:
        return len(self.positions)

    @property
    def nbytes(self) -> int:
        return self.positions.nbytes + self.xor.nbytes + self.new.nbytes + self.offsets.nbytes


def diff_pack(names: Sequence[str], shapes: Sequence[tuple[int, ...]], old: Sequence[np.ndarray],
              new: Sequence[torch.Tensor], old_addrs: np.ndarray | None = None) -> PackDelta | None:
    """The pack of the tensors among ``new`` that differ from their committed bits ``old`` (flat bit
    arrays of the committed ``shapes``), or None when none changed.

    Every tensor must be a contiguous CPU tensor of one dtype with its committed shape (checked before
    the scan: the kernel reads exactly that many elements at each address). ``old_addrs`` may give
    ``old``'s data addresses (a baseline that keeps them saves a lookup per tensor)."""
    k = len(names)
    if not k:
        return None
    dt = new[0].dtype
    for name, shape, t in zip(names, shapes, new):
        if not (t.dtype is dt and t.is_cpu and t.is_contiguous() and t.shape == shape):
            raise ValueError(f"{name}: a pack takes contiguous CPU tensors of one dtype in their committed "
                             f"shape; got {t.dtype}{list(t.shape)} on {t.device} (committed {list(shape)}, {dt})")
    offsets = pack_offsets([math.prod(s) for s in shapes])
    if ptrkernels.ENABLED:
        if old_addrs is None:
            old_addrs = np.fromiter((address(o) for o in old), np.int64, k)
        new_addrs = np.fromiter((t.data_ptr() for t in new), np.int64, k)
        pos, xor, nv = ptrkernels.scan(old_addrs, new_addrs, offsets, old[0].dtype)
    else:
        parts = []
        for i, (o, t) in enumerate(zip(old, new)):
            v = bits_view(t)
            p, x = changed_positions(o, v)
            if len(p):
                parts.append((p + offsets[i], x, v[p]))
        pos, xor, nv = (np.concatenate(c) for c in zip(*parts)) if parts else ((),) * 3
    if not len(pos):
        return None
    return _compact(wire_name(dt), list(names), list(shapes), offsets, pos, xor, nv)


def _compact(dtype, names, shapes, offsets, pos, xor, new) -> PackDelta:
    """Drop the tensors without a change from the pack (their positions shift down accordingly)."""
    cuts = np.searchsorted(pos, offsets)
    counts = np.diff(cuts)
    kept = np.flatnonzero(counts)
    if len(kept) < len(names):
        new_off = pack_offsets(np.diff(offsets)[kept])
        pos = pos - np.repeat(offsets[kept] - new_off[:-1], counts[kept])
        names = [names[i] for i in kept]
        shapes = [shapes[i] for i in kept]
        offsets = new_off
    return PackDelta(dtype, names, shapes, offsets, pos, xor, new)
