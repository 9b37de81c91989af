"""Packs: many small tensors of one dtype changed, diffed, coded and applied as one.

An MoE model has tens of thousands of expert tensors. Item by item, each costs a Python round trip at
the owner (diff, header entry) and at the engine (decode, write) and ~100 bytes of header: seconds and
15+ bytes per change at 10^5 tensors. A pack lays ``k`` whole tensors of one wire dtype end to end in a
flat *pack space* (tensor ``t`` holds positions ``offsets[t] .. offsets[t + 1]``), keeps one set of
positions, XOR masks and new bits for all of them, and travels as one header entry plus a names table
(see :mod:`~dcr_ray.codec.format`). The compiled pointer kernels (:mod:`~dcr_ray.codec.ptrkernels`)
scan and write every tensor of a pack in one call, wherever each tensor's storage lives.

Invariants: a pack lists only tensors with at least one change, each whole (it covers ``[0, numel)``)
and at most once; its positions are sorted and unique. Expanded tensor by tensor
(:meth:`PackDelta.tensor_deltas`, :meth:`DecodedPack.items`) it is exactly the per-tensor changed set
and items, so anything that reads items (projection, receivers that map names) stays correct.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from dcr_ray.codec import locations, ptrkernels
from dcr_ray.codec.arena import address
from dcr_ray.codec.bits import bits_view, wire_name
from dcr_ray.codec.diff import ChunkDelta, TensorDelta, changed_positions
from dcr_ray.codec.format import Encoding

#: Tensors of at most this many elements are diffed and sent in packs (larger ones item by item: their
#: Python cost per tensor is small next to their scan).
PACK_MAX_ELEMS = 1 << 16
#: A pack is closed once it spans this many elements (4 Mi: the default chunk), so one pack's changed set
#: stays within a frame's bucket even if every element changed.
PACK_SPAN_ELEMS = 1 << 22


def packable(name: str, numel: int) -> bool:
    """Whether a tensor of ``numel`` elements named ``name`` goes into packs (names travel newline-ended)."""
    return 0 < numel <= PACK_MAX_ELEMS and "\n" not in name


@dataclass(slots=True)
class PackDelta:
    """The changed set of ``k`` whole tensors of one wire dtype, in pack space (sender side)."""

    dtype: str
    names: list[str]
    shapes: list[tuple[int, ...]]
    offsets: np.ndarray  #: int64, ``k + 1``: where each tensor starts in pack space, and the end
    positions: np.ndarray  #: int64, sorted and unique pack positions of the changes
    xor: np.ndarray  #: ``new ^ old`` at each position
    new: np.ndarray  #: the new bits at each position

    @property
    def changed(self) -> int:
        return len(self.positions)

    @property
    def nbytes(self) -> int:
        return self.positions.nbytes + self.xor.nbytes + self.new.nbytes + self.offsets.nbytes

    def tensor_deltas(self) -> list[TensorDelta]:
        """The same changes as one sparse :class:`~dcr_ray.codec.diff.TensorDelta` per tensor."""
        out = []
        for t, s, rel in per_tensor(self.positions, self.offsets):
            numel = int(self.offsets[t + 1] - self.offsets[t])
            ch = ChunkDelta(0, numel, len(rel), loc=locations.encode(rel, 0), xor=self.xor[s], new=self.new[s])
            out.append(TensorDelta(self.names[t], self.dtype, self.shapes[t], numel, [ch]))
        return out


def per_tensor(positions: np.ndarray, offsets: np.ndarray):
    """Per tensor of a pack: (its index, the slice of the pack's changes in it, their positions within the
    tensor), from the sorted pack ``positions`` and the tensors' ``offsets``."""
    cuts = np.searchsorted(positions, offsets)
    for t in range(len(offsets) - 1):
        s = slice(int(cuts[t]), int(cuts[t + 1]))
        yield t, s, positions[s] - offsets[t]


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
    offsets = np.zeros(k + 1, np.int64)
    np.cumsum([math.prod(s) for s in shapes], out=offsets[1:])
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
        sizes = np.diff(offsets)[kept]
        new_off = np.zeros(len(kept) + 1, np.int64)
        np.cumsum(sizes, out=new_off[1:])
        pos = pos - np.repeat(offsets[kept] - new_off[:-1], counts[kept])
        names = [names[i] for i in kept]
        shapes = [shapes[i] for i in kept]
        offsets = new_off
    return PackDelta(dtype, names, shapes, offsets, pos, xor, new)


