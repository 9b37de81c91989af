"""Payload frames: the wire format, its builder, and its validating reader.

Layout (all integers little-endian)::

    b"DCRF" | u8 format version | u32 header length | msgpack header | body | 16-byte BLAKE2b digest

The digest is BLAKE2b-128 over ``version byte .. end of body``, keyed with the transfer's shared
secret when one is configured, so a receiver can reject payloads (for example read back from object
storage) that its owners did not produce. The header is a msgpack map::

    fmt       int   format version (== FORMAT_VERSION)
    transfer  str   transfer id (one refit: same for all attempts)
    attempt   int   attempt number within the transfer
    producer  str   owner id
    payload   int   payload id, dense per (transfer, attempt, producer) from 0
    base      int   version the receiver must hold
    target    int   version the receiver holds once the transfer commits
    sections  list  [[name, codec, raw_len, comp_len], ...] in body order; codec "zstd" or "raw"
    items     list  one map per (tensor, element range):
        t  str  canonical (Hugging Face) tensor name     dt str wire dtype   sh list shape
        e  str  "xor" | "ow" | "dense"                   lo,hi int flat range [lo, hi)
        n  int  changed elements (hi - lo for dense)
        lm str  location mode, lw int width, ls int symbols, le int escapes (sparse items only)

Sections: ``loc`` (location symbols of every sparse item, in item order), ``esc`` (uint64 escapes),
and one section per (encoding, element width, byte plane), e.g. ``xor2.0`` / ``xor2.1`` hold the low
and high bytes of all BF16/FP16 XOR masks. Item offsets are implicit (items in order), and every
section's raw length must equal exactly what the items declare.

Reading (:func:`read_frame`) validates *everything* (magic, version, digest/key, msgpack without
extension types, schema, sizes before and after decompression, location bounds, dtype/shape/range of
each item against the receiver's tensors, bool values) and only returns a decoded frame; the
separate :func:`apply_decoded` performs the writes. A frame that fails raises a ``FrameError``
subclass before anything is written.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import msgpack
import numpy as np
import torch
import zstandard

from dcr_ray.codec import kernels, locations, planes, threads
from dcr_ray.codec.bits import bits_view, dtype_of, itemsize
from dcr_ray.codec.diff import ChunkDelta, TensorDelta
from dcr_ray.errors import (
    BadMagicError,
    BaseVersionMismatchError,
    DigestMismatchError,
    DuplicateIndexError,
    IndexOutOfRangeError,
    InvalidValueError,
    MalformedHeaderError,
    SizeLimitError,
    TargetMismatchError,
    TruncatedFrameError,
    UnknownEncodingError,
    UnsupportedVersionError,
)

MAGIC = b"DCRF"
FORMAT_VERSION = 1
DIGEST_SIZE = 16
_PREFIX = struct.Struct("<4sBI")
ENCODINGS = ("xor", "ow", "dense")
SECTION_CODECS = ("zstd", "raw")
#: Default bound on the decompressed size of one frame (and on its header): 1 GiB / 16 MiB.
DEFAULT_MAX_RAW_BYTES = 1 << 30
MAX_HEADER_BYTES = 16 << 20
DEFAULT_ZSTD_LEVEL = 1
#: zstd hash table size (log2) for every section. Location symbols and mask/value byte planes are close
#: to memoryless: long matches are rare and short ones cost more bits than the literals they replace.
#: A 64-entry table (zstd's minimum) finds fewer such matches: on the codec benchmark's sections (real
#: AdamW updates, 1-5% stress, dense chunks) it gives 1-2% smaller sections and 40-60% less compression
#: time than zstd's level-1 default (2**14), for every data kind tried. ``None`` keeps zstd's default.
#: The output is ordinary zstd (any decoder reads it); only the encoder's choices change.
ZSTD_HASH_LOG: int | None = 6
#: Frames with at least this many raw section bytes compress (and decompress) their sections in parallel.
PARALLEL_MIN_RAW_BYTES = 256 << 10

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level`` (contexts are reused; one-shot output does not depend on it)."""
    cache = _local.__dict__.setdefault("cctx", {})
    key = (level, ZSTD_HASH_LOG)
    c = cache.get(key)
    if c is None:
        if ZSTD_HASH_LOG is None:
            c = zstandard.ZstdCompressor(level=level, write_content_size=True)
        else:
            params = zstandard.ZstdCompressionParameters.from_level(
                level, hash_log=ZSTD_HASH_LOG, write_content_size=True)
            c = zstandard.ZstdCompressor(compression_params=params)
        cache[key] = c
    return c


