"""Device-resident baselines: an owner's GPU shards are diffed where they live; only changes cross to host.

A trainer's shards sit in GPU memory. Copying each whole shard to the host every step (the host path)
moves the model over PCIe and scans it on the CPU. With a :class:`DeviceBaseline` the owner keeps the
committed bits of each CUDA shard on its device, compares the current bits there (integer views, so
``-0 != +0`` and NaN payloads compare by their bits), and copies only the changed positions and their
new bits to the host: O(changes) over PCIe and on the host. The host baseline is still kept (bootstrap,
digests and XOR masks read it); :func:`delta_from_changes` takes each change's XOR mask against it
and cuts the changes into sparse chunks on the codec's chunk grid, the same changed set the host diff
finds (the chunks are always sparse; the host diff may send a mostly-changed chunk DENSE instead).

The pending changes stay on the device beside the host pending set: :meth:`DeviceBaseline.promote`
scatters them into the device baseline when the commit record is written, :meth:`discard` drops them.
Everything here is plain ``torch`` on whatever device the tensors are on, so the same code runs (and is
tested) on CPU tensors.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from dcr_ray.codec.bits import np_uint, torch_int, wire_name
from dcr_ray.codec.encoding.diff import TensorDelta
from dcr_ray.sharding.project import _grid_chunks

if TYPE_CHECKING:  # annotations only: torch is imported where it runs
    import torch


def _int_view(t: torch.Tensor) -> torch.Tensor:
    """The flat integer view of ``t``'s bits (no copy)."""
    import torch

    t = t.detach().reshape(-1)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(torch_int(t.element_size()))


class DeviceBaseline:
    """Committed bits of local shards, on the shards' own device, with the pending changes beside them."""

    def __init__(self):
        self._bits: dict[str, torch.Tensor] = {}
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Take ``tensor``'s current bits as the committed baseline of ``name`` (a device copy)."""
        self._bits[name] = _int_view(tensor).clone()

    def __contains__(self, name: str) -> bool:
        return name in self._bits

    def names(self) -> list[str]:
        """The local tensors whose committed bits are held here."""
        return list(self._bits)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bits.values())

    def changes(self, name: str, tensor: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Changed flat positions of ``tensor`` against the baseline of ``name`` and their new bits, on
        the host (increasing positions); the device copies are kept as ``name``'s pending changes."""
        import torch

        base = self._bits[name]
        cur = _int_view(tensor)
        if cur.shape != base.shape or cur.dtype != base.dtype or cur.device != base.device:
            raise ValueError(f"{name}: the tensor ({tensor.dtype}, {tuple(tensor.shape)}, {tensor.device}) is "
                             f"not the one of attach ({base.dtype} bits of {base.numel()}, {base.device})")
        pos = torch.nonzero(cur != base).reshape(-1)
        new = cur[pos]
        self._pending[name] = (pos, new)
        width = tensor.element_size()
        return pos.cpu().numpy().astype(np.int64, copy=False), new.cpu().numpy().view(np_uint(width))

    def promote(self) -> None:
        """Fold the pending changes into the device baseline (the commit record is written)."""
        for name, (pos, new) in self._pending.items():
            self._bits[name][pos] = new
        self._pending.clear()

    def discard(self) -> None:
        """Drop the pending changes (the transfer was abandoned)."""
        self._pending.clear()


def delta_from_changes(name: str, tensor: torch.Tensor, pos: np.ndarray, new: np.ndarray,
                       old_bits: np.ndarray, *, chunk_elems: int) -> TensorDelta:
    """The changed set of local tensor ``name`` from its changed positions and new bits; ``old_bits``
    is the host baseline's flat bits (each change's XOR mask is taken against it, O(changes))."""
    numel = math.prod(tensor.shape)
    td = TensorDelta(name, wire_name(tensor.dtype), tuple(tensor.shape), numel)
    if len(pos):
        xor = np.bitwise_xor(old_bits[pos], new)
        td.chunks.extend(_grid_chunks(pos, xor, new, chunk_elems, numel))
    return td


__all__ = ["DeviceBaseline", "delta_from_changes"]
