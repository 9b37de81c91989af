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
(:mod:`~dcr_ray.codec.locations`, over the *ranks* of the changed elements in class order, range
``[0, hi - lo)``) shrink under the same compression. On the real AdamW updates of ``dcr-ray bench codec``
this cuts the position bytes by two thirds (BENCHMARKS.md).

Wire: the item's ``lm`` is ``"cgaps"`` / ``"cruns"`` (:class:`~dcr_ray.codec.format.LocationMode`),
whose symbols are exactly the ``"gaps"`` / ``"runs"`` symbols of the sorted ranks with ``lo = 0``; the
values stay in flat position order (the order a receiver writes them). Defined for the float dtypes of
:data:`EXPONENT_FIELDS` only; a frame that uses a class mode for another dtype is malformed.

Decoding needs the old bits, so a decoded item in a class mode carries its validated ranks and no
positions until :func:`resolve` maps them against the tensor that is about to be written (the receiver's
apply and its undo record both call it before the first write). Ranks are unique and inside
``[0, hi - lo)`` (checked by :func:`~dcr_ray.codec.locations.decode`), and class order is a permutation
of the item's elements, so the resolved positions are unique, sorted and inside ``[lo, hi)`` by
construction. Sender and receiver must hold the same old bits, as for XOR items; a frame is bound to
its base version and content (:class:`~dcr_ray.codec.format.FrameMeta`).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np
import torch

from dcr_ray.codec import kernels, locations, threads
from dcr_ray.codec.bits import bits_view, wire_name
from dcr_ray.codec.format import LocationMode
from dcr_ray.errors import MalformedHeaderError, TargetMismatchError

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
#: Old elements sampled by :func:`promising`, and the share of the flat estimate class order must beat.
SAMPLE_ELEMS = 4096
PROMISE = 0.9
#: Items of at most this many elements always get class-order positions computed (cheaper than judging).
ALWAYS_ELEMS = 1 << 14
#: Frames whose class-mode items span at least this many elements resolve them on several threads.
PARALLEL_MIN_SPAN = 1 << 20


def supports(dtype: str) -> bool:
    """Whether items of wire dtype ``dtype`` may use a class mode."""
    return dtype in EXPONENT_FIELDS


def _field(dtype: str) -> tuple[int, int]:
    shift, bits = EXPONENT_FIELDS[dtype]
    return shift, (1 << bits) - 1


def ranks(old: np.ndarray, rel: np.ndarray, dtype: str) -> np.ndarray:
    """Sorted ranks (int64) in the class order of ``old`` (an item's old bits) of the sorted relative
    positions ``rel``."""
    shift, mask = _field(dtype)
    if kernels.ENABLED:  # the walk reads a one-byte class per element (extracted by numpy, vectorized)
        r = kernels.class_ranks(_narrow(old, shift, mask), rel.astype(np.int64, copy=False), 0, mask)
    else:
        order = np.argsort(_classes(old, shift, mask), kind="stable")
        inv = np.empty(len(old), np.int64)
        inv[order] = np.arange(len(old), dtype=np.int64)
        r = inv[rel]
    r.sort()
    return r


def positions(old: np.ndarray, r: np.ndarray, dtype: str) -> np.ndarray:
    """Sorted relative positions (int64) of the sorted, unique ranks ``r`` (all ``< len(old)``)."""
    shift, mask = _field(dtype)
    if kernels.ENABLED:
        return kernels.class_positions(_narrow(old, shift, mask), r, 0, mask)
    order = np.argsort(_classes(old, shift, mask), kind="stable")
    p = order[r]
    p.sort()
    return p


def _narrow(old: np.ndarray, shift: int, mask: int) -> np.ndarray:
    """The class of every element in the narrowest unsigned type that holds it."""
    t = old.dtype.type
    c = np.bitwise_and(np.right_shift(old, t(shift)), t(mask))
    return c.astype(np.uint8 if mask < 256 else np.uint16)


def _classes(old: np.ndarray, shift: int, mask: int) -> np.ndarray:
    # uint16 keys: numpy's stable sort of 16-bit integers is a radix sort
    t = old.dtype.type
    return np.bitwise_and(np.right_shift(old, t(shift)), t(mask)).astype(np.uint16)


