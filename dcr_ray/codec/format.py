"""The payload frame's wire format: its layout, names, limits and signature.

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
        e  str  "xor" | "add" | "ow" | "dense"           lo,hi int flat range [lo, hi)
        n  int  changed elements (hi - lo for dense)
        lm str  location mode ("gaps" | "runs" | "cgaps" | "cruns"), lw int width, ls int symbols,
                le int escapes (sparse items only)

    packs     list  optional (absent when empty): one map per pack of whole small tensors of one
                    dtype laid end to end in a flat *pack space* (:mod:`~dcr_ray.codec.packed`):
        dt str  wire dtype     k int  tensors     e str  "xor" | "add" | "ow"     n int  changes
        lm, lw, ls, le         locations of the changes in pack space, as for items

Value codings of sparse items: ``xor`` (masks ``new ^ old``), ``add`` (``new - old`` modulo the word
size, zigzagged: :mod:`~dcr_ray.codec.primitives.intdiff`) and ``ow`` (absolute new bits, every retry). A first
attempt picks ``xor`` or ``add`` per item, whichever byte planes are estimated smaller. Location modes
``gaps``/``runs`` code flat positions (:mod:`~dcr_ray.codec.primitives.locations`); ``cgaps``/``cruns`` code the
changed elements' ranks in the order of the old values' exponents (:mod:`~dcr_ray.codec.primitives.classorder`),
float dtypes only. ``add`` and the class modes came after the first frames were written: a frame
without them reads exactly as before, and a receiver that predates them refuses them (unknown
encoding or location mode) instead of misreading them.

Sections: ``loc`` (location symbols of every sparse item, in item order), ``esc`` (uint64 escapes),
and one section per (encoding, element width, byte plane), e.g. ``xor2.0`` / ``xor2.1`` hold the low
and high bytes of all BF16/FP16 XOR masks. Item offsets are implicit (items in order), and every
section's raw length must equal exactly what the items declare. Packs read their own sections, in pack
order: ``pnames`` (each tensor's name, UTF-8, ending in a newline), ``pshape`` (uint64 per tensor: the
number of dimensions, then the dimensions), ``ploc``/``pesc`` (locations) and ``p``-prefixed value
planes (``pxor2.0``, ...). A frame without packs is byte for byte what earlier releases wrote.

Writing is :mod:`~dcr_ray.codec.encoding.encode`; reading is :mod:`~dcr_ray.codec.decoding.header` (prefix, digest,
header) and :mod:`~dcr_ray.codec.decoding.decode` (everything else); :mod:`~dcr_ray.codec.decoding.apply` writes.
Wire dtype names are :data:`dcr_ray.codec.bits.WIRE_NAMES`; location coding is
:mod:`~dcr_ray.codec.primitives.locations`, byte planes :mod:`~dcr_ray.codec.primitives.planes`.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass
from typing import NamedTuple

MAGIC = b"DCRF"
FORMAT_VERSION = 1
DIGEST_SIZE = 16
#: magic, format version, header length: the bytes before the msgpack header.
PREFIX = struct.Struct("<4sBI")
#: How a section's body is stored.
SECTION_CODECS = ("zstd", "raw")
#: The largest bucket (raw bytes of one frame's items) senders may use: ``CodecConfig.bucket_bytes``
#: and ``encode_frames``' default stay at or below it.
MAX_BUCKET_BYTES = 64 << 20
#: Default bound on the decompressed size of one frame. A frame closes once its raw size reaches its
#: bucket, so it holds under two buckets; receivers refuse to inflate more than this (a small hostile
#: frame cannot make them allocate or spend time beyond it).
DEFAULT_MAX_RAW_BYTES = 2 * MAX_BUCKET_BYTES
MAX_HEADER_BYTES = 16 << 20
#: Section of every sparse item's location symbols, and of their uint64 escapes.
LOC_SECTION = "loc"
ESC_SECTION = "esc"
#: Sections of packs: names, shapes, locations, escapes; value planes are ``PACK_PREFIX + value_section``.
PACK_NAMES_SECTION = "pnames"
PACK_SHAPES_SECTION = "pshape"
PACK_LOC_SECTION = "ploc"
PACK_ESC_SECTION = "pesc"
PACK_PREFIX = "p"


class _WireStr(str, enum.Enum):
    """A str enum whose members are their wire strings: equal to them, hashed like them, packed by msgpack
    as them, and printed as them (``enum.StrEnum`` does the same from Python 3.11 on)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Encoding(_WireStr):
    """How an item carries its values (the header's ``e``); members are their wire strings."""

    XOR = "xor"  #: sparse: ``new ^ old`` at the item's positions (the receiver holds ``old``)
    OVERWRITE = "ow"  #: sparse: the new bits at the item's positions
    DENSE = "dense"  #: every element of ``[lo, hi)``: its new bits, no positions
    #: sparse: ``new - old`` modulo the word size, zigzagged (:mod:`~dcr_ray.codec.primitives.intdiff`); not for bool
    ADD = "add"


class LocationMode(_WireStr):
    """How a sparse item's positions are coded (the header's ``lm``; see :mod:`~dcr_ray.codec.primitives.locations`)."""

    GAPS = "gaps"  #: one gap symbol per position
    RUNS = "runs"  #: (gap, length - 1) per run of contiguous positions
    #: gaps of the changed elements' ranks in the class order of the old bits
    #: (:mod:`~dcr_ray.codec.primitives.classorder`)
    CLASS_GAPS = "cgaps"
    CLASS_RUNS = "cruns"  #: runs of those ranks


def value_section(encoding: Encoding, width: int, plane: int) -> str:
    """Name of the section holding byte ``plane`` of the ``width``-byte values of ``encoding`` items."""
    return f"{encoding.value}{width}.{plane}"


def digest(data: bytes | memoryview, key: bytes | None) -> bytes:
    """BLAKE2b-128 of ``data``, keyed with ``key`` when given."""
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE, key=key or b"").digest()


#: Base version carried by bootstrap frames (dense frames of a whole committed version): accepted by a
#: receiver that is being bootstrapped, whatever it held.
BOOTSTRAP_BASE = -1


class PayloadKey(NamedTuple):
    """The deduplication key of a payload: a receiver applies each key at most once."""

    transfer: str
    attempt: int
    producer: str
    payload: int


@dataclass(kw_only=True, slots=True)
class FrameMeta:
    """Identity of a frame (what the header says besides its items and sections)."""

    transfer: str
    attempt: int
    producer: str
    payload: int
    base: int
    target: int
    base_id: str = ""
    """Identity of the base content: the transfer that produced committed version ``base`` (the commit
    record's ``transfer``). A receiver that knows which content it holds refuses a frame built on other
    content with the same version number. Empty on bootstrap frames (absolute bits, any base) and in
    frames written before the field existed (receivers that require an id refuse those)."""

    @property
    def key(self) -> PayloadKey:
        """This frame's deduplication key."""
        return PayloadKey(self.transfer, self.attempt, self.producer, self.payload)
