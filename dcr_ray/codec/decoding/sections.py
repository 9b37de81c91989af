"""Shared by the frame readers (:mod:`~dcr_ray.codec.decoding.decode`, :mod:`~dcr_ray.codec.decoding.packread`): the
cursor over a frame's decompressed sections, what an item or pack is once its header fields are checked, and
what the receiver holds under a name.

Reading is two passes. The first walks the header's items and packs in order, checks every field
against the receiver and takes each one's bytes from the sections (:class:`SectionReader`: the items
and packs must use up every section exactly), giving one :class:`ItemJob` each. The second decodes the
jobs' positions and values, each on its own, so large frames share them out to the codec threads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcr_ray.codec.bits import dtype_of
from dcr_ray.codec.format import Encoding
from dcr_ray.codec.primitives.locations import EncodedLocations
from dcr_ray.errors import MalformedHeaderError, TargetMismatchError


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemJob:
    """An item (or a pack, over its pack space) whose header fields and section bytes passed every check:
    its positions and values are still to decode."""

    what: str  #: how errors name it ("item 3 (model.embed.weight)", "pack 0")
    name: str  #: the tensor it writes (a pack's label: its tensors come with the job)
    encoding: Encoding
    lo: int  #: the flat range ``[lo, hi)`` its positions must lie in
    hi: int
    count: int  #: changed elements it declares (``hi - lo`` for dense)
    locations: EncodedLocations | None  #: its location stream; None for dense
    planes: list[np.ndarray]  #: its value byte planes, ``count`` bytes each
    value_dtype: np.dtype  #: unsigned integers of the element width
    is_bool: bool  #: values must stay 0 or 1, and ADD is refused
    wire_dtype: str  #: the dtype's wire name (class modes are defined per dtype)


class SectionReader:
    """Hands out the sections' bytes in order; the items and packs must use up every section exactly."""

    def __init__(self, sec: dict[str, memoryview]):
        self.sec = sec
        self.cursor = {name: 0 for name in sec}

    def take(self, section: str, nbytes: int, what: str) -> memoryview:
        if nbytes == 0:
            return memoryview(b"")
        if section not in self.sec:
            raise MalformedHeaderError(f"{what} needs section {section!r}, which the frame lacks")
        a = self.cursor[section]
        if a + nbytes > len(self.sec[section]):
            raise MalformedHeaderError(f"{what} reads past the end of section {section!r}")
        self.cursor[section] = a + nbytes
        return self.sec[section][a:a + nbytes]

    def rest(self, section: str) -> memoryview:
        """Every byte of ``section`` not read yet (empty when the frame lacks it)."""
        if section not in self.sec:
            return memoryview(b"")
        return self.take(section, len(self.sec[section]) - self.cursor[section], "packs")

    def check_used(self) -> None:
        for name, used in self.cursor.items():
            if used != len(self.sec[name]):
                raise MalformedHeaderError(f"section {name!r} has {len(self.sec[name]) - used} bytes no item reads")


def receiver_holds(what: str, name: str, targets, shapes) -> tuple | None:
    """(torch dtype, shape) of tensor ``name`` as the receiver holds it: from ``targets`` (name -> tensor)
    or ``shapes`` (name -> (wire dtype, shape)); None when the receiver gave neither (the frame's own
    declaration stands). A name the receiver lacks raises :class:`TargetMismatchError`."""
    if targets is not None:
        t = targets.get(name)
        if t is None:
            raise TargetMismatchError(f"{what}: the receiver has no tensor named {name!r}")
        return t.dtype, tuple(t.shape)
    if shapes is not None:
        spec = shapes.get(name)
        if spec is None:
            raise TargetMismatchError(f"{what}: the receiver has no tensor named {name!r}")
        return dtype_of(spec[0]), tuple(spec[1])
    return None