def digest(data: bytes | memoryview, key: bytes | None) -> bytes:
    """BLAKE2b-128 of ``data``, keyed with ``key`` when given."""
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE, key=key or b"").digest()


@dataclass(kw_only=True, slots=True)
class FrameMeta:
    """Identity of a frame (what the header says besides its items and sections)."""

    transfer: str
    attempt: int
    producer: str
    payload: int
    base: int
    target: int


# ---------------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------------
class FrameBuilder:
    """Accumulates chunk deltas as items of one frame; :meth:`finish` returns the frame bytes.

    ``mode="mixed"`` writes sparse chunks as XOR masks where the tensor allows it (``xor_ok``) and as
    absolute new bits otherwise; ``mode="overwrite"`` writes absolute bits everywhere (retries).
    Dense chunks are always absolute.
    """

    def __init__(self, meta: FrameMeta, *, mode: str = "mixed", zstd_level: int = DEFAULT_ZSTD_LEVEL,
                 key: bytes | None = None):
        if mode not in ("mixed", "overwrite"):
            raise ValueError(f"mode must be 'mixed' or 'overwrite', got {mode!r}")
        self.meta = meta
        self.mode = mode
        self.key = key
        self.zstd_level = zstd_level
        self.items: list[dict] = []
        self._sections: dict[str, list[bytes | np.ndarray]] = {"loc": [], "esc": []}
        self.raw_bytes = 0
        self.changed = 0

    def __len__(self) -> int:
        return len(self.items)

    def add(self, td: TensorDelta, chunk: ChunkDelta, *, xor_ok: bool = True) -> None:
        """Add one chunk of ``td`` as an item."""
        w = itemsize(dtype_of(td.dtype))
        item = {"t": td.name, "dt": td.dtype, "sh": list(td.shape), "lo": chunk.lo, "hi": chunk.hi,
                "n": chunk.count}
        if chunk.is_dense:
            item["e"] = "dense"
            values = chunk.dense
        else:
            enc = "xor" if (self.mode == "mixed" and xor_ok) else "ow"
            item["e"] = enc
            values = chunk.xor if enc == "xor" else chunk.new
            loc = chunk.loc
            item.update(lm=loc.mode, lw=loc.width, ls=loc.nsym, le=loc.nesc)
            self._sections["loc"].append(loc.prim)
            self._sections["esc"].append(loc.esc)
            self.raw_bytes += loc.nbytes
        for j, plane in enumerate(planes.split(values)):
            self._sections.setdefault(f"{item['e']}{w}.{j}", []).append(plane)
        self.raw_bytes += values.nbytes
        self.changed += chunk.count
        self.items.append(item)

    def finish(self) -> bytes:
        """Compress the sections, sign, and return the complete frame."""
        named = []
        for name, parts in self._sections.items():
            raw = b"".join(parts)  # planes are contiguous uint8 arrays: joined without a copy each
            if raw:
                named.append((name, raw))
        level = self.zstd_level
        if sum(len(r) for _, r in named) >= PARALLEL_MIN_RAW_BYTES:
            # sections compress independently (one zstd frame each): same bytes, in parallel
            comps = threads.run_all([lambda r=r: _compressor(level).compress(r) for _, r in named])
        else:
            comps = [_compressor(level).compress(r) for _, r in named]
        sec_meta, bodies = [], []
        for (name, raw), comp in zip(named, comps):
            if len(comp) < len(raw):
                sec_meta.append([name, "zstd", len(raw), len(comp)])
                bodies.append(comp)
            else:
                sec_meta.append([name, "raw", len(raw), len(raw)])
                bodies.append(raw)
        m = self.meta
        header = msgpack.packb(
            {"fmt": FORMAT_VERSION, "transfer": m.transfer, "attempt": m.attempt, "producer": m.producer,
             "payload": m.payload, "base": m.base, "target": m.target, "sections": sec_meta,
             "items": self.items},
            use_bin_type=True,
        )
        signed = b"".join([bytes([FORMAT_VERSION]), struct.pack("<I", len(header)), header, *bodies])
        return MAGIC + signed + digest(signed, self.key)


