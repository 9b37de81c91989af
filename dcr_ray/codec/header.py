"""Opening a frame: the prefix, the digest, then the msgpack header, in that order.

:func:`open_frame` checks the magic, the format version and the declared header size, verifies the
digest (with the receiver's key) over the whole frame, and only then parses the header: no byte of an
unsigned or corrupted frame reaches the msgpack parser. The parser itself is strict (no extension
types or binary fields, bounded strings, arrays and maps), and the frame's identity fields must have
their types. What the header's sections and items say is checked by :mod:`~dcr_ray.codec.decode`.

:func:`peek_meta` reads the identity of a frame without the digest check: for routing and logging,
never for trust.
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

    Made by :func:`open_frame` (digest verified); :func:`~dcr_ray.codec.decode.decode_frame` validates
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
    return _open(memoryview(data).cast("B"), key, verify=True)


def peek_meta(data: bytes | memoryview) -> FrameMeta:
    """Parse only the identity of a frame (no digest check): for routing and logging, never trust."""
    return _open(memoryview(data), None, verify=False).meta


def _open(data: memoryview, key: bytes | None, verify: bool) -> FrameHeader:
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
            data[PREFIX.size:hend], raw=False, strict_map_key=True, ext_hook=_reject_ext,
            max_bin_len=0, max_ext_len=0, max_str_len=1 << 16, max_array_len=1 << 22, max_map_len=64,
        )
    except MalformedHeaderError:
        raise
    except Exception as e:  # msgpack raises several unrelated exception types
        raise MalformedHeaderError(f"header is not valid msgpack: {e}") from None
    if not isinstance(h, dict):
        raise MalformedHeaderError("header must be a msgpack map")
    if need(h, "fmt", int) != FORMAT_VERSION:
        raise UnsupportedVersionError(f"header format version {h['fmt']} != {FORMAT_VERSION}")
    meta = FrameMeta(
        transfer=need(h, "transfer", str), attempt=need(h, "attempt", int),
        producer=need(h, "producer", str), payload=need(h, "payload", int),
        base=need(h, "base", int), target=need(h, "target", int),
        base_id=need(h, "base_id", str) if "base_id" in h else "",
    )
    return FrameHeader(meta=meta, fields=h, body_offset=hend, data=data)
