"""The receiver's side of class order: decoded items in their context, the old bits it holds.

A class-mode item (:mod:`~dcr_ray.codec.primitives.classorder`) arrives as validated ranks in the class order of
the bits its positions are about to replace, so its positions exist only against those bits.
:func:`resolve` reads them from the tensors that are about to be written (the receiver's apply and its
undo record both call it before the first write of a frame; resolving twice is a no-op), with the counts
of those bits the receiver kept since its last write (:mod:`~dcr_ray.codec.decoding.classcounts`: checked by the
walk, so a stale count costs a pass, never a wrong position); :func:`written` renews them after the
writes. Ranks are
unique and inside ``[0, hi - lo)``, and class order is a permutation of the item's elements, so the
resolved positions are unique, sorted and inside ``[lo, hi)`` by construction.

:func:`absolute` goes one step further for receivers that write only absolute bits (a loader-capture
path): every ``ADD`` item becomes the ``OVERWRITE`` of the bits it would give, read against the same
old bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from dcr_ray.codec.bits import bits_view, wire_name
from dcr_ray.codec.compiled import threads
from dcr_ray.codec.decoding import classcounts
from dcr_ray.codec.decoding.decoded import DecodedItem
from dcr_ray.codec.format import Encoding
from dcr_ray.codec.primitives import classorder
from dcr_ray.errors import TargetMismatchError

if TYPE_CHECKING:  # annotations only: torch is imported where it runs
    import torch

#: Frames whose class-mode items span at least this many elements resolve them on several threads.
PARALLEL_MIN_SPAN = 1 << 20


def resolve(items: Iterable[DecodedItem], tensors: Mapping[str, torch.Tensor]) -> None:
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
        if not classorder.supports(dt):
            raise TargetMismatchError(f"{it.name}: a class-mode item for a {dt} tensor")
        views[it.name] = (bits_view(t), dt)

    def run(share) -> None:
        for it in share:
            view, dt = views[it.name]
            it.positions = classcounts.place(view, it.lo, it.hi, it.ranks, dt)

    n = threads.codec_threads()
    if n > 1 and len(todo) > 1 and sum(it.hi - it.lo for it in todo) >= PARALLEL_MIN_SPAN:
        threads.run_all([lambda s=s: run(s) for s in threads.balance(todo, lambda it: it.hi - it.lo, n)])
    else:
        run(todo)


def written(items: Iterable[DecodedItem], tensors: Mapping[str, torch.Tensor]) -> None:
    """After ``items`` were written into ``tensors``: renew the kept class counts of every class-mode
    item's range (O(changes) each)."""
    for it in items:
        if it.ranks is not None and it.positions is not None:
            t = tensors[it.name]
            classcounts.after_write(bits_view(t), it.lo, it.hi, it.positions, wire_name(t.dtype))


def absolute(items: Iterable[DecodedItem], read: Callable[[str], torch.Tensor]) -> list[DecodedItem]:
    """``items`` with every ADD item turned into an OVERWRITE of the bits it would give, and class-mode
    positions resolved, reading old bits through ``read(name) -> tensor`` (once per tensor that needs
    it): for receivers that write only XOR, OVERWRITE and DENSE items (a loader-capture path, which
    reads its canonical bits back from live storage). Call before the first write of the items."""
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
