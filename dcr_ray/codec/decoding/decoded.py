"""The receiver's data: a frame that passed every check, as items and packs ready to write.

:func:`~dcr_ray.codec.decoding.decode.read_frame` makes a :class:`DecodedFrame` and writes nothing;
:func:`~dcr_ray.codec.decoding.apply.apply_decoded` writes it in place; :class:`~dcr_ray.codec.decoding.undo.UndoLog`
keeps inverse frames of the same types. Every position here is validated: sorted, unique and inside
the item's range ``[lo, hi)`` (or the pack's space), so the compiled kernels write without bound checks.

Values are unsigned integers of the tensor's element width, whatever the dtype: XOR masks for ``XOR``,
the new bits for ``OVERWRITE`` and ``DENSE``, and for ``ADD`` the differences themselves (modulo the
word size, already un-zigzagged). A class-mode item (:mod:`~dcr_ray.codec.primitives.classorder`) carries its
validated ranks and no positions until :func:`~dcr_ray.codec.decoding.context.resolve` reads them against the
old bits just before the first write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import numpy as np

from dcr_ray.codec.format import Encoding, FrameMeta, PayloadKey
from dcr_ray.codec.packed import per_tensor

if TYPE_CHECKING:  # annotations only: torch is imported where it runs
    import torch


@dataclass(slots=True)
class DecodedItem:
    """One validated item: where to write (``positions`` or the dense range) and what."""

    name: str
    encoding: Encoding
    lo: int
    hi: int
    positions: np.ndarray | None  # None for dense (and for class modes until context.resolve)
    values: np.ndarray  # unsigned ints of the tensor's element size (ADD: the differences, not zigzagged)
    ranks: np.ndarray | None = None  # class-mode items: validated ranks in class order (codec.classorder)


@dataclass(slots=True)
class DecodedPack:
    """A validated pack of a frame (:mod:`~dcr_ray.codec.packed`): where to write in which tensors, and what."""

    encoding: Encoding
    names: list[str]
    offsets: np.ndarray  #: int64, ``k + 1``
    positions: np.ndarray  #: validated pack positions (sorted, unique, below ``offsets[-1]``)
    values: np.ndarray  #: unsigned ints of the dtype's width (ADD: differences, not zigzagged)

    def items(self) -> list[DecodedItem]:
        """The pack as one :class:`DecodedItem` per tensor (whole range)."""
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


@dataclass(slots=True)
class DecodedFrame:
    """A frame that passed every check; :func:`~dcr_ray.codec.decoding.apply.apply_decoded` writes it."""

    meta: FrameMeta
    items: list[DecodedItem] = field(default_factory=list)
    wire_bytes: int = 0
    raw_bytes: int = 0
    #: packs of whole small tensors, kept when the receiver asked for them (``decode_frame(keep_packs=
    #: True)``: it applies them with :func:`~dcr_ray.codec.decoding.apply.apply_decoded`); otherwise expanded into
    #: ``items``, so a receiver that reads only items misses nothing
    packs: list[DecodedPack] = field(default_factory=list)

    @property
    def changed(self) -> int:
        return sum(len(i.values) for i in self.items) + sum(len(p.values) for p in self.packs)

    @property
    def key(self) -> PayloadKey:
        """Deduplication key of the payload (``meta.key``)."""
        return self.meta.key
