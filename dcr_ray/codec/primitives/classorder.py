"""Positions in class order: location coding conditioned on the old values, which both sides hold.

Whether a floating-point element changes its stored bits in a step depends mostly on its magnitude:
an optimizer moves every weight by a similar amount, and an element changes only when that amount
reaches its unit in the last place, which doubles with each exponent. So the old value's exponent (the
receiver holds the old bits) predicts where the changes are. Instead of coding the changed positions
in flat order, where a high-exponent region and a low-exponent one interleave at element scale, an
item in one of the *class* location modes codes them in **class order**: the item's elements
``[lo, hi)`` sorted stably by the class of their old bits,

    class(e) = (old[e] >> MANTISSA_BITS) & EXPONENT_MASK        (the exponent field; the sign dropped)

Each class then forms one block of that order, changing at its own rate, so the gap symbols of a
class are short where changes are dense and long where they are rare, and the location symbols
(:mod:`~dcr_ray.codec.primitives.locations`, over the *ranks* of the changed elements in class order, range
``[0, hi - lo)``) shrink under the same compression. On the real AdamW updates of ``dcr-ray bench codec``
this cuts the position bytes by two thirds (BENCHMARKS.md).

Wire: the item's ``lm`` is ``"cgaps"`` / ``"cruns"`` (:class:`~dcr_ray.codec.format.LocationMode`),
whose symbols are exactly the ``"gaps"`` / ``"runs"`` symbols of the sorted ranks with ``lo = 0``; the
values stay in flat position order (the order a receiver writes them). Defined for the float dtypes of
:data:`EXPONENT_FIELDS` only; a frame that uses a class mode for another dtype is malformed.

This module is the order itself, on arrays: positions to ranks (:func:`ranks`, :func:`encode`: the
sender) and back (:func:`decode_ranks`, :func:`positions`: the receiver). Ranks are unique and inside
``[0, hi - lo)`` (checked by :func:`~dcr_ray.codec.primitives.locations.decode`), and class order is a permutation
of the item's elements, so the positions of valid ranks are unique, sorted and inside the item by
construction. Whether an item is worth coding this way is the sender's estimate
(:func:`~dcr_ray.codec.primitives.estimate.class_order_promising`); a decoded item's positions are read against
the receiver's old bits just before its first write (:mod:`~dcr_ray.codec.decoding.context`). Sender and
receiver must hold the same old bits, as for XOR items; a frame is bound to its base version and
content (:class:`~dcr_ray.codec.format.FrameMeta`).

Cost. Both directions walk the item's old bits once, reading each element's class straight from its
bits (compiled, :mod:`~dcr_ray.codec.compiled.kernels`). The sender counts every element into one of four
interleaved per-class counters, notes each changed element's count among the earlier elements of its
class, and sorts the ranks by class in O(changes) (a counting sort: ranks of one class rise with
position). The receiver needs where each class starts before it can walk: a counting pass, unless it
offers the counts it kept for the bits it holds (:func:`place`'s ``counts_hint``,
:mod:`~dcr_ray.codec.decoding.classcounts`). A hint is never trusted: the walk covers every element, so it ends
knowing the true counts, and a wrong hint costs a second walk, never a wrong position.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dcr_ray.codec.compiled import kernels
from dcr_ray.codec.format import LocationMode
from dcr_ray.codec.primitives import locations
from dcr_ray.errors import MalformedHeaderError

#: Wire dtype -> (mantissa bits, exponent bits): the class of an element is its exponent field.
EXPONENT_FIELDS: dict[str, tuple[int, int]] = {
    "bfloat16": (7, 8),
    "float16": (10, 5),
    "float32": (23, 8),
    "float64": (52, 11),
    "float8_e4m3fn": (3, 4),
    "float8_e5m2": (2, 5),
}
#: Class mode -> the flat mode whose symbols it uses.
BASE_MODE = {LocationMode.CLASS_GAPS: LocationMode.GAPS, LocationMode.CLASS_RUNS: LocationMode.RUNS}
_CLASS_OF = {v: k for k, v in BASE_MODE.items()}
#: Wire strings of the class modes.
MODES = tuple(m.value for m in BASE_MODE)


def supports(dtype: str) -> bool:
    """Whether items of wire dtype ``dtype`` may use a class mode."""
    return dtype in EXPONENT_FIELDS


def _field(dtype: str) -> tuple[int, int]:
    shift, bits = EXPONENT_FIELDS[dtype]
    return shift, (1 << bits) - 1


def class_count(dtype: str) -> int:
    """How many classes elements of ``dtype`` (a float dtype of :data:`EXPONENT_FIELDS`) fall into."""
    return _field(dtype)[1] + 1


def classes(old: np.ndarray, dtype: str) -> np.ndarray:
    """The class of every element of ``old`` (bits of wire dtype ``dtype``), as uint16."""
    return _classes(old, *_field(dtype))


def ranks(old: np.ndarray, rel: np.ndarray, dtype: str) -> np.ndarray:
    """Sorted ranks (int64) in the class order of ``old`` (an item's old bits) of the sorted relative
    positions ``rel``."""
    shift, mask = _field(dtype)
    if kernels.ENABLED:  # one walk over the old bits, reading each element's class in place
        return kernels.class_ranks(old, rel.astype(np.int64, copy=False), shift, mask)
    order = np.argsort(_classes(old, shift, mask), kind="stable")
    inv = np.empty(len(old), np.int64)
    inv[order] = np.arange(len(old), dtype=np.int64)
    r = inv[rel]
    r.sort()
    return r


def counts(old: np.ndarray, dtype: str) -> np.ndarray:
    """How many elements of ``old`` fall into each class (int64, :func:`class_count` entries)."""
    shift, mask = _field(dtype)
    if kernels.ENABLED:
        return np.diff(kernels.class_starts(old, shift, mask))
    return np.bincount(_classes(old, shift, mask), minlength=mask + 1).astype(np.int64)


def counts_at(view: np.ndarray, positions: np.ndarray, dtype: str) -> np.ndarray:
    """How many of the elements of ``view`` at the in-bounds ``positions`` fall into each class (int64)."""
    shift, mask = _field(dtype)
    if kernels.ENABLED:
        return kernels.class_counts_at(view, positions, shift, mask)
    return np.bincount(_classes(view[positions], shift, mask), minlength=mask + 1).astype(np.int64)


@dataclasses.dataclass(frozen=True, slots=True)
class Placed:
    """What :func:`place` found: the positions, and the class counts of the old bits they were read
    against (``counts``, exact) with the classes those positions held (``hits``, per class), so a
    receiver can keep the counts of the bits it holds after writing them
    (:mod:`~dcr_ray.codec.decoding.classcounts`)."""

    positions: np.ndarray
    counts: np.ndarray
    hits: np.ndarray
    #: whether the ``counts`` the caller offered were right (one walk), or had to be replaced (two)
    counts_were_right: bool


def positions(old: np.ndarray, r: np.ndarray, dtype: str) -> np.ndarray:
    """Sorted relative positions (int64) of the sorted, unique ranks ``r`` (all ``< len(old)``)."""
    return place(old, r, dtype).positions


def place(old: np.ndarray, r: np.ndarray, dtype: str, counts_hint: np.ndarray | None = None) -> Placed:
    """The positions of the sorted, unique ranks ``r`` (all ``< len(old)``), as :func:`positions`, with
    what a receiver keeps between refits (:class:`Placed`).

    ``counts_hint``: the class counts of ``old`` as the caller believes them (a receiver's counts of its
    committed bits, kept between refits). They are never trusted: the walk covers every element, so it
    learns the true counts as it goes, and when they differ from the hint it walks again with them. The
    result is the same either way; a right hint saves the counting pass."""
    shift, mask = _field(dtype)
    ncls = mask + 1
    if not kernels.ENABLED:
        cls = _classes(old, shift, mask)
        p = np.argsort(cls, kind="stable")[r]
        p.sort()
        true = np.bincount(cls, minlength=ncls).astype(np.int64)
        return Placed(p, true, np.bincount(cls[p], minlength=ncls).astype(np.int64),
                      counts_hint is not None and np.array_equal(counts_hint, true))
    right = counts_hint is not None and len(counts_hint) == ncls and int(counts_hint.sum()) == len(old) \
        and bool((counts_hint >= 0).all())
    start = _starts(counts_hint) if right else kernels.class_starts(old, shift, mask)
    p, run, hits, _ = kernels.class_positions(old, r, shift, mask, start)
    if right and not np.array_equal(run, start[1:]):  # the hint was wrong: the walk counted the truth
        right = False
        start = _starts(run - start[:-1])
        p, run, hits, _ = kernels.class_positions(old, r, shift, mask, start)
    return Placed(p, np.diff(start), hits, right)


def _starts(counts: np.ndarray) -> np.ndarray:
    start = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=start[1:])
    return start


def _classes(old: np.ndarray, shift: int, mask: int) -> np.ndarray:
    # uint16 keys: numpy's stable sort of 16-bit integers is a radix sort
    t = old.dtype.type
    return np.bitwise_and(np.right_shift(old, t(shift)), t(mask)).astype(np.uint16)


def encode(old: np.ndarray, rel: np.ndarray, dtype: str) -> locations.EncodedLocations:
    """Class-mode coding of the sorted relative positions ``rel`` of an item whose old bits are ``old``."""
    enc = locations.encode(ranks(old, rel, dtype), 0)
    return dataclasses.replace(enc, mode=_CLASS_OF[enc.mode])


def decode_ranks(enc: locations.EncodedLocations, dtype: str, lo: int, hi: int, count: int) -> np.ndarray:
    """Validated ranks of a class-mode item (raises like :func:`~dcr_ray.codec.primitives.locations.decode`)."""
    if not supports(dtype):
        raise MalformedHeaderError(f"location mode {enc.mode!r} is defined for float dtypes "
                                   f"{sorted(EXPONENT_FIELDS)} only, not {dtype!r}")
    return locations.decode(dataclasses.replace(enc, mode=BASE_MODE[LocationMode(enc.mode)]), 0, hi - lo, count)
