"""Applying frames: the writes of a validated :class:`~dcr_ray.codec.decoding.decoded.DecodedFrame`, in place.

Nothing here validates the frame's contents: :func:`~dcr_ray.codec.decoding.decode.read_frame` has checked every
position, range and value, so the compiled kernels (:mod:`~dcr_ray.codec.compiled.kernels` per item,
:mod:`~dcr_ray.codec.compiled.ptrkernels` per pack) write without bound checks. What can still fail (a target
that cannot be viewed in place) is checked before the first write, and class-mode positions are read
from the old bits before it too (:func:`~dcr_ray.codec.decoding.context.resolve`).

With an ``undo`` record (:class:`~dcr_ray.codec.decoding.undo.FrameUndo`), :func:`apply_decoded` keeps the bits
every write replaces in the same pass (the ``*_swap`` kernels read each word once, keep it, write it),
instead of a gather over the changed positions before the apply. Each item's (and pack's) inverse enters
the record as soon as its write returns and never before, and a write cannot stop half-way (the kernels
raise nothing on validated positions): whatever the frame wrote, even when it fails part-way, the
record covers.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping

import numpy as np

from dcr_ray.codec.bits import bits_view
from dcr_ray.codec.compiled import kernels, ptrkernels, threads
from dcr_ray.codec.decoding import context
from dcr_ray.codec.decoding.decode import read_frame
from dcr_ray.codec.decoding.decoded import DecodedFrame, DecodedItem, DecodedPack
from dcr_ray.codec.format import DEFAULT_MAX_RAW_BYTES, Encoding

if TYPE_CHECKING:  # annotations only: torch is imported where it runs
    import torch

#: Frames with at least this many written elements are applied by several codec threads.
APPLY_PARALLEL_MIN = 1 << 16
#: XOR items are applied this many positions at a time, so each write-back hits the lines just read.
APPLY_BLOCK = 1 << 14


def _combine_into(view: np.ndarray, positions: np.ndarray, values: np.ndarray, kernel, combine) -> None:
    """``view[positions] = combine(view[positions], values)`` (sorted, unique positions): the numba
    ``kernel`` when enabled, else take/put in cache-sized runs so each write-back hits the lines just read."""
    if kernels.ENABLED:
        kernel(view, positions, values)
        return
    for a in range(0, len(positions), APPLY_BLOCK):
        p = positions[a:a + APPLY_BLOCK]
        np.put(view, p, combine(np.take(view, p), values[a:a + APPLY_BLOCK]))


def _xor_into(view: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
    """``view[positions] ^= values``."""
    _combine_into(view, positions, values, kernels.xor_into, np.bitwise_xor)


def _add_into(view: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
    """``view[positions] += values`` modulo the word size (unsigned views wrap)."""
    _combine_into(view, positions, values, kernels.add_into, np.add)


def write_item(view: np.ndarray, it: DecodedItem) -> None:
    """Write one validated item into ``view`` (the flat bit view of its tensor)."""
    if it.encoding == Encoding.DENSE:
        view[it.lo:it.hi] = it.values
    elif it.encoding == Encoding.XOR:
        _xor_into(view, it.positions, it.values)
    elif it.encoding == Encoding.ADD:
        _add_into(view, it.positions, it.values)
    elif kernels.ENABLED:
        kernels.put_into(view, it.positions, it.values)
    else:
        np.put(view, it.positions, it.values)


def _swap_blocks(view: np.ndarray, positions: np.ndarray, values: np.ndarray, combine) -> np.ndarray:
    """numpy's ``view[positions] = combine(view[positions], values)`` returning the replaced bits, in
    cache-sized runs (``combine`` None: overwrite)."""
    old = np.empty(len(positions), view.dtype)
    for a in range(0, len(positions), APPLY_BLOCK):
        p = positions[a:a + APPLY_BLOCK]
        was = np.take(view, p, out=old[a:a + APPLY_BLOCK])
        v = values[a:a + APPLY_BLOCK]
        np.put(view, p, v if combine is None else combine(was, v))
    return old


#: Each sparse encoding's write: its one-pass kernel, its pointer-walk op, its numpy combine.
_SWAPS = {Encoding.XOR: ("xor_swap", "xor", np.bitwise_xor), Encoding.ADD: ("add_swap", "add", np.add),
          Encoding.OVERWRITE: ("put_swap", "overwrite", None)}


def swap_item(view: np.ndarray, it: DecodedItem) -> DecodedItem:
    """Write one validated item into ``view`` (as :func:`write_item`) and return its inverse: the bits it
    replaced, as an OVERWRITE of its positions (DENSE for a dense item), read in the same pass."""
    if it.encoding == Encoding.DENSE:
        old = np.array(view[it.lo:it.hi], copy=True)
        view[it.lo:it.hi] = it.values
        return DecodedItem(it.name, Encoding.DENSE, it.lo, it.hi, None, old)
    kernel, _, combine = _SWAPS[it.encoding]
    if kernels.ENABLED:
        old = getattr(kernels, kernel)(view, it.positions, it.values)
    else:
        old = _swap_blocks(view, it.positions, it.values, combine)
    return DecodedItem(it.name, Encoding.OVERWRITE, it.lo, it.hi, it.positions, old)


def _swap_pack(pack: DecodedPack, targets: Mapping[str, torch.Tensor], addrs: np.ndarray | None) -> DecodedPack:
    """Write ``pack`` (as :func:`apply_pack`) and return its inverse: the bits it replaced, as an
    OVERWRITE pack of the same positions, read in the same pass."""
    if ptrkernels.ENABLED:
        if addrs is None:
            addrs = pack.addresses(targets)
        old = ptrkernels.swap_into(addrs, pack.offsets, pack.positions, pack.values, _SWAPS[pack.encoding][1])
    else:
        parts = [swap_item(bits_view(targets[it.name]), it).values for it in pack.items()]
        old = np.concatenate(parts) if parts else np.empty(0, pack.values.dtype)
    return dataclasses.replace(pack, encoding=Encoding.OVERWRITE, values=old)


def apply_pack(pack: DecodedPack, targets: Mapping[str, torch.Tensor], addrs: np.ndarray | None = None) -> int:
    """Write ``pack`` into ``targets`` in place; returns the elements written. ``addrs``: the checked
    addresses of :meth:`~dcr_ray.codec.decoding.decoded.DecodedPack.addresses`, when the caller already has them."""
    if not ptrkernels.ENABLED:
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


def apply_decoded(frame: DecodedFrame, targets: Mapping[str, torch.Tensor], undo=None) -> int:
    """Write a validated frame into ``targets`` in place; returns the number of elements written.

    ``undo`` (a :class:`~dcr_ray.codec.decoding.undo.FrameUndo`, or anything with ``add_item`` / ``add_pack``)
    receives the inverse of each item and pack as soon as it is written, read in the same pass."""
    # Resolve every target's bit view and every pack's addresses before the first write: a target that
    # cannot be viewed (non-contiguous, not on the CPU) must fail the frame with nothing written.
    views = {it.name: bits_view(targets[it.name]) for it in frame.items}
    addrs = [pk.addresses(targets) for pk in frame.packs]
    context.resolve(frame.items, targets)  # class-mode positions, read from the old bits before any write
    written = 0
    for pk, a in zip(frame.packs, addrs):
        if undo is None:
            written += apply_pack(pk, targets, a)
        else:
            undo.add_pack(_swap_pack(pk, targets, a))
            written += len(pk.values)

    def write(items) -> None:
        for it in items:
            if undo is None:
                write_item(views[it.name], it)
            else:
                undo.add_item(swap_item(views[it.name], it))
            if it.ranks is not None:  # the class counts of the bits now held, read while they are in cache
                context.written([it], targets)

    # Items never overlap (read_frame refused overlapping ranges), so the codec threads may write
    # them concurrently: deal them out largest first to the least loaded thread.
    n_threads = threads.codec_threads()
    total = sum(len(it.values) for it in frame.items)
    if n_threads > 1 and len(frame.items) > 1 and total >= APPLY_PARALLEL_MIN:
        threads.run_all([lambda s=s: write(s)
                         for s in threads.balance(frame.items, lambda it: len(it.values), n_threads)])
    else:
        write(frame.items)
    return total + written


def apply_frame(data, targets: Mapping[str, torch.Tensor], *, key: bytes | None = None,
                expect_base: int | None = None, expect_base_id: str | None = None,
                max_raw_bytes: int = DEFAULT_MAX_RAW_BYTES) -> DecodedFrame:
    """Validate ``data`` completely, then apply it to ``targets`` in place. Returns the decoded frame.

    Pass ``expect_base``/``expect_base_id`` (the version and content identity ``targets`` hold) so a
    frame of another update is refused, and ``max_raw_bytes`` near the sender's bucket size (the
    default, :data:`~dcr_ray.codec.format.DEFAULT_MAX_RAW_BYTES`, fits the default bucket)."""
    frame = read_frame(data, targets, key=key, expect_base=expect_base, expect_base_id=expect_base_id,
                       max_raw_bytes=max_raw_bytes)
    apply_decoded(frame, targets)
    return frame
