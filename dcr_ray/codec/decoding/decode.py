"""Reading frames: an opened frame in, a fully validated :class:`DecodedFrame` out, nothing written.

:func:`read_frame` validates *everything* (magic, version, digest/key, msgpack without extension
types, schema, sizes before and after decompression, location bounds, dtype/shape/range of each item
against the receiver's tensors, bool values) and only returns a decoded frame; the separate
:func:`~dcr_ray.codec.decoding.apply.apply_decoded` performs the writes. A frame that fails raises a
``FrameError`` subclass before anything is written.

:func:`read_frame` is :func:`~dcr_ray.codec.decoding.header.open_frame` (prefix, digest, header) followed by
:func:`decode_frame` (sections, items, positions, values); a caller that has already opened a frame
calls :func:`decode_frame` on it and the header is parsed once. The decoded types are
:mod:`~dcr_ray.codec.decoding.decoded`'s; each item is checked and its bytes taken in order
(:mod:`~dcr_ray.codec.decoding.sections`, :mod:`~dcr_ray.codec.decoding.packread`), then decoded on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import numpy as np
import zstandard

from dcr_ray.codec.bits import dtype_of, itemsize, np_uint
from dcr_ray.codec.compiled import threads
from dcr_ray.codec.primitives import classorder, intdiff, locations, planes
from dcr_ray.codec.format import (
    DEFAULT_MAX_RAW_BYTES,
    ESC_SECTION,
    LOC_SECTION,
    PREFIX,
    SECTION_CODECS,
    Encoding,
    value_section,
)
from dcr_ray.codec.decoding.decoded import DecodedFrame, DecodedItem, DecodedPack
from dcr_ray.codec.decoding.header import FrameHeader, need, open_frame
from dcr_ray.codec.decoding.packread import pack_jobs
from dcr_ray.codec.decoding.sections import ItemJob, SectionReader, receiver_holds
from dcr_ray.errors import (
    BaseVersionMismatchError,
    DuplicateIndexError,
    IndexOutOfRangeError,
    InvalidValueError,
    MalformedHeaderError,
    SizeLimitError,
    TargetMismatchError,
    TruncatedFrameError,
    UnknownEncodingError,
)

if TYPE_CHECKING:  # annotations only: torch is imported where it runs
    import torch

#: Frames with at least this many raw section bytes decompress their sections in parallel.
PARALLEL_MIN_RAW_BYTES = 256 << 10
#: Frames declaring at least this many changed elements decode their items on several threads.
DECODE_PARALLEL_MIN = 1 << 16
_ENCODINGS = tuple(e.value for e in Encoding)


def read_frame(
    data: bytes | memoryview,
    targets: Mapping[str, torch.Tensor] | None = None,
    *,
    key: bytes | None = None,
    expect_base: int | None = None,
    max_raw_bytes: int = DEFAULT_MAX_RAW_BYTES,
    shapes: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
    expect_base_id: str | None = None,
    keep_packs: bool = False,
) -> DecodedFrame:
    """Validate and decode a frame. Writes nothing.

    ``targets`` (name -> tensor) or ``shapes`` (name -> (wire dtype, shape)) describe what the
    receiver holds; each item must name one of them with the same dtype and shape. ``expect_base``
    is the version the receiver holds and ``expect_base_id`` the identity of that content (the commit
    record's transfer, :attr:`FrameMeta.base_id`); a frame built on another base is rejected.
    ``max_raw_bytes`` bounds decompression (check it before inflating anything); keep it near the
    sender's bucket size. ``keep_packs``: see :func:`decode_frame`.
    """
    return decode_frame(open_frame(data, key=key), targets=targets, shapes=shapes, expect_base=expect_base,
                        max_raw_bytes=max_raw_bytes, expect_base_id=expect_base_id, keep_packs=keep_packs)


def decode_frame(
    header: FrameHeader,
    *,
    targets: Mapping[str, torch.Tensor] | None = None,
    shapes: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
    expect_base: int | None = None,
    max_raw_bytes: int = DEFAULT_MAX_RAW_BYTES,
    expect_base_id: str | None = None,
    keep_packs: bool = False,
) -> DecodedFrame:
    """Validate and decode the sections and items of a frame opened by
    :func:`~dcr_ray.codec.decoding.header.open_frame`.

    Writes nothing; the arguments are those of :func:`read_frame`. Packs of small tensors come back as
    :class:`~dcr_ray.codec.decoding.decoded.DecodedPack` s in ``frame.packs`` with ``keep_packs=True`` (for
    receivers that write through :func:`~dcr_ray.codec.decoding.apply.apply_decoded`), else as per-tensor items.
    """
    meta, h = header.meta, header.fields
    if expect_base is not None and meta.base != expect_base:
        raise BaseVersionMismatchError(
            f"payload {meta.producer}/{meta.payload} was built on version {meta.base} but this receiver "
            f"holds version {expect_base}; it must be rebuilt from the receiver's version (or the receiver "
            f"re-bootstrapped)"
        )
    if expect_base_id is not None and meta.base_id != expect_base_id:
        raise BaseVersionMismatchError(
            f"payload {meta.producer}/{meta.payload} was built on version {meta.base} of content "
            f"{meta.base_id or '(unnamed)'!r} but this receiver holds version {expect_base} of content "
            f"{expect_base_id!r}: a frame of another update with the same version number; it must be "
            f"rebuilt from the receiver's content (or the receiver re-bootstrapped)"
        )
    sections = need(h, "sections", list)
    items = need(h, "items", list)
    packs = need(h, "packs", list) if "packs" in h else []
    sec, raw_total = _sections(header, sections, max_raw_bytes)
    rd = SectionReader(sec)
    jobs, seen = _item_jobs(items, rd, targets, shapes)
    pack_work = pack_jobs(packs, rd, targets, shapes, seen)
    rd.check_used()
    frame = DecodedFrame(meta=meta, wire_bytes=len(header.data), raw_bytes=raw_total)
    for job, (names, offsets) in pack_work:
        it = _decode_item(job)
        pk = DecodedPack(it.encoding, names, offsets, it.positions, it.values)
        if keep_packs:
            frame.packs.append(pk)
        else:
            frame.items.extend(pk.items())
    # positions and values: every item checked on its own, by the codec threads if large
    n_threads = threads.codec_threads()
    if n_threads > 1 and len(jobs) > 1 and sum(j.count for j in jobs) >= DECODE_PARALLEL_MIN:
        shares = threads.balance(range(len(jobs)), lambda i: jobs[i].count, n_threads)
        decoded: list = [None] * len(jobs)

        def run(share):
            for i in share:
                decoded[i] = _decode_item(jobs[i])

        threads.run_all([lambda s=s: run(s) for s in shares])
        frame.items.extend(decoded)
    else:
        frame.items.extend(_decode_item(j) for j in jobs)
    return frame


def _decompress(name: str, comp: memoryview, raw: int) -> bytes:
    """Decompress one section of declared size ``raw`` (never more), as the format's errors."""
    try:
        out = zstandard.ZstdDecompressor().decompress(comp, max_output_size=raw)
    except zstandard.ZstdError as e:
        raise MalformedHeaderError(f"section {name!r} does not decompress: {e}") from None
    if len(out) != raw:
        raise SizeLimitError(f"section {name!r} decompressed to {len(out)} bytes, declared {raw}")
    return out


def _sections(header: FrameHeader, sections: list, max_raw_bytes: int) -> tuple[dict[str, memoryview], int]:
    """({name: raw bytes}, total raw bytes) of the section table: sizes first, then bounded decompression."""
    data, off, body_end = header.data, header.body_offset, header.body_end
    raw_total = 0
    spans = []
    for s in sections:
        if not (isinstance(s, list) and len(s) == 4 and isinstance(s[0], str) and isinstance(s[1], str)
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s[2:])):
            raise MalformedHeaderError(f"section entry {s!r} must be [name, codec, raw_len, comp_len]")
        name, codec, raw, comp = s
        if codec not in SECTION_CODECS:
            raise UnknownEncodingError(f"section {name!r} uses unknown codec {codec!r}; known: {SECTION_CODECS}")
        if codec == "raw" and raw != comp:
            raise MalformedHeaderError(f"raw section {name!r} declares {raw} != {comp} bytes")
        raw_total += raw
        if raw_total > max_raw_bytes:
            raise SizeLimitError(
                f"sections declare {raw_total} decompressed bytes, more than the {max_raw_bytes} allowed "
                f"(raise max_raw_bytes if your bucket is larger)"
            )
        spans.append((name, codec, raw, off, off + comp))
        off += comp
    if off != body_end:
        if off > body_end:
            raise TruncatedFrameError(f"sections declare {off - PREFIX.size} bytes past the header; frame ends earlier")
        raise MalformedHeaderError(f"{body_end - off} trailing bytes after the last section")
    sec: dict[str, memoryview] = {}
    todo = []  # (name, compressed view, raw length) of zstd sections, checked before any decompression
    for name, codec, raw, a, b in spans:
        if name in sec:
            raise MalformedHeaderError(f"section {name!r} appears twice")
        if codec == "raw":
            sec[name] = data[a:b]
            continue
        try:
            params = zstandard.get_frame_parameters(data[a:b])
        except zstandard.ZstdError as e:
            raise MalformedHeaderError(f"section {name!r} is not a zstd frame: {e}") from None
        if params.content_size != raw:
            raise SizeLimitError(f"section {name!r} decompresses to {params.content_size} bytes, declared {raw}")
        sec[name] = memoryview(b"")  # placeholder: keeps the duplicate check in section order
        todo.append((name, data[a:b], raw))
    if raw_total >= PARALLEL_MIN_RAW_BYTES and len(todo) > 1:
        outs = threads.run_all([lambda t=t: _decompress(*t) for t in todo])
    else:
        outs = [_decompress(*t) for t in todo]
    for (name, _, _), out in zip(todo, outs):
        sec[name] = memoryview(out)
    return sec, raw_total


