"""Opening a frame: the prefix, the digest, then the msgpack header, in that order.

:func:`open_frame` checks the magic, the format version and the declared header size, verifies the
digest (with the receiver's key) over the whole frame, and only then parses the header: no byte of an
unsigned or corrupted frame reaches the msgpack parser. The parser itself is strict (no extension
types or binary fields, bounded strings, arrays and maps), and the frame's identity fields must have
their types. What the header's sections and items say is checked by :mod:`~dcr_ray.codec.decoding.decode`.

:func:`peek_meta` reads the identity of a frame without the digest check: for routing and logging,
never for trust. It skips the header's other fields unparsed (msgpack's streaming ``skip``), so an
unverified header makes it allocate no more than the identity fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from dcr_ray.codec.format import (
    DIGEST_SIZE,
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_BYTES,
    PREFIX,
    FrameMeta,
    digest,
)
from dcr_ray.errors import (
    BadMagicError,
    DigestMismatchError,
    MalformedHeaderError,
    SizeLimitError,
    TruncatedFrameError,
    UnsupportedVersionError,
)


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """An opened frame: its identity and parsed header, and where its body starts in ``data``.

    Made by :func:`open_frame` (digest verified); :func:`~dcr_ray.codec.decoding.decode.decode_frame` validates
    the rest and decodes it.
    """

    meta: FrameMeta
    fields: dict  #: the msgpack header map (``sections`` and ``items`` not yet validated)
    body_offset: int  #: offset in ``data`` of the first section's bytes
    data: memoryview  #: the whole frame, as bytes

    @property
    def body_end(self) -> int:
        """Offset in ``data`` just past the last section (where the digest starts)."""
        return len(self.data) - DIGEST_SIZE


def need(d: dict, key: str, typ, what: str = "header"):
    """``d[key]``, which must exist and have type ``typ`` (an ``int`` is never a bool); else
    :class:`MalformedHeaderError` naming ``what``."""
    if key not in d:
        raise MalformedHeaderError(f"{what} lacks field {key!r}")
    v = d[key]
    if typ is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise MalformedHeaderError(f"{what} field {key!r} must be an integer, got {type(v).__name__}")
    if typ is not int and not isinstance(v, typ):
        raise MalformedHeaderError(f"{what} field {key!r} must be {typ.__name__}, got {type(v).__name__}")
    return v


def _reject_ext(code, data):
    raise MalformedHeaderError(f"msgpack extension type {code} is not allowed in a dcr_ray header")


def open_frame(data: bytes | memoryview, *, key: bytes | None) -> FrameHeader:
    """Check the prefix and the digest (keyed with ``key``; ``None`` for unkeyed frames), then parse
    the header. Raises a ``FrameError`` subclass; reads nothing past the header besides the digest."""
    return _open(memoryview(data).cast("B"), key)


def peek_meta(data: bytes | memoryview) -> FrameMeta:
    """Parse only the identity of a frame (no digest check): for routing and logging, never trust."""
    data = memoryview(data).cast("B")
    hend = _prefix(data)
    u = msgpack.Unpacker(raw=False, strict_map_key=True, ext_hook=_reject_ext, max_bin_len=0, max_ext_len=0,
                         max_str_len=1 << 16, max_array_len=1 << 22, max_map_len=64)
    u.feed(data[PREFIX.size:hend])
    h: dict = {}
    try:
        for _ in range(u.read_map_header()):
            k = u.unpack()
            if k in _IDENTITY:
                h[k] = u.unpack()
            else:
                u.skip()  # items, sections: walked, never built
    except MalformedHeaderError:
        raise
    except Exception as e:  # msgpack raises several unrelated exception types
        raise MalformedHeaderError(f"header is not a valid msgpack map: {e}") from None
    return _meta(h)


#: The header fields :class:`FrameMeta` is read from.
_IDENTITY = frozenset({"fmt", "transfer", "attempt", "producer", "payload", "base", "target", "base_id"})


def _prefix(data: memoryview) -> int:
    """Check magic, format version and the declared header size; the offset where the header ends."""
    if len(data) < PREFIX.size + DIGEST_SIZE:
        raise TruncatedFrameError(f"frame of {len(data)} bytes is shorter than the minimum frame")
    magic, ver, hlen = PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise BadMagicError(f"frame starts with {bytes(magic)!r}, expected {MAGIC!r}: not a dcr_ray payload")
    if ver != FORMAT_VERSION:
        raise UnsupportedVersionError(f"frame format version {ver}; this dcr_ray reads version {FORMAT_VERSION}")
    if hlen > MAX_HEADER_BYTES:
        raise SizeLimitError(f"header declares {hlen} bytes, more than the {MAX_HEADER_BYTES} allowed")
    hend = PREFIX.size + hlen
    if hend + DIGEST_SIZE > len(data):
        raise TruncatedFrameError(f"header declares {hlen} bytes but the frame has only {len(data)}")
    return hend


def _meta(h: dict) -> FrameMeta:
    if need(h, "fmt", int) != FORMAT_VERSION:
        raise UnsupportedVersionError(f"header format version {h['fmt']} != {FORMAT_VERSION}")
    return FrameMeta(
        transfer=need(h, "transfer", str), attempt=need(h, "attempt", int),
        producer=need(h, "producer", str), payload=need(h, "payload", int),
        base=need(h, "base", int), target=need(h, "target", int),
        base_id=need(h, "base_id", str) if "base_id" in h else "",
    )


def _open(data: memoryview, key: bytes | None) -> FrameHeader:
    hend = _prefix(data)
    if digest(data[4:-DIGEST_SIZE], key) != bytes(data[-DIGEST_SIZE:]):
        raise DigestMismatchError(
            "frame digest does not match: the bytes were corrupted in transit or storage, or the "
            "frame was signed with a different key than this receiver's"
            + (" (this receiver uses a key)" if key else " (this receiver uses no key)")
        )
    try:
        h = msgpack.unpackb(
            data[PREFIX.size:hend], raw=False, strict_map_key=True, ext_hook=_reject_ext,
            max_bin_len=0, max_ext_len=0, max_str_len=1 << 16, max_array_len=1 << 22, max_map_len=64,
        )
    except MalformedHeaderError:
        raise
    except Exception as e:  # msgpack raises several unrelated exception types
        raise MalformedHeaderError(f"header is not valid msgpack: {e}") from None
    if not isinstance(h, dict):
        raise MalformedHeaderError("header must be a msgpack map")
    return FrameHeader(meta=_meta(h), fields=h, body_offset=hend, data=data)
