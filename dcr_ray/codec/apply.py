"""Applying frames: the writes of a validated :class:`~dcr_ray.codec.decoded.DecodedFrame`, in place.

Nothing here validates the frame's contents: :func:`~dcr_ray.codec.decode.read_frame` has checked every
position, range and value, so the compiled kernels (:mod:`~dcr_ray.codec.kernels` per item,
:mod:`~dcr_ray.codec.ptrkernels` per pack) write without bound checks. What can still fail (a target
that cannot be viewed in place) is checked before the first write, and class-mode positions are read
from the old bits before it too (:func:`~dcr_ray.codec.context.resolve`).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from dcr_ray.codec import context, kernels, ptrkernels, threads
from dcr_ray.codec.bits import bits_view
from dcr_ray.codec.decode import read_frame
from dcr_ray.codec.decoded import DecodedFrame, DecodedItem, DecodedPack
from dcr_ray.codec.format import DEFAULT_MAX_RAW_BYTES, Encoding

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


def apply_pack(pack: DecodedPack, targets: Mapping[str, torch.Tensor], addrs: np.ndarray | None = None) -> int:
    """Write ``pack`` into ``targets`` in place; returns the elements written. ``addrs``: the checked
    addresses of :meth:`~dcr_ray.codec.decoded.DecodedPack.addresses`, when the caller already has them."""
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


def apply_decoded(frame: DecodedFrame, targets: Mapping[str, torch.Tensor]) -> int:
    """Write a validated frame into ``targets`` in place; returns the number of elements written."""
    # Resolve every target's bit view and every pack's addresses before the first write: a target that
    # cannot be viewed (non-contiguous, not on the CPU) must fail the frame with nothing written.
    views = {it.name: bits_view(targets[it.name]) for it in frame.items}
    addrs = [pk.addresses(targets) for pk in frame.packs]
    context.resolve(frame.items, targets)  # class-mode positions, read from the old bits before any write
    written = sum(apply_pack(pk, targets, a) for pk, a in zip(frame.packs, addrs))

    def write(items) -> None:
        for it in items:
            write_item(views[it.name], it)
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