def encode_frames(
    deltas: Iterable[TensorDelta],
    meta: FrameMeta,
    *,
    mode: str = "mixed",
    bucket_bytes: int = 64 << 20,
    zstd_level: int = DEFAULT_ZSTD_LEVEL,
    key: bytes | None = None,
    xor_ok: Mapping[str, bool] | None = None,
) -> Iterable[bytes]:
    """Yield frames (payload ids from ``meta.payload`` on) holding every chunk of ``deltas``.

    A frame is closed once its raw (pre-compression) size reaches ``bucket_bytes``; a chunk is never
    split across frames, so choose ``chunk_elems * itemsize <= bucket_bytes``.
    """
    pid = meta.payload
    fb = None
    for td in deltas:
        for ch in td.chunks:
            if fb is None:
                fb = FrameBuilder(FrameMeta(**{**_asdict(meta), "payload": pid}), mode=mode,
                                  zstd_level=zstd_level, key=key)
            fb.add(td, ch, xor_ok=True if xor_ok is None else xor_ok.get(td.name, True))
            if fb.raw_bytes >= bucket_bytes:
                yield fb.finish()
                pid += 1
                fb = None
    if fb is not None and len(fb):
        yield fb.finish()


def _asdict(meta: FrameMeta) -> dict:
    return {k: getattr(meta, k) for k in FrameMeta.__slots__}


# ---------------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class DecodedItem:
    """One validated item: where to write (``positions`` or the dense range) and what."""

    name: str
    encoding: str
    lo: int
    hi: int
    positions: np.ndarray | None  # None for dense
    values: np.ndarray  # unsigned ints of the tensor's element size


@dataclass(slots=True)
class DecodedFrame:
    """A frame that passed every check; :func:`apply_decoded` writes it."""

    meta: FrameMeta
    items: list[DecodedItem] = field(default_factory=list)
    wire_bytes: int = 0
    raw_bytes: int = 0

    @property
    def changed(self) -> int:
        return sum(len(i.values) for i in self.items)

    @property
    def key(self) -> tuple[str, int, str, int]:
        """Deduplication key ``(transfer, attempt, producer, payload)``."""
        m = self.meta
        return (m.transfer, m.attempt, m.producer, m.payload)


def _decompress(name: str, comp: memoryview, raw: int) -> bytes:
    """Decompress one section of declared size ``raw`` (never more), as the format's errors."""
    try:
        out = zstandard.ZstdDecompressor().decompress(comp, max_output_size=raw)
    except zstandard.ZstdError as e:
        raise MalformedHeaderError(f"section {name!r} does not decompress: {e}") from None
    if len(out) != raw:
        raise SizeLimitError(f"section {name!r} decompressed to {len(out)} bytes, declared {raw}")
    return out


def _reject_ext(code, data):
    raise MalformedHeaderError(f"msgpack extension type {code} is not allowed in a dcr_ray header")


def _need(d: dict, key: str, typ, what: str = "header"):
    if key not in d:
        raise MalformedHeaderError(f"{what} lacks field {key!r}")
    v = d[key]
    if typ is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise MalformedHeaderError(f"{what} field {key!r} must be an integer, got {type(v).__name__}")
    if typ is not int and not isinstance(v, typ):
        raise MalformedHeaderError(f"{what} field {key!r} must be {typ.__name__}, got {type(v).__name__}")
    return v


