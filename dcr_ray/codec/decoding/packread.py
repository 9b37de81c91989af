"""Reading the packs of a frame (layout: :mod:`~dcr_ray.codec.packed`): each declaration, the names and shapes
tables against the receiver's tensors, and the byte ranges each pack's positions and values decode from.

Every check runs before anything is decoded or written: a tensor named twice in a frame (in two packs,
or in a pack and an item), a shape or dtype unlike the receiver's, a torn table or a pack spanning more
than one location stream can address raises a ``FrameError``.
"""

from __future__ import annotations

import math

import numpy as np

from dcr_ray.codec.bits import dtype_of, itemsize, np_uint
from dcr_ray.codec.primitives import locations
from dcr_ray.codec.format import (
    PACK_ESC_SECTION,
    PACK_LOC_SECTION,
    PACK_NAMES_SECTION,
    PACK_PREFIX,
    PACK_SHAPES_SECTION,
    Encoding,
    value_section,
)
from dcr_ray.codec.decoding.header import need
from dcr_ray.codec.decoding.sections import ItemJob, SectionReader, receiver_holds
from dcr_ray.codec.packed import pack_offsets
from dcr_ray.errors import (
    DuplicateIndexError,
    MalformedHeaderError,
    SizeLimitError,
    TargetMismatchError,
    UnknownEncodingError,
)

#: Encodings a pack may use (whole tensors, sparse: never DENSE).
_PACK_ENCODINGS = (Encoding.XOR.value, Encoding.ADD.value, Encoding.OVERWRITE.value)


def pack_jobs(packs: list, rd: SectionReader, targets, shapes, seen: dict) -> list[tuple[ItemJob, tuple]]:
    """Check every pack's declaration, names and shapes against the receiver (each tensor once in the
    frame, not also in an item); (decode job over the pack space, (names, offsets)) per pack."""
    import torch

    if not packs:
        return []
    decl = []
    for idx, pk in enumerate(packs):
        what = f"pack {idx}"
        if not isinstance(pk, dict):
            raise MalformedHeaderError(f"{what} must be a map")
        dt_name, k, enc = need(pk, "dt", str, what), need(pk, "k", int, what), need(pk, "e", str, what)
        n = need(pk, "n", int, what)
        lm, lw, ls, le = (need(pk, "lm", str, what), need(pk, "lw", int, what), need(pk, "ls", int, what),
                          need(pk, "le", int, what))
        if enc not in _PACK_ENCODINGS:
            raise UnknownEncodingError(f"{what}: encoding {enc!r} is not one packs use: {_PACK_ENCODINGS}")
        if lm not in locations.MODES:  # pack positions are flat: no class order across tensors
            raise UnknownEncodingError(f"{what}: location mode {lm!r} is not one packs use: {locations.MODES}")
        if k < 1 or n < 0 or lw not in locations.WIDTHS or ls < 0 or le < 0:
            raise MalformedHeaderError(f"{what}: bad declaration (k={k}, n={n}, locations {lm}/{lw}/{ls}/{le})")
        decl.append((what, dtype_of(dt_name), dt_name, k, Encoding(enc), n, lm, lw, ls, le))
    try:
        text = bytes(rd.rest(PACK_NAMES_SECTION)).decode("utf-8")
    except UnicodeDecodeError as e:
        raise MalformedHeaderError(f"pack names are not UTF-8: {e}") from None
    names = text.split("\n")
    total = sum(d[3] for d in decl)
    if names[-1] != "" or len(names) != total + 1:
        raise MalformedHeaderError(f"packs declare {total} tensors; their names section holds {len(names) - 1} "
                                   f"newline-ended names")
    names.pop()
    if len(set(names)) != total or not seen.keys().isdisjoint(names):
        raise DuplicateIndexError("a tensor appears twice in one frame's packs, or in a pack and an item")
    raw_dims = rd.rest(PACK_SHAPES_SECTION)
    if len(raw_dims) % 8:
        raise MalformedHeaderError(f"the packs' shapes section has {len(raw_dims)} bytes, not whole uint64s")
    dims = np.frombuffer(raw_dims, "<u8")
    if targets is None and shapes is None:  # no receiver to check against: the frame's own shapes
        shapes = _frame_shapes(names, dims, [(d[3], d[2]) for d in decl])
    jobs, a = [], 0
    expect: list[int] = []
    for what, dtype, dt_name, k, enc, n, lm, lw, ls, le in decl:
        part = names[a:a + k]
        a += k
        sizes = _receiver_sizes(what, part, dtype, targets, shapes, expect)
        if sum(sizes) > locations.MAX_SPAN:
            raise SizeLimitError(f"{what} spans {sum(sizes)} elements, more than the {locations.MAX_SPAN} one "
                                 f"location stream addresses")
        offsets = pack_offsets(sizes)
        loc = locations.EncodedLocations(lm, lw, ls, bytes(rd.take(PACK_LOC_SECTION, ls * lw, what)),
                                         bytes(rd.take(PACK_ESC_SECTION, le * 8, what)))
        w = itemsize(dtype)
        pl = [np.frombuffer(rd.take(PACK_PREFIX + value_section(enc, w, j), n, what), np.uint8) for j in range(w)]
        job = ItemJob(what=what, name=what, encoding=enc, lo=0, hi=int(offsets[-1]), count=n, locations=loc,
                      planes=pl, value_dtype=np.dtype(np_uint(w)), is_bool=dtype == torch.bool, wire_dtype=dt_name)
        jobs.append((job, (part, offsets)))
    if len(dims) != len(expect) or not np.array_equal(dims, np.asarray(expect, np.uint64)):
        raise TargetMismatchError("a pack's tensor shapes differ from the receiver's tensors of those names")
    return jobs


def _frame_shapes(names: list[str], dims: np.ndarray, packs: list[tuple[int, str]]) -> dict:
    """name -> (wire dtype, shape) as the packs' shapes section declares them (``packs``: (k, dtype) each)."""
    out, i, a = {}, 0, 0
    for k, dt in packs:
        for name in names[a:a + k]:
            if i >= len(dims) or dims[i] > 8 or i + 1 + int(dims[i]) > len(dims):
                raise MalformedHeaderError("the packs' shapes section ends early or declares over 8 dimensions")
            if any(d > locations.MAX_SPAN for d in dims[i + 1:i + 1 + int(dims[i])]):
                raise SizeLimitError(f"pack tensor {name!r} declares a dimension over {locations.MAX_SPAN}")
            out[name] = (dt, tuple(int(x) for x in dims[i + 1:i + 1 + int(dims[i])]))
            i += 1 + int(dims[i])
        a += k
    return out


def _receiver_sizes(what: str, names: list[str], dtype, targets, shapes, expect: list[int]) -> list[int]:
    """Elements of each named tensor as the receiver holds it (which must have ``dtype``); appends each
    tensor's (ndim, *shape) to ``expect`` (what the pack's shapes section must say)."""
    sizes = []
    for name in names:
        have_dt, sh = receiver_holds(what, name, targets, shapes)  # pack_jobs always gives shapes or targets
        if have_dt != dtype:
            raise TargetMismatchError(f"{what} ({name}): payload has {dtype}, receiver holds {have_dt}")
        expect.append(len(sh))
        expect.extend(sh)
        sizes.append(math.prod(sh))
    return sizes