def promising(old: np.ndarray, rel: np.ndarray, dtype: str) -> bool:
    """Whether class order is likely to code ``rel`` in clearly fewer bits than flat order: a zero-order
    estimate from the classes of the changed elements (exact) and of a strided sample of
    :data:`SAMPLE_ELEMS` old elements (scaled), so a sender skips the full class walk where changes do
    not depend on magnitude (uniform noise, integer-like tensors). Cost O(changes + sample)."""
    n, k = len(old), len(rel)
    if not supports(dtype) or k == 0 or k == n:
        return False
    if n <= ALWAYS_ELEMS:  # the walk itself costs less than this estimate
        return True
    shift, mask = _field(dtype)
    sample = old[::max(1, n // SAMPLE_ELEMS)]
    share = np.bincount(_classes(sample, shift, mask), minlength=mask + 1) * (n / len(sample))
    hits = np.bincount(_classes(old[rel], shift, mask), minlength=mask + 1).astype(np.float64)
    size = np.maximum(share, hits)
    live = size > 0
    p = np.clip(hits[live] / size[live], 1e-12, 1 - 1e-12)
    class_bits = float((size[live] * -(p * np.log2(p) + (1 - p) * np.log2(1 - p))).sum())
    q = k / n
    flat_bits = n * -(q * np.log2(q) + (1 - q) * np.log2(1 - q))
    return class_bits < PROMISE * flat_bits


def encode(old: np.ndarray, rel: np.ndarray, dtype: str) -> locations.EncodedLocations:
    """Class-mode coding of the sorted relative positions ``rel`` of an item whose old bits are ``old``."""
    enc = locations.encode(ranks(old, rel, dtype), 0)
    return dataclasses.replace(enc, mode=_CLASS_OF[enc.mode])


def decode_ranks(enc: locations.EncodedLocations, dtype: str, lo: int, hi: int, count: int) -> np.ndarray:
    """Validated ranks of a class-mode item (raises like :func:`~dcr_ray.codec.locations.decode`)."""
    if not supports(dtype):
        raise MalformedHeaderError(f"location mode {enc.mode!r} is defined for float dtypes "
                                   f"{sorted(EXPONENT_FIELDS)} only, not {dtype!r}")
    return locations.decode(dataclasses.replace(enc, mode=BASE_MODE[LocationMode(enc.mode)]), 0, hi - lo, count)


def resolve(items, tensors: Mapping[str, torch.Tensor]) -> None:
    """Give every decoded item in a class mode its positions, read against the old bits of ``tensors``
    (call before the first write of the frame; resolving twice is a no-op). Each item's walk reads its
    whole range of old bits, so large frames spread their items over the codec threads."""
    todo = [it for it in items if it.positions is None and it.ranks is not None]
    if not todo:
        return
    views = {}
    for it in todo:  # every check before any walk
        t = tensors[it.name]
        dt = wire_name(t.dtype)
        if not supports(dt):
            raise TargetMismatchError(f"{it.name}: a class-mode item for a {dt} tensor")
        views[it.name] = (bits_view(t), dt)

    def run(share) -> None:
        for it in share:
            view, dt = views[it.name]
            it.positions = positions(view[it.lo:it.hi], it.ranks, dt) + it.lo

    n = threads.codec_threads()
    if n > 1 and len(todo) > 1 and sum(it.hi - it.lo for it in todo) >= PARALLEL_MIN_SPAN:
        threads.run_all([lambda s=s: run(s) for s in threads.balance(todo, lambda it: it.hi - it.lo, n)])
    else:
        run(todo)


def absolute(items, read) -> list:
    """``items`` with every ADD item turned into an OVERWRITE of the bits it would give, and class-mode
    positions resolved, reading old bits through ``read(name) -> tensor`` (once per tensor that needs
    it): for receivers that write only XOR, OVERWRITE and DENSE items (a loader-capture path, which
    reads its canonical bits back from live storage). Call before the first write of the items."""
    from dcr_ray.codec.decode import DecodedItem  # (decode imports this module)
    from dcr_ray.codec.format import Encoding

    items = list(items)
    need = {it.name for it in items if it.encoding == Encoding.ADD or (it.positions is None and it.ranks is not None)}
    if not need:
        return items
    old = {n: read(n) for n in need}
    resolve([it for it in items if it.name in old], old)
    out = []
    for it in items:
        if it.encoding == Encoding.ADD:
            new = bits_view(old[it.name])[it.positions] + it.values  # unsigned: wraps
            it = DecodedItem(it.name, Encoding.OVERWRITE, it.lo, it.hi, it.positions, new)
        out.append(it)
    return out