def plan_packs(sizes: Mapping[str, int], span_elems: int = PACK_SPAN_ELEMS) -> list[list[str]]:
    """Cut the packable names of ``sizes`` (name -> elements, in order) into packs of at most
    ``span_elems`` elements (owners use their chunk size), keeping their order."""
    packs, cur, span = [], [], 0
    for name, n in sizes.items():
        if span + n > span_elems and cur:
            packs.append(cur)
            cur, span = [], 0
        cur.append(name)
        span += n
    if cur:
        packs.append(cur)
    return packs


@dataclass(slots=True)
class DecodedPack:
    """A validated pack of a frame (receiver side): where to write in which tensors, and what."""

    encoding: Encoding
    names: list[str]
    offsets: np.ndarray  #: int64, ``k + 1``
    positions: np.ndarray  #: validated pack positions (sorted, unique, below ``offsets[-1]``)
    values: np.ndarray  #: unsigned ints of the dtype's width (ADD: differences, not zigzagged)

    def items(self):
        """The pack as one :class:`~dcr_ray.codec.decode.DecodedItem` per tensor (whole range)."""
        from dcr_ray.codec.decode import DecodedItem

        return [DecodedItem(self.names[t], self.encoding, 0, int(self.offsets[t + 1] - self.offsets[t]), rel,
                            self.values[s])
                for t, s, rel in per_tensor(self.positions, self.offsets)]

    def addresses(self, targets: Mapping[str, torch.Tensor]) -> np.ndarray:
        """Data addresses of the pack's tensors in ``targets``, each checked (CPU, contiguous, the
        values' width, the pack's size) before any write."""
        k = len(self.names)
        w = self.values.dtype.itemsize
        ts = [targets[n] for n in self.names]
        sizes = np.diff(self.offsets)
        for t, n in zip(ts, sizes):
            if t.device.type != "cpu" or not t.is_contiguous() or t.element_size() != w or t.numel() != n:
                raise ValueError(f"pack target must be a contiguous CPU tensor of {n} {w}-byte elements, got "
                                 f"{t.dtype}{list(t.shape)} on {t.device}")
        return np.fromiter((t.data_ptr() for t in ts), np.int64, k)


def apply_pack(pack: DecodedPack, targets: Mapping[str, torch.Tensor], addrs: np.ndarray | None = None) -> int:
    """Write ``pack`` into ``targets`` in place; returns the elements written. ``addrs``: the checked
    addresses of :meth:`DecodedPack.addresses`, when the caller already has them."""
    if not ptrkernels.ENABLED:
        from dcr_ray.codec.apply import write_item

        for it in pack.items():
            write_item(bits_view(targets[it.name]), it)
        return len(pack.values)
    if addrs is None:
        addrs = pack.addresses(targets)
    if pack.encoding == Encoding.XOR:
        ptrkernels.xor_into(addrs, pack.offsets, pack.positions, pack.values)
    elif pack.encoding == Encoding.ADD:
        ptrkernels.add_into(addrs, pack.offsets, pack.positions, pack.values)
    else:
        ptrkernels.put_into(addrs, pack.offsets, pack.positions, pack.values)
    return len(pack.values)


def old_values(pack: DecodedPack, targets: Mapping[str, torch.Tensor]) -> np.ndarray:
    """The bits ``pack`` is about to replace (for an undo record)."""
    if not ptrkernels.ENABLED:
        parts = [np.take(bits_view(targets[it.name]), it.positions) for it in pack.items()]
        return np.concatenate(parts) if parts else np.empty(0, pack.values.dtype)
    return ptrkernels.take_from(pack.addresses(targets), pack.offsets, pack.positions, pack.values.dtype)
