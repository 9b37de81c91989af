"""The receiver's class counts of the bits it holds, kept between refits and checked on every use.

Placing a class-order item (:func:`~dcr_ray.codec.primitives.classorder.place`) needs, per exponent class, how many
of the item's old elements fall into it (where each class begins in class order). Counting them is a
pass over the item's old bits; the walk that places the changes is another. A receiver that keeps the
counts of the bits it holds skips the first pass: this module keeps them per item range of each
tensor, written after every apply of a class-order item in O(changes) (the counts of the bits that were
there, minus the classes the written positions held, plus the classes they hold now), so that the next
refit's frames, which are coded against exactly those bits, find them.

Nothing here is trusted. The walk covers every element of the item and learns the true counts as it
goes; when they differ from the kept ones (the tensor was written some other way: a dense bootstrap, a
peer copy, a rollback, a different tensor at the same address) it walks again with the true counts, so a
stale entry costs one more pass and never a wrong position. Entries are keyed by the tensor's data
address, its element type and the item's range.

Memory: an entry is two arrays of one 64-bit count per class (256 classes for BF16, FP32 and FP16-like
dtypes' fields up to 2048 for FP64), kept only for items of at least :data:`MIN_SPAN` elements: at most
``2 * 2048 * 8 / (MIN_SPAN * 8)`` = 1/32 of an FP64 item's bytes, 1/64 of a BF16 item's (0.2% at the
default 1 Mi-element chunks), and never more than :data:`MAX_BYTES` in all (least recently used first out).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from dcr_ray.codec.primitives import classorder

#: Items shorter than this are placed without kept counts (their counting pass is cheap).
MIN_SPAN = 1 << 17
#: Most bytes all entries together hold.
MAX_BYTES = 64 << 20

_lock = threading.Lock()
#: key -> (counts of the bits now held, per class how many of the last placed positions held it, or None
#: once they were written)
_entries: OrderedDict = OrderedDict()
_bytes = 0


def key(view: np.ndarray, lo: int, hi: int) -> tuple | None:
    """The entry key of item ``[lo, hi)`` of a tensor's flat bit view, or None when it is too short."""
    if hi - lo < MIN_SPAN:
        return None
    return view.__array_interface__["data"][0], view.dtype.str, lo, hi


def place(view: np.ndarray, lo: int, hi: int, ranks: np.ndarray, dtype: str) -> np.ndarray:
    """Absolute positions of a class-order item ``[lo, hi)`` of ``view`` with validated ``ranks``, read
    against the bits ``view`` holds now, using and renewing the kept counts of those bits."""
    k = key(view, lo, hi)
    with _lock:
        hint = _entries[k][0] if k in _entries else None
    got = classorder.place(view[lo:hi], ranks, dtype, hint)
    if k is not None:
        _store(k, got.counts, got.hits)
    return got.positions + lo


def after_write(view: np.ndarray, lo: int, hi: int, positions: np.ndarray, dtype: str) -> None:
    """Renew the kept counts of item ``[lo, hi)`` after its ``positions`` were written: what they held
    leaves its classes, what they hold now joins them (O(changes))."""
    k = key(view, lo, hi)
    if k is None:
        return
    with _lock:
        entry = _entries.get(k)
    if entry is None or entry[1] is None:
        return
    counts, held = entry
    now = classorder.counts_at(view, positions, dtype)
    _store(k, counts - held + now, None)


def forget() -> None:
    """Drop every kept count (tests and benchmarks start from a receiver that kept none)."""
    global _bytes
    with _lock:
        _entries.clear()
        _bytes = 0


def snapshot() -> dict:
    """A copy of what is kept, for :func:`restore` (benchmarks repeat one refit from the same state)."""
    with _lock:
        return dict(_entries)


def restore(kept: dict) -> None:
    """Keep exactly ``kept`` (a :func:`snapshot`)."""
    global _bytes
    with _lock:
        _entries.clear()
        _entries.update(kept)
        _bytes = sum(_size(e) for e in _entries.values())


def _size(entry) -> int:
    return 2 * entry[0].nbytes


def _store(k: tuple, counts: np.ndarray, hits: np.ndarray | None) -> None:
    global _bytes
    with _lock:
        old = _entries.pop(k, None)
        if old is not None:
            _bytes -= _size(old)
        entry = (counts, hits)
        _entries[k] = entry
        _bytes += _size(entry)
        while _bytes > MAX_BYTES and _entries:
            _bytes -= _size(_entries.popitem(last=False)[1])
