"""Shared by the frame readers (:mod:`~dcr_ray.codec.decode`, :mod:`~dcr_ray.codec.packread`): the cursor
over a frame's decompressed sections, what an item or pack is once its header fields are checked, and
what the receiver holds under a name."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dcr_ray.codec import locations
from dcr_ray.codec.bits import dtype_of
from dcr_ray.codec.format import Encoding
from dcr_ray.errors import MalformedHeaderError, TargetMismatchError


class Job(NamedTuple):
    """An item whose header fields and section bytes passed every check; positions and values to decode."""

    what: str
    name: str
    enc: Encoding
    lo: int
    hi: int
    n: int
    loc: locations.EncodedLocations | None
    planes: list[np.ndarray]
    npdt: np.dtype
    is_bool: bool
    dt: str = ""


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
