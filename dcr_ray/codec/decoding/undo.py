"""In-place rollback: the inverse of every write a transfer made into an engine, in O(changes) memory.

Every validated frame an engine applies in place gets an inverse (:class:`FrameUndo`): the bits each
item (or pack) replaces, as an OVERWRITE of those positions (DENSE for a dense item). Either
:meth:`UndoLog.record` reads them all before the apply (two passes over the changed positions), or
:meth:`UndoLog.open` puts an empty inverse in the log and the apply fills it as it writes, reading each
replaced word in the pass that writes it (:func:`~dcr_ray.codec.decoding.apply.apply_decoded` with ``undo``; a
backend offers that through ``EngineBackend.apply_with_undo``). An inverse in the log covers at least
every write its frame made: read back whole before any write, or filled item by item as each write
returns.
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
from typing import TYPE_CHECKING, Mapping

import numpy as np

from dcr_ray.codec.bits import bits_view
from dcr_ray.codec.compiled import kernels, ptrkernels, threads
from dcr_ray.codec.decoding import context
from dcr_ray.codec.decoding.apply import APPLY_PARALLEL_MIN
from dcr_ray.codec.decoding.decoded import DecodedFrame, DecodedItem, DecodedPack
from dcr_ray.codec.format import Encoding

if TYPE_CHECKING:  # annotations only: torch is imported where it runs
    import torch


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


class FrameUndo:
    """The inverse of one frame's writes: OVERWRITE (DENSE) items and OVERWRITE packs of the bits they
    replaced. Filled before the apply (:meth:`read_back`, two passes) or by the apply itself as each
    write returns (``apply_decoded(frame, targets, undo=...)``, one pass; the codec threads add to it
    concurrently, which is safe: a frame's items and packs never overlap, so their order is free)."""

    def __init__(self, frame: DecodedFrame):
        # the inverse goes from the frame's target back to its base (backends that tag outputs with the
        # version of the frames they applied then report the base again)
        self.meta = dataclasses.replace(frame.meta, base=frame.meta.target, target=frame.meta.base)
        self.items: list[DecodedItem] = []
        self.packs: list[DecodedPack] = []

    def add_item(self, inverse: DecodedItem) -> None:
        self.items.append(inverse)

    def add_pack(self, inverse: DecodedPack) -> None:
        self.packs.append(inverse)

    def read_back(self, frame: DecodedFrame, tensors: Mapping[str, torch.Tensor]) -> None:
        """Keep the inverse of all of ``frame`` now, before any of its writes (the two-pass record, for
        backends whose apply does not fill it: it is right however much of the frame they then write)."""
        context.resolve(frame.items, tensors)  # class-mode positions: from the bits about to be replaced
        self.items.extend(_read_back(frame.items, tensors))
        for pk in frame.packs:
            old = _pack_old_values(pk, tensors)
            self.packs.append(dataclasses.replace(pk, encoding=Encoding.OVERWRITE, values=old))

    @property
    def nbytes(self) -> int:
        return (sum(it.values.nbytes + (0 if it.positions is None else it.positions.nbytes) for it in self.items)
                + sum(pk.values.nbytes + pk.positions.nbytes + pk.offsets.nbytes for pk in self.packs))

    def frame(self) -> DecodedFrame:
        """The inverse as a frame a backend applies."""
        return DecodedFrame(self.meta, list(self.items), packs=list(self.packs))


class UndoLog:
    """Inverse frames of one transfer's in-place writes, newest last."""

    def __init__(self):
        self.transfer: str | None = None
        self._inverse: list[FrameUndo] = []

    def open(self, transfer: str, frame: DecodedFrame) -> FrameUndo:
        """A new, empty inverse of ``frame``, already in the log: the apply that fills it (one pass) may
        fail part-way, and whatever it wrote is still undone."""
        if self.transfer != transfer:
            self.clear()
            self.transfer = transfer
        inv = FrameUndo(frame)
        self._inverse.append(inv)
        return inv

    def record(self, transfer: str, frame: DecodedFrame, tensors: Mapping[str, torch.Tensor]) -> None:
        """Keep the inverse of ``frame`` (call just before applying it to ``tensors``)."""
        self.open(transfer, frame).read_back(frame, tensors)

    @property
    def records(self) -> tuple[FrameUndo, ...]:
        """The inverse frames held, oldest first (read-only view: for inspection)."""
        return tuple(self._inverse)

    @property
    def nbytes(self) -> int:
        """Bytes the log holds (positions and old bits)."""
        return sum(inv.nbytes for inv in self._inverse)

    def rollback(self, backend) -> int:
        """Undo every recorded write through ``backend`` (newest first), flush it; returns frames undone."""
        n = len(self._inverse)
        for inv in reversed(self._inverse):
            backend.apply(inv.frame())
        backend.flush()
        self.clear()
        return n

    def set_aside(self, backend, tensors: Mapping[str, torch.Tensor]) -> "UndoLog":
        """Undo every recorded write (newest first), reading back before each inverse the bits it replaces,
        and return those reads as a log of their own: the transfer's writes, set aside. ``rollback`` of the
        returned log writes them back exactly (newest read first, so overlapping writes of several attempts
        land in their order). This log is empty afterwards; memory stays O(changes)."""
        redo = UndoLog()
        transfer = self.transfer
        for inv in reversed(self._inverse):
            f = inv.frame()
            redo.record(transfer, f, tensors)
            backend.apply(f)
        backend.flush()
        self.clear()
        return redo

    def clear(self) -> None:
        self.transfer = None
        self._inverse = []