def peek_meta(data: bytes | memoryview) -> FrameMeta:
    """Parse only the identity of a frame (no digest check): for routing and logging, never trust."""
    return _parse(memoryview(data), key=None, verify=False)[0]


def _parse(data: memoryview, key: bytes | None, verify: bool, max_raw_bytes: int = DEFAULT_MAX_RAW_BYTES):
    if len(data) < _PREFIX.size + DIGEST_SIZE:
        raise TruncatedFrameError(f"frame of {len(data)} bytes is shorter than the minimum frame")
    magic, ver, hlen = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise BadMagicError(f"frame starts with {bytes(magic)!r}, expected {MAGIC!r}: not a dcr_ray payload")
    if ver != FORMAT_VERSION:
        raise UnsupportedVersionError(f"frame format version {ver}; this dcr_ray reads version {FORMAT_VERSION}")
    if hlen > MAX_HEADER_BYTES:
        raise SizeLimitError(f"header declares {hlen} bytes, more than the {MAX_HEADER_BYTES} allowed")
    hend = _PREFIX.size + hlen
    if hend + DIGEST_SIZE > len(data):
        raise TruncatedFrameError(f"header declares {hlen} bytes but the frame has only {len(data)}")
    if verify:
        signed = data[4:-DIGEST_SIZE]
        if digest(signed, key) != bytes(data[-DIGEST_SIZE:]):
            raise DigestMismatchError(
                "frame digest does not match: the bytes were corrupted in transit or storage, or the "
                "frame was signed with a different key than this receiver's"
                + (" (this receiver uses a key)" if key else " (this receiver uses no key)")
            )
    try:
        h = msgpack.unpackb(
            data[_PREFIX.size:hend], raw=False, strict_map_key=True, ext_hook=_reject_ext,
            max_bin_len=0, max_ext_len=0, max_str_len=1 << 16, max_array_len=1 << 22, max_map_len=64,
        )
    except MalformedHeaderError:
        raise
    except Exception as e:  # msgpack raises several unrelated exception types
        raise MalformedHeaderError(f"header is not valid msgpack: {e}") from None
    if not isinstance(h, dict):
        raise MalformedHeaderError("header must be a msgpack map")
    if _need(h, "fmt", int) != FORMAT_VERSION:
        raise UnsupportedVersionError(f"header format version {h['fmt']} != {FORMAT_VERSION}")
    meta = FrameMeta(
        transfer=_need(h, "transfer", str), attempt=_need(h, "attempt", int),
        producer=_need(h, "producer", str), payload=_need(h, "payload", int),
        base=_need(h, "base", int), target=_need(h, "target", int),
    )
    return meta, h, hend


