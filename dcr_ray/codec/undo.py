"""In-place rollback: the inverse of every write a transfer made into an engine, in O(changes) memory.

Before an engine applies a validated frame of a transfer, :meth:`UndoLog.record` keeps its inverse: the
bits each item (or pack) is about to replace, as an OVERWRITE of those positions (DENSE for a dense item).
Every inverse is idempotent: it restores the committed bits whether the frame was applied, applied in
part (a backend that failed half-way) or not at all, which an XOR inverse (the same masks again) would
not. If the transfer is abandoned, :meth:`UndoLog.rollback` applies the inverses newest first through
the backend's own ``apply`` and ``flush`` (so a runtime that reloads touched tensors reloads them
again), which returns every touched element to the committed version exactly; later attempts of the
same transfer stack their own inverses on top, so any mix of partial attempts unwinds. Committing (or
starting the next transfer) drops the log. Dense re-bootstrap stays the last resort,
for backends that cannot read their bits cheaply (``EngineBackend.undo_tensors()`` is None).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np
import torch

from dcr_ray.codec import context, kernels, ptrkernels, threads
from dcr_ray.codec.apply import APPLY_PARALLEL_MIN
from dcr_ray.codec.bits import bits_view
from dcr_ray.codec.decoded import DecodedFrame, DecodedItem, DecodedPack
from dcr_ray.codec.format import Encoding


def _inverse_item(it, tensors: Mapping[str, torch.Tensor]) -> DecodedItem:
    """The bits ``it`` is about to replace, as an OVERWRITE of its positions (DENSE for a dense item)."""
    view = bits_view(tensors[it.name])
    if it.encoding == Encoding.DENSE:
        return DecodedItem(it.name, Encoding.DENSE, it.lo, it.hi, None, np.array(view[it.lo:it.hi], copy=True))
    old = kernels.take(view, it.positions) if kernels.ENABLED else np.take(view, it.positions)
    return DecodedItem(it.name, Encoding.OVERWRITE, it.lo, it.hi, it.positions, old)


def _pack_old_values(pack: DecodedPack, tensors: Mapping[str, torch.Tensor]) -> np.ndarray:
    """The bits ``pack`` is about to replace, in pack order."""
    if not ptrkernels.ENABLED:
        parts = [np.take(bits_view(tensors[it.name]), it.positions) for it in pack.items()]
        return np.concatenate(parts) if parts else np.empty(0, pack.values.dtype)
    return ptrkernels.take_from(pack.addresses(tensors), pack.offsets, pack.positions, pack.values.dtype)


def _read_back(items: list, tensors: Mapping[str, torch.Tensor]) -> list[DecodedItem]:
    """The inverse of every item, in order; on the codec threads when the frame is large (the reads are
    bound by memory bandwidth, as the apply that follows is)."""
    n_threads = threads.codec_threads()
    if n_threads < 2 or len(items) < 2 or sum(len(it.values) for it in items) < APPLY_PARALLEL_MIN:
        return [_inverse_item(it, tensors) for it in items]
    shares = threads.balance(range(len(items)), lambda i: len(items[i].values), n_threads)
    done = threads.run_all([lambda s=s: [(i, _inverse_item(items[i], tensors)) for i in s] for s in shares])
    out: list = [None] * len(items)
    for share in done:
        for i, inv in share:
            out[i] = inv
    return out


class UndoLog:
    """Inverse frames of one transfer's in-place writes, newest last."""

    def __init__(self):
        self.transfer: str | None = None
        self._inverse: list[DecodedFrame] = []
        self.nbytes = 0

    def record(self, transfer: str, frame: DecodedFrame, tensors: Mapping[str, torch.Tensor]) -> None:
        """Keep the inverse of ``frame`` (call just before applying it to ``tensors``)."""
        if self.transfer != transfer:
            self.clear()
            self.transfer = transfer
        context.resolve(frame.items, tensors)  # class-mode positions: from the bits about to be replaced
        items = _read_back(frame.items, tensors)
        for it in items:
            self.nbytes += it.values.nbytes + (0 if it.positions is None else it.positions.nbytes)
        packs = []
        for pk in frame.packs:
            old = _pack_old_values(pk, tensors)
            packs.append(dataclasses.replace(pk, encoding=Encoding.OVERWRITE, values=old))
            self.nbytes += old.nbytes + pk.positions.nbytes + pk.offsets.nbytes
        # the inverse goes from the frame's target back to its base (backends that tag outputs with the
        # version of the frames they applied then report the base again)
        back = dataclasses.replace(frame.meta, base=frame.meta.target, target=frame.meta.base)
        self._inverse.append(DecodedFrame(back, items, packs=packs))

    def rollback(self, backend) -> int:
        """Undo every recorded write through ``backend`` (newest first), flush it; returns frames undone."""
        n = len(self._inverse)
        for inv in reversed(self._inverse):
            backend.apply(inv)
        backend.flush()
        self.clear()
        return n

    def clear(self) -> None:
        self.transfer = None
        self._inverse = []
        self.nbytes = 0
