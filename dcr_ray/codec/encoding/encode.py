"""Writing frames: changed sets in, signed frames (see :mod:`~dcr_ray.codec.format`) out.

:class:`FrameBuilder` turns the chunks of changed sets into the items of one frame, gathering each
item's location symbols and value byte planes into the frame's sections; :meth:`FrameBuilder.finish`
compresses every section on its own (zstd, or raw when zstd does not make it smaller), writes the
header and signs. :func:`encode_frames` cuts a stream of changed sets into frames of bounded raw size.

First attempts (``mode="mixed"``) write each sparse chunk relative to the receiver's bits. With
``coding="context"`` the builder picks, per item, XOR masks or ADD differences
(:mod:`~dcr_ray.codec.primitives.intdiff`) and flat or class-order positions
(:mod:`~dcr_ray.codec.primitives.classorder`, when the diff computed them), whichever has the smaller zero-order
estimate (:mod:`~dcr_ray.codec.primitives.estimate`); ``coding="plain"`` writes XOR masks at flat positions, byte for
byte the frames of earlier releases. Retries (``mode="overwrite"``) always write absolute bits at flat
positions: after a partial apply the receiver's bits are no longer the base that relative codings and
class order refer to.
"""

from __future__ import annotations

import dataclasses
import itertools
import struct
import threading
from typing import Iterable, Mapping

import msgpack
import numpy as np
import zstandard

from dcr_ray.codec.bits import dtype_of, itemsize
from dcr_ray.codec.compiled import threads
from dcr_ray.codec.encoding.diff import ChunkDelta, TensorDelta
from dcr_ray.codec.encoding.packdiff import PackDelta
from dcr_ray.codec.primitives import estimate, intdiff, locations, planes
from dcr_ray.codec.format import (
    ESC_SECTION,
    FORMAT_VERSION,
    LOC_SECTION,
    MAGIC,
    MAX_HEADER_BYTES,
    PACK_ESC_SECTION,
    PACK_LOC_SECTION,
    PACK_NAMES_SECTION,
    PACK_PREFIX,
    PACK_SHAPES_SECTION,
    Encoding,
    FrameMeta,
    digest,
    value_section,
)

DEFAULT_ZSTD_LEVEL = 1
#: How first attempts code their sparse chunks: ``"context"`` picks XOR or ADD values and flat or
#: class-order positions per item; ``"plain"`` writes XOR masks at flat positions (earlier releases).
#: This module's default stays ``"plain"`` (byte-compatible frames for any receiver: a loader-capture
#: path on a tensor-parallel rank cannot read the old bits class order needs); owners use
#: ``CodecConfig.coding``, ``"context"`` by default.
CODINGS = ("context", "plain")
DEFAULT_CODING = "plain"
#: zstd hash table size (log2) for every section. Location symbols and mask/value byte planes are close
#: to memoryless: long matches are rare and short ones cost more bits than the literals they replace, so
#: a small table (64 entries, zstd's minimum) that finds fewer of them gives smaller sections in less
#: time than zstd's level default (``dcr-ray bench codec`` compares both in its zstd sweep; results in
#: BENCHMARKS.md). ``None`` keeps zstd's default. The output is ordinary zstd (any decoder reads it);
#: only the encoder's choices change.
ZSTD_HASH_LOG: int | None = 6
#: Frames with at least this many raw section bytes compress their sections in parallel.
PARALLEL_MIN_RAW_BYTES = 256 << 10
#: A frame is also closed once its header may reach this size, so no number of small tensors builds a
#: header receivers refuse (they accept up to ``MAX_HEADER_BYTES``, four times more).
HEADER_BUDGET_BYTES = MAX_HEADER_BYTES // 4


def item_header_bound(td: TensorDelta) -> int:
    """An upper bound on the msgpack bytes of one item of ``td`` in a frame header: eleven short keys,
    at most nine bytes per integer, the name and the shape."""
    return 160 + len(td.name.encode()) + 9 * len(td.shape)

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