def read_frame(
    data: bytes | memoryview,
    targets: Mapping[str, torch.Tensor] | None = None,
    *,
    key: bytes | None = None,
    expect_base: int | None = None,
    max_raw_bytes: int = DEFAULT_MAX_RAW_BYTES,
    shapes: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
) -> DecodedFrame:
    """Validate and decode a frame. Writes nothing.

    ``targets`` (name -> tensor) or ``shapes`` (name -> (wire dtype, shape)) describe what the
    receiver holds; each item must name one of them with the same dtype and shape. ``expect_base``
    is the version the receiver holds; a frame built on another base is rejected.
    """
    data = memoryview(data).cast("B")
    meta, h, off = _parse(data, key, verify=True, max_raw_bytes=max_raw_bytes)
    if expect_base is not None and meta.base != expect_base:
        raise BaseVersionMismatchError(
            f"payload {meta.producer}/{meta.payload} was built on version {meta.base} but this receiver "
            f"holds version {expect_base}; it must be rebuilt from the receiver's version (or the receiver "
            f"re-bootstrapped)"
        )
    sections = _need(h, "sections", list)
    items = _need(h, "items", list)
    body_end = len(data) - DIGEST_SIZE
    # --- sections: sizes first, then bounded decompression ---------------------------------------
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
            raise TruncatedFrameError(f"sections declare {off - _PREFIX.size} bytes past the header; frame ends earlier")
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
    # --- items -------------------------------------------------------------------------------------
    cursor = {name: 0 for name in sec}
    seen: dict[str, list[tuple[int, int]]] = {}
    frame = DecodedFrame(meta=meta, wire_bytes=len(data), raw_bytes=raw_total)

    def take(section: str, nbytes: int, what: str) -> memoryview:
        if nbytes == 0:
            return memoryview(b"")
        if section not in sec:
            raise MalformedHeaderError(f"{what} needs section {section!r}, which the frame lacks")
        a = cursor[section]
        if a + nbytes > len(sec[section]):
            raise MalformedHeaderError(f"{what} reads past the end of section {section!r}")
        cursor[section] = a + nbytes
        return sec[section][a:a + nbytes]

    jobs = []
    for idx, it in enumerate(items):
        what = f"item {idx}"
        if not isinstance(it, dict):
            raise MalformedHeaderError(f"{what} must be a map")
        name = _need(it, "t", str, what)
        what = f"item {idx} ({name})"
        dt_name = _need(it, "dt", str, what)
        shape = _need(it, "sh", list, what)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape):
            raise MalformedHeaderError(f"{what}: shape {shape!r} must be a list of non-negative integers")
        enc = _need(it, "e", str, what)
        if enc not in ENCODINGS:
            raise UnknownEncodingError(f"{what}: unknown encoding {enc!r}; known: {ENCODINGS}")
        lo, hi, n = _need(it, "lo", int, what), _need(it, "hi", int, what), _need(it, "n", int, what)
        dtype = dtype_of(dt_name)
        if targets is not None:
            t = targets.get(name)
            if t is None:
                raise TargetMismatchError(f"{what}: the receiver has no tensor named {name!r}")
            have_dt, have_shape = t.dtype, tuple(t.shape)
        elif shapes is not None:
            if name not in shapes:
                raise TargetMismatchError(f"{what}: the receiver has no tensor named {name!r}")
            have_dt, have_shape = dtype_of(shapes[name][0]), tuple(shapes[name][1])
        else:
            have_dt, have_shape = dtype, tuple(shape)
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
        npdt = np.dtype({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[w])
        if enc == "dense":
            if n != hi - lo:
                raise MalformedHeaderError(f"{what}: dense item must declare n == hi - lo")
            loc = None
        else:
            loc = locations.EncodedLocations(
                _need(it, "lm", str, what), _need(it, "lw", int, what), _need(it, "ls", int, what),
                b"", b"",
            )
            le = _need(it, "le", int, what)
            if loc.width not in locations.WIDTHS or loc.nsym < 0 or le < 0:
                raise MalformedHeaderError(f"{what}: bad location declaration")
            loc = locations.EncodedLocations(
                loc.mode, loc.width, loc.nsym,
                bytes(take("loc", loc.nsym * loc.width, what)), bytes(take("esc", le * 8, what)),
            )
        pl = [np.frombuffer(take(f"{enc}{w}.{j}", n, what), np.uint8) for j in range(w)]
        jobs.append((what, name, enc, lo, hi, n, loc, pl, npdt, dtype == torch.bool))
    for name, used in cursor.items():
        if used != len(sec[name]):
            raise MalformedHeaderError(f"section {name!r} has {len(sec[name]) - used} bytes no item reads")
    # --- positions and values: every item checked on its own, by the codec threads if large --------
    n_threads = threads.codec_threads()
    if n_threads > 1 and len(jobs) > 1 and sum(j[5] for j in jobs) >= DECODE_PARALLEL_MIN:
        shares = _balance(range(len(jobs)), lambda i: jobs[i][5], n_threads)
        decoded: list = [None] * len(jobs)

        def run(share):
            for i in share:
                decoded[i] = _decode_item(*jobs[i])

        threads.run_all([lambda s=s: run(s) for s in shares])
        frame.items.extend(decoded)
    else:
        frame.items.extend(_decode_item(*j) for j in jobs)
    return frame


def _balance(things, size, n: int) -> list[list]:
    """Deal ``things`` out to at most ``n`` shares, largest first to the least loaded share."""
    shares: list[list] = [[] for _ in range(n)]
    load = [0] * n
    for t in sorted(things, key=lambda t: -size(t)):
        k = load.index(min(load))
        shares[k].append(t)
        load[k] += size(t)
    return [s for s in shares if s]


#: Frames declaring at least this many changed elements decode their items on several threads.
DECODE_PARALLEL_MIN = 1 << 16


def _decode_item(what, name, enc, lo, hi, n, loc, pl, npdt, is_bool) -> DecodedItem:
    """Positions (bounds-checked) and values of one item whose header has been validated."""
    pos = None if loc is None else locations.decode(loc, lo, hi, n)
    values = planes.join(pl, npdt) if n else np.empty(0, npdt)
    if is_bool and len(values) and int(values.max()) > 1:
        raise InvalidValueError(f"{what}: bool values (and bool XOR masks) must be 0 or 1")
    return DecodedItem(name, enc, lo, hi, pos, values)


#: Frames with at least this many written elements are applied by several codec threads.
APPLY_PARALLEL_MIN = 1 << 16
#: XOR items are applied this many positions at a time, so each write-back hits the lines just read.
APPLY_BLOCK = 1 << 14


def _xor_into(view: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
    """``view[positions] ^= values`` (sorted, unique positions) with take/put in cache-sized runs."""
    if kernels.ENABLED:
        kernels.xor_into(view, positions, values)
        return
    for a in range(0, len(positions), APPLY_BLOCK):
        p = positions[a:a + APPLY_BLOCK]
        cur = np.take(view, p)
        cur ^= values[a:a + APPLY_BLOCK]
        np.put(view, p, cur)


def apply_decoded(frame: DecodedFrame, targets: Mapping[str, torch.Tensor]) -> int:
    """Write a validated frame into ``targets`` in place; returns the number of elements written."""
    # Resolve every target's bit view before the first write: a target that cannot be viewed
    # (non-contiguous, not on the CPU) must fail the frame with nothing written, not half-way through.
    views = {it.name: bits_view(targets[it.name]) for it in frame.items}

    def write(items) -> None:
        for it in items:
            view = views[it.name]
            if it.encoding == "dense":
                view[it.lo:it.hi] = it.values
            elif it.encoding == "xor":
                _xor_into(view, it.positions, it.values)
            elif kernels.ENABLED:
                kernels.put_into(view, it.positions, it.values)
            else:
                np.put(view, it.positions, it.values)

    # Items never overlap (read_frame refused overlapping ranges), so the codec threads may write
    # them concurrently: deal them out largest first to the least loaded thread.
    n_threads = threads.codec_threads()
    total = sum(len(it.values) for it in frame.items)
    if n_threads > 1 and len(frame.items) > 1 and total >= APPLY_PARALLEL_MIN:
        threads.run_all([lambda s=s: write(s)
                         for s in _balance(frame.items, lambda it: len(it.values), n_threads)])
    else:
        write(frame.items)
    return total


def apply_frame(data, targets: Mapping[str, torch.Tensor], *, key: bytes | None = None,
                expect_base: int | None = None, max_raw_bytes: int = DEFAULT_MAX_RAW_BYTES) -> DecodedFrame:
    """Validate ``data`` completely, then apply it to ``targets`` in place. Returns the decoded frame."""
    frame = read_frame(data, targets, key=key, expect_base=expect_base, max_raw_bytes=max_raw_bytes)
    apply_decoded(frame, targets)
    return frame
