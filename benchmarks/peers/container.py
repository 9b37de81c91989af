"""One step's message for the peers that send per-tensor streams: a 16-byte header per changed tensor (name
length, stream length, element count), the name, the stream.

It is what :func:`benchmarks.peers.encodings.wire_bytes` counts (``TENSOR_HEADER_BYTES`` + name + stream),
laid out so that a receiver can be run on a corrupted copy: :func:`unpack` yields the records in order and
raises ``ValueError`` where a header or a stream runs past the end, after the records before it.
"""

from __future__ import annotations

import struct
from typing import Iterator, Mapping

from benchmarks.peers.encodings import TENSOR_HEADER_BYTES

_HEADER = struct.Struct("<IIQ")
assert _HEADER.size == TENSOR_HEADER_BYTES


def pack(streams: Mapping[str, bytes], numels: Mapping[str, int]) -> bytes:
    """The message of ``streams`` (``name -> bytes``; tensors without a stream are not sent)."""
    parts = []
    for name, data in streams.items():
        raw = name.encode()
        parts += [_HEADER.pack(len(raw), len(data), numels[name]), raw, data]
    return b"".join(parts)


def unpack(message: bytes) -> Iterator[tuple[str, int, memoryview]]:
    """``(name, elements, stream)`` per record, in order; ``ValueError`` at the first record that is cut short."""
    view, at = memoryview(message), 0
    while at < len(view):
        if at + _HEADER.size > len(view):
            raise ValueError(f"message ends inside a record header at byte {at}")
        name_len, data_len, numel = _HEADER.unpack_from(view, at)
        at += _HEADER.size
        if at + name_len + data_len > len(view):
            raise ValueError(f"record at byte {at - _HEADER.size} declares {name_len + data_len} bytes, "
                             f"{len(view) - at} remain")
        name = bytes(view[at:at + name_len]).decode()
        at += name_len
        yield name, numel, view[at:at + data_len]
        at += data_len


def locate(message: bytes, offset: int) -> str:
    """Which part of the message byte ``offset`` falls in: a record's header, its name or its stream."""
    at = 0
    while at < len(message):
        name_len, data_len, _ = _HEADER.unpack_from(message, at)
        name = bytes(message[at + _HEADER.size:at + _HEADER.size + name_len]).decode()
        ends = (at + _HEADER.size, at + _HEADER.size + name_len, at + _HEADER.size + name_len + data_len)
        if offset < ends[2]:
            part = "header" if offset < ends[0] else "name" if offset < ends[1] else "stream"
            where = f" (stream byte {offset - ends[1]} of {data_len})" if part == "stream" else ""
            return f"{part} of {name}{where}"
        at = ends[2]
    return "past the end"