class FrameBuilder:
    """Accumulates chunk deltas as items of one frame; :meth:`finish` returns the frame bytes.

    ``mode="mixed"`` writes sparse chunks relative to the receiver's bits where the tensor allows it
    (``xor_ok``: the path copies bits unchanged) and as absolute new bits otherwise; ``mode="overwrite"``
    writes absolute bits at flat positions everywhere (retries). Dense chunks are always absolute.
    ``coding`` says how relative chunks are written (see :meth:`_first_attempt`): ``"context"`` or
    ``"plain"`` (XOR masks at flat positions, the frames of earlier releases; :data:`DEFAULT_CODING`).
    """

    def __init__(self, meta: FrameMeta, *, mode: str = "mixed", zstd_level: int = DEFAULT_ZSTD_LEVEL,
                 key: bytes | None = None, coding: str = DEFAULT_CODING):
        if mode not in ("mixed", "overwrite"):
            raise ValueError(f"mode must be 'mixed' or 'overwrite', got {mode!r}")
        if coding not in CODINGS:
            raise ValueError(f"coding must be one of {CODINGS}, got {coding!r}")
        self.meta = meta
        self.mode = mode
        self.coding = coding
        self.key = key
        self.zstd_level = zstd_level
        self.items: list[dict] = []
        self.packs: list[dict] = []
        self._sections: dict[str, list[bytes | np.ndarray]] = {LOC_SECTION: [], ESC_SECTION: []}
        self.raw_bytes = 0
        self.header_bytes = 256  # bound on the header's fixed fields, grown per item
        self.changed = 0

    def __len__(self) -> int:
        return len(self.items) + len(self.packs)

    def add(self, td: TensorDelta, chunk: ChunkDelta, *, xor_ok: bool = True) -> None:
        """Add one chunk of ``td`` as an item."""
        w = itemsize(dtype_of(td.dtype))
        if chunk.is_dense:
            enc, loc, split = Encoding.DENSE, None, planes.split(chunk.dense)
        elif self.mode == "mixed" and xor_ok:
            enc, loc, split = self._first_attempt(td, chunk)
        else:  # retries: absolute bits at flat positions, whatever the receiver holds by then
            enc, loc, split = Encoding.OVERWRITE, chunk.loc, planes.split(chunk.new)
        item = {"t": td.name, "dt": td.dtype, "sh": list(td.shape), "lo": chunk.lo, "hi": chunk.hi,
                "n": chunk.count, "e": enc}
        if loc is not None:
            item.update(lm=loc.mode, lw=loc.width, ls=loc.nsym, le=loc.nesc)
            self._sections[LOC_SECTION].append(loc.prim)
            self._sections[ESC_SECTION].append(loc.esc)
            self.raw_bytes += loc.nbytes
        for j, plane in enumerate(split):
            self._sections.setdefault(value_section(enc, w, j), []).append(plane)
        self.raw_bytes += chunk.count * w
        self.changed += chunk.count
        self.header_bytes += item_header_bound(td)
        self.items.append(item)

    def add_pack(self, pd: PackDelta) -> None:
        """Add a pack of whole small tensors (:mod:`~dcr_ray.codec.encoding.packdiff`) as one header entry.

        First attempts write XOR masks (``coding="context"``: XOR or ADD, whichever is estimated
        smaller); retries the new bits. Positions are always flat in pack space."""
        w = itemsize(dtype_of(pd.dtype))
        if self.mode == "mixed":
            enc, split = Encoding.XOR, planes.split(pd.xor)
            if self.coding == "context" and pd.dtype != "bool":
                add_planes = planes.split(intdiff.zigzag(intdiff.difference(pd.new, pd.xor)))
                if estimate.planes_bytes(add_planes) < estimate.planes_bytes(split):
                    enc, split = Encoding.ADD, add_planes
        else:
            enc, split = Encoding.OVERWRITE, planes.split(pd.new)
        loc = locations.encode(pd.positions, 0)
        names = "".join(n + "\n" for n in pd.names).encode()
        shapes = np.fromiter(itertools.chain.from_iterable((len(s), *s) for s in pd.shapes), "<u8").tobytes()
        self.packs.append({"dt": pd.dtype, "k": len(pd.names), "e": enc, "n": pd.changed, "lm": loc.mode,
                           "lw": loc.width, "ls": loc.nsym, "le": loc.nesc})
        for name, part in ((PACK_NAMES_SECTION, names), (PACK_SHAPES_SECTION, shapes),
                           (PACK_LOC_SECTION, loc.prim), (PACK_ESC_SECTION, loc.esc)):
            self._sections.setdefault(name, []).append(part)
        for j, plane in enumerate(split):
            self._sections.setdefault(PACK_PREFIX + value_section(enc, w, j), []).append(plane)
        self.raw_bytes += len(names) + len(shapes) + loc.nbytes + pd.changed * w
        self.changed += pd.changed
        self.header_bytes += 160

    def _first_attempt(self, td: TensorDelta, chunk: ChunkDelta):
        """(encoding, locations, value planes) of a sparse chunk on a first attempt.

        ``coding="plain"``: XOR masks at flat positions (the only coding before ADD and the class modes).
        ``coding="context"``: XOR masks or zigzagged differences, and flat or class-order positions (when
        the chunk carries them), each pair chosen by the smaller estimated compressed size
        (:mod:`~dcr_ray.codec.primitives.estimate`).
        """
        xor_planes = planes.split(chunk.xor)
        if self.coding == "plain":
            return Encoding.XOR, chunk.loc, xor_planes
        loc = chunk.loc
        if chunk.ctx is not None and (estimate.entropy_bytes(chunk.ctx.prim, chunk.ctx.esc)
                                      < estimate.entropy_bytes(loc.prim, loc.esc)):
            loc = chunk.ctx
        if td.dtype == "bool":  # bool values must stay 0/1: XOR only
            return Encoding.XOR, loc, xor_planes
        add_planes = planes.split(intdiff.zigzag(intdiff.difference(chunk.new, chunk.xor)))
        if estimate.planes_bytes(add_planes) < estimate.planes_bytes(xor_planes):
            return Encoding.ADD, loc, add_planes
        return Encoding.XOR, loc, xor_planes

    def finish(self) -> bytes:
        """Compress the sections, sign, and return the complete frame."""
        named = []
        for name, parts in self._sections.items():
            raw = b"".join(parts)  # planes are contiguous uint8 arrays: joined without a copy each
            if raw:
                named.append((name, raw))
        level = self.zstd_level
        if level == 0:  # stored raw (no compression)
            comps = [r for _, r in named]
        elif sum(len(r) for _, r in named) >= PARALLEL_MIN_RAW_BYTES:
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
        fields = {"fmt": FORMAT_VERSION, "transfer": m.transfer, "attempt": m.attempt, "producer": m.producer,
                  "payload": m.payload, "base": m.base, "target": m.target}
        if m.base_id:  # absent when empty: frames without a content id stay byte-identical to older ones
            fields["base_id"] = m.base_id
        fields.update(sections=sec_meta, items=self.items)
        if self.packs:  # absent when empty: frames without packs stay byte-identical to older ones
            fields["packs"] = self.packs
        header = msgpack.packb(fields, use_bin_type=True)
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
    header_bytes: int = HEADER_BUDGET_BYTES,
    coding: str = DEFAULT_CODING,
) -> Iterable[bytes]:
    """Yield frames (payload ids from ``meta.payload`` on) holding every chunk of ``deltas`` (changed
    sets of tensors, and :class:`~dcr_ray.codec.encoding.packdiff.PackDelta` packs, each kept whole in one frame;
    ``xor_ok`` applies to tensors only: a pack holds no overwrite-only tensor).

    A frame is closed once its raw (pre-compression) size reaches ``bucket_bytes`` or its header may
    reach ``header_bytes`` (many small tensors); a chunk is never split across frames, so choose
    ``chunk_elems * itemsize <= bucket_bytes``.
    """
    pid = meta.payload
    fb = None
    for td in deltas:
        for ch in ([td] if isinstance(td, PackDelta) else td.chunks):
            if fb is None:
                fb = FrameBuilder(dataclasses.replace(meta, payload=pid), mode=mode, zstd_level=zstd_level,
                                  key=key, coding=coding)
            if ch is td:
                fb.add_pack(td)
            else:
                fb.add(td, ch, xor_ok=True if xor_ok is None else xor_ok.get(td.name, True))
            if fb.raw_bytes >= bucket_bytes or fb.header_bytes >= header_bytes:
                yield fb.finish()
                pid += 1
                fb = None
    if fb is not None and len(fb):
        yield fb.finish()