def _item_jobs(items: list, rd: SectionReader, targets, shapes) -> tuple[list[ItemJob], dict]:
    """Check every item's header fields against the receiver and take its bytes from the sections;
    also the ranges each tensor's items cover (name -> [(lo, hi)])."""
    import torch

    take = rd.take
    seen: dict[str, list[tuple[int, int]]] = {}
    jobs = []
    for idx, it in enumerate(items):
        what = f"item {idx}"
        if not isinstance(it, dict):
            raise MalformedHeaderError(f"{what} must be a map")
        name = need(it, "t", str, what)
        what = f"item {idx} ({name})"
        dt_name = need(it, "dt", str, what)
        shape = need(it, "sh", list, what)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape):
            raise MalformedHeaderError(f"{what}: shape {shape!r} must be a list of non-negative integers")
        enc = need(it, "e", str, what)
        if enc not in _ENCODINGS:
            raise UnknownEncodingError(f"{what}: unknown encoding {enc!r}; known: {_ENCODINGS}")
        enc = Encoding(enc)
        lo, hi, n = need(it, "lo", int, what), need(it, "hi", int, what), need(it, "n", int, what)
        dtype = dtype_of(dt_name)
        have_dt, have_shape = receiver_holds(what, name, targets, shapes) or (dtype, tuple(shape))
        if have_dt != dtype or have_shape != tuple(shape):
            raise TargetMismatchError(
                f"{what}: payload has {dt_name}{list(shape)}, receiver holds {have_dt}{list(have_shape)}"
            )
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not (0 <= lo < hi <= numel):
            raise IndexOutOfRangeError(f"{what}: range [{lo}, {hi}) is outside the tensor's {numel} elements")
        for a, b in seen.get(name, ()):
            if lo < b and a < hi:
                raise DuplicateIndexError(f"{what}: range [{lo}, {hi}) overlaps [{a}, {b}) of the same tensor")
        seen.setdefault(name, []).append((lo, hi))
        w = itemsize(dtype)
        if enc is Encoding.DENSE:
            if n != hi - lo:
                raise MalformedHeaderError(f"{what}: dense item must declare n == hi - lo")
            loc = None
        else:
            # the mode stays the wire string here: locations.decode checks it with the positions
            mode, width, nsym = need(it, "lm", str, what), need(it, "lw", int, what), need(it, "ls", int, what)
            le = need(it, "le", int, what)
            if width not in locations.WIDTHS or nsym < 0 or le < 0:
                raise MalformedHeaderError(f"{what}: bad location declaration")
            loc = locations.EncodedLocations(
                mode, width, nsym, bytes(take(LOC_SECTION, nsym * width, what)), bytes(take(ESC_SECTION, le * 8, what)),
            )
        pl = [np.frombuffer(take(value_section(enc, w, j), n, what), np.uint8) for j in range(w)]
        jobs.append(ItemJob(what=what, name=name, encoding=enc, lo=lo, hi=hi, count=n, locations=loc, planes=pl,
                            value_dtype=np.dtype(np_uint(w)), is_bool=dtype == torch.bool, wire_dtype=dt_name))
    return jobs, seen


def _decode_item(job: ItemJob) -> DecodedItem:
    """Positions (bounds-checked) and values of one item whose header has been validated."""
    loc, n, lo, hi = job.locations, job.count, job.lo, job.hi
    ranks = None
    if loc is not None and loc.mode in classorder.MODES:  # positions resolved against the old bits at apply
        pos, ranks = None, classorder.decode_ranks(loc, job.wire_dtype, lo, hi, n)
    else:
        pos = None if loc is None else locations.decode(loc, lo, hi, n)
    values = planes.join(job.planes, job.value_dtype) if n else np.empty(0, job.value_dtype)
    if job.encoding is Encoding.ADD:
        if job.is_bool:
            raise InvalidValueError(f"{job.what}: bool tensors take no ADD items (XOR or overwrite them)")
        values = intdiff.unzigzag(values)
    if job.is_bool and len(values) and int(values.max()) > 1:
        raise InvalidValueError(f"{job.what}: bool values (and bool XOR masks) must be 0 or 1")
    return DecodedItem(job.name, job.encoding, lo, hi, pos, values, ranks)
