"""Malformed frames: every one is rejected with its specific ``FrameError`` and writes nothing.

Most cases are crafted by editing a valid frame's header or sections and signing it again, so the
digest passes and the reader's later checks are what is exercised. The helpers below re-implement the
documented layout on their own (they do not call the codec's writer):

    b"DCRF" | u8 format version | u32 header length | msgpack header | body | BLAKE2b-128 over bytes[4:-16]

Each case snapshots the receiver's tensors and compares them afterwards through integer views.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import struct

import msgpack
import pytest
import torch
import zstandard
from hypothesis import event, given, settings
from hypothesis import strategies as st

from dcr_ray.codec import (
    FrameBuilder,
    FrameMeta,
    apply_frame,
    diff_tensor,
    encode_frames,
    full_delta,
    peek_meta,
    read_frame,
)
from dcr_ray.codec.bits import bits_view
from dcr_ray.codec.format import MAX_HEADER_BYTES
from dcr_ray.errors import (
    BadMagicError,
    BaseVersionMismatchError,
    DcrError,
    DigestMismatchError,
    DuplicateIndexError,
    FrameError,
    IndexOutOfRangeError,
    InvalidValueError,
    MalformedHeaderError,
    SizeLimitError,
    TargetMismatchError,
    TruncatedFrameError,
    UnknownEncodingError,
    UnsupportedVersionError,
)

KEY = b"transfer-secret"
BASE = 3
PREFIX = struct.Struct("<4sBI")
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

EMB, NORM, MASK = "model.embed.weight", "model.norm.weight", "model.mask"


# --- frame surgery --------------------------------------------------------------------------------
def sign(header: bytes, body: bytes, *, key: bytes | None = KEY, version: int = 1, magic: bytes = b"DCRF") -> bytes:
    signed = bytes([version]) + struct.pack("<I", len(header)) + header + body
    return magic + signed + hashlib.blake2b(signed, digest_size=16, key=key or b"").digest()


def pack(header: dict, body: bytes, **kw) -> bytes:
    """Sign ``header`` (as is, sections included) and ``body``."""
    return sign(msgpack.packb(header, use_bin_type=True), body, **kw)


def explode(frame: bytes) -> tuple[dict, dict[str, bytes]]:
    """(header, {section name: decompressed bytes}) of a frame, sections in body order."""
    _, _, hlen = PREFIX.unpack_from(frame, 0)
    header = msgpack.unpackb(frame[PREFIX.size:PREFIX.size + hlen], raw=False)
    off, secs = PREFIX.size + hlen, {}
    for name, codec, raw, comp in header["sections"]:
        body = frame[off:off + comp]
        off += comp
        secs[name] = zstandard.ZstdDecompressor().decompress(body) if codec == "zstd" else bytes(body)
    assert off == len(frame) - 16
    return header, secs


def assemble(header: dict, secs: dict[str, bytes], *, zstd: tuple[str, ...] = (), **kw) -> bytes:
    """A signed frame with ``header``'s items and ``secs`` as its sections (raw, or zstd for names in ``zstd``)."""
    header = copy.deepcopy(header)
    header["sections"], bodies = [], []
    for name, raw in secs.items():
        if name in zstd:
            comp = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
            header["sections"].append([name, "zstd", len(raw), len(comp)])
            bodies.append(comp)
        else:
            header["sections"].append([name, "raw", len(raw), len(raw)])
            bodies.append(raw)
    return pack(header, b"".join(bodies), **kw)


def loc_span(header: dict, idx: int) -> slice:
    """Where item ``idx``'s location symbols lie in the ``loc`` section."""
    off = 0
    for it in header["items"][:idx]:
        if it["e"] != "dense":
            off += it["ls"] * it["lw"]
    it = header["items"][idx]
    return slice(off, off + it["ls"] * it["lw"])


def set_bytes(data: bytes, where: slice, values: bytes) -> bytes:
    b = bytearray(data)
    b[where] = values
    return bytes(b)


# --- the receiver -----------------------------------------------------------------------------------
def ints(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def _bits(t):
    return bits_view(t).copy()


@functools.lru_cache(maxsize=None)
def scenario():
    """(old tensors, new tensors, one valid keyed frame from BASE to BASE + 1 holding all of them).

    Items, in order: embed [0,32) gaps, [32,64) gaps, [64,96) runs, [96,128) dense; norm [0,1000) gaps
    with one escape; mask [0,40) bool XOR. The malformed part of a case is usually in a late item, so a
    reader that wrote as it went would already have changed the earlier tensors.
    """
    g = torch.Generator().manual_seed(1234)
    old = {EMB: torch.randn(8, 16, generator=g).to(torch.bfloat16), NORM: torch.randn(1000, generator=g),
           MASK: torch.rand(40, generator=g) > 0.5}
    new = {k: v.clone() for k, v in old.items()}
    e = ints(new[EMB]).view(-1)
    e[[1, 5, 9, 33, 40]] ^= 3
    e[70:78] ^= 1
    e[96:128] ^= 1
    ints(new[NORM])[[0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 900]] ^= 0x100
    new[MASK][[3, 20, 21]] = ~new[MASK][[3, 20, 21]]
    deltas = [diff_tensor(EMB, _bits(old[EMB]), new[EMB], chunk_elems=32),
              diff_tensor(NORM, _bits(old[NORM]), new[NORM], chunk_elems=1000),
              diff_tensor(MASK, _bits(old[MASK]), new[MASK], chunk_elems=40)]
    (frame,) = encode_frames(deltas, meta(), key=KEY, coding="plain")  # the first format's codings
    return old, new, frame, deltas


def meta(**kw) -> FrameMeta:
    return FrameMeta(**{"transfer": "refit-9", "attempt": 0, "producer": "owner-0", "payload": 0, "base": BASE,
                        "target": BASE + 1, **kw})


def receiver():
    old = scenario()[0]
    return {k: v.clone() for k, v in old.items()}


def assert_untouched(targets: dict[str, torch.Tensor]) -> None:
    old = scenario()[0]
    for name, t in targets.items():
        assert torch.equal(ints(t), ints(old[name])), f"{name} was written by a rejected frame"


def rejects(frame, error: type[FrameError], targets=None, **kw) -> FrameError:
    """Apply ``frame`` to a fresh receiver, expect exactly ``error`` and no write; return the exception."""
    targets = receiver() if targets is None else targets
    kw = {"key": KEY, "expect_base": BASE, **kw}
    with pytest.raises(error) as info:
        apply_frame(frame, targets, **kw)
    assert isinstance(info.value, FrameError) and str(info.value)
    assert_untouched(targets)
    return info.value


# --- positive controls ------------------------------------------------------------------------------
def test_the_scenario_frame_applies_and_gives_the_new_bits():
    _, new, frame, _ = scenario()
    targets = receiver()
    apply_frame(frame, targets, key=KEY, expect_base=BASE)
    for name in new:
        assert torch.equal(ints(targets[name]), ints(new[name]))
    h, _ = explode(frame)
    assert [(it["t"], it["e"], it.get("lm"), it.get("le")) for it in h["items"]] == [
        (EMB, "xor", "gaps", 0), (EMB, "xor", "gaps", 0), (EMB, "xor", "runs", 0), (EMB, "dense", None, None),
        (NORM, "xor", "gaps", 1), (MASK, "xor", "gaps", 0)]


@pytest.mark.parametrize("zstd", [(), ("loc", "xor2.0", "dense2.1", "xor1.0")], ids=["raw", "some-zstd"])
def test_a_frame_rebuilt_by_the_test_helpers_is_still_accepted(zstd):
    """The surgery helpers produce valid frames, so each crafted case fails only for its own edit."""
    _, new, frame, _ = scenario()
    targets = receiver()
    apply_frame(assemble(*explode(frame), zstd=zstd), targets, key=KEY, expect_base=BASE)
    for name in new:
        assert torch.equal(ints(targets[name]), ints(new[name]))


# --- truncation, corruption, keys, versions -----------------------------------------------------------
def _cuts():
    frame = scenario()[2]
    hend = PREFIX.size + PREFIX.unpack_from(frame, 0)[2]
    return {"empty": 0, "inside-magic": 3, "inside-prefix": 7, "after-prefix": PREFIX.size,
            "inside-header": hend // 2, "end-of-header": hend, "header-plus-15": hend + 15,
            "inside-body": (hend + len(frame)) // 2, "inside-digest": len(frame) - 8, "last-byte": len(frame) - 1}


@pytest.mark.parametrize("where", list(_cuts()))
def test_a_truncated_frame_is_rejected_and_the_target_is_untouched(where):
    frame = scenario()[2]
    cut = _cuts()[where]
    hend = PREFIX.size + PREFIX.unpack_from(frame, 0)[2]
    # Before the header ends the reader knows the frame is short; after it, the bytes it reads as the
    # digest are really body bytes, so the (unforgeable) digest check is what catches the cut.
    rejects(frame[:cut], TruncatedFrameError if cut < hend + 16 else DigestMismatchError)


def test_a_re_signed_frame_whose_body_is_shorter_than_its_sections_declare_is_rejected_as_truncated():
    frame = scenario()[2]
    _, _, hlen = PREFIX.unpack_from(frame, 0)
    header, body = frame[PREFIX.size:PREFIX.size + hlen], frame[PREFIX.size + hlen:-16]
    rejects(sign(header, body[:-5]), TruncatedFrameError)


@pytest.mark.parametrize("region", ["header", "body", "digest"])
def test_a_flipped_byte_is_rejected_and_the_target_is_untouched(region):
    frame = scenario()[2]
    hend = PREFIX.size + PREFIX.unpack_from(frame, 0)[2]
    at = {"header": (PREFIX.size + hend) // 2, "body": (hend + len(frame) - 16) // 2, "digest": len(frame) - 3}[region]
    rejects(set_bytes(frame, slice(at, at + 1), bytes([frame[at] ^ 0x5A])), DigestMismatchError)


def test_every_single_bit_flip_anywhere_is_rejected_and_writes_nothing():
    frame = scenario()[2]
    expected = {0: BadMagicError, 1: BadMagicError, 2: BadMagicError, 3: BadMagicError, 4: UnsupportedVersionError}
    for at in range(len(frame)):
        bad = set_bytes(frame, slice(at, at + 1), bytes([frame[at] ^ (1 << (at % 8))]))
        err = rejects(bad, FrameError)
        # a flip in the header length gives a truncation or size error or a digest mismatch
        assert isinstance(err, expected.get(at, (DigestMismatchError, TruncatedFrameError, SizeLimitError)))


def test_a_frame_signed_with_another_key_is_rejected():
    rejects(scenario()[2], DigestMismatchError, key=b"another-secret")


def test_a_keyed_frame_is_rejected_by_a_receiver_without_a_key():
    rejects(scenario()[2], DigestMismatchError, key=None)


def test_an_unkeyed_frame_is_rejected_by_a_receiver_with_a_key():
    frame = assemble(*explode(scenario()[2]), key=None)
    apply_frame(frame, receiver(), key=None, expect_base=BASE)  # fine without a key
    rejects(frame, DigestMismatchError)


def test_a_frame_built_on_another_base_version_is_rejected():
    err = rejects(scenario()[2], BaseVersionMismatchError, expect_base=BASE + 1)
    assert str(BASE) in str(err) and str(BASE + 1) in str(err)


def test_a_frame_that_is_not_a_dcr_payload_is_rejected_by_its_magic():
    frame = scenario()[2]
    rejects(b"PK\x03\x04" + frame[4:], BadMagicError)
    with pytest.raises(BadMagicError):
        peek_meta(b"PK\x03\x04" + frame[4:])


def test_a_frame_of_another_format_version_is_rejected():
    h, secs = explode(scenario()[2])
    rejects(set_bytes(scenario()[2], slice(4, 5), b"\x02"), UnsupportedVersionError)
    rejects(assemble(h, secs, version=2), UnsupportedVersionError)
    rejects(assemble({**h, "fmt": 2}, secs), UnsupportedVersionError)


# --- crafted headers and sections -------------------------------------------------------------------
CASES: dict[str, tuple] = {}


def case(error: type[FrameError], group: str):
    def register(fn):
        CASES[fn.__name__] = (group, fn, error)
        return fn
    return register


# out-of-range indices
@case(IndexOutOfRangeError, "range")
def item_range_past_the_tensor_end(h, secs):
    h["items"][4]["hi"] = 1001


@case(IndexOutOfRangeError, "range")
def negative_item_start(h, secs):
    h["items"][5]["lo"] = -1


@case(IndexOutOfRangeError, "range")
def empty_item_range(h, secs):
    h["items"][5]["hi"] = 0


@case(IndexOutOfRangeError, "range")
def dense_item_past_the_tensor_end(h, secs):
    h["items"][3].update(lo=100, hi=132)


@case(IndexOutOfRangeError, "range")
def location_symbol_past_the_item_range(h, secs):
    s = loc_span(h, 5)
    secs["loc"] = set_bytes(secs["loc"], slice(s.start, s.start + 1), bytes([40]))


@case(IndexOutOfRangeError, "range")
def locations_adding_up_past_the_item_range(h, secs):
    secs["loc"] = set_bytes(secs["loc"], loc_span(h, 5), bytes([20, 20, 20]))


@case(IndexOutOfRangeError, "range")
def escaped_location_past_the_item_range(h, secs):
    secs["esc"] = (5000).to_bytes(8, "little")


@case(IndexOutOfRangeError, "range")
def run_past_the_item_range(h, secs):
    s = loc_span(h, 2)  # runs: [gap, length - 1] of the run at 70..77 in [64, 96)
    secs["loc"] = set_bytes(secs["loc"], slice(s.start, s.start + 1), bytes([30]))


# overlapping items of one tensor
@case(DuplicateIndexError, "overlap")
def item_range_overlapping_an_earlier_item(h, secs):
    h["items"][1]["lo"] = 16


@case(DuplicateIndexError, "overlap")
def same_item_twice(h, secs):
    h["items"].insert(1, copy.deepcopy(h["items"][0]))


# sizes
@case(SizeLimitError, "size")
def section_declaring_more_than_max_raw_bytes(h, secs):
    h["_zstd"] = ("xor2.0",)
    h["_raw_len"] = ("xor2.0", 1 << 40)


@case(SizeLimitError, "size")
def zstd_section_larger_than_declared(h, secs):
    h["_zstd"] = ("xor4.0",)
    h["_raw_len"] = ("xor4.0", len(secs["xor4.0"]) - 1)


@case(SizeLimitError, "size")
def zstd_section_smaller_than_declared(h, secs):
    h["_zstd"] = ("xor4.0",)
    h["_raw_len"] = ("xor4.0", len(secs["xor4.0"]) + 1)


# unknown encodings
@case(UnknownEncodingError, "encoding")
def unknown_item_encoding(h, secs):
    h["items"][5]["e"] = "delta"


@case(UnknownEncodingError, "encoding")
def unknown_section_codec(h, secs):
    h["_codec"] = ("xor1.0", "lz4")


@case(MalformedHeaderError, "encoding")
def unknown_location_mode(h, secs):
    h["items"][5]["lm"] = "rle"


@case(MalformedHeaderError, "encoding")
def unknown_location_width(h, secs):
    h["items"][5]["lw"] = 3


# msgpack: extension types and other non-schema values
@case(MalformedHeaderError, "msgpack")
def extension_type_in_the_header(h, secs):
    h["producer"] = msgpack.ExtType(5, b"owner")


@case(MalformedHeaderError, "msgpack")
def empty_extension_type_in_an_item(h, secs):
    h["items"][5]["t"] = msgpack.ExtType(1, b"")


@case(MalformedHeaderError, "msgpack")
def timestamp_extension_in_the_header(h, secs):
    h["transfer"] = msgpack.Timestamp(1, 0)


@case(MalformedHeaderError, "msgpack")
def binary_value_in_the_header(h, secs):
    h["transfer"] = b"refit-9"


@case(MalformedHeaderError, "msgpack")
def integer_map_key_in_an_item(h, secs):
    h["items"][5][7] = 1


@case(MalformedHeaderError, "msgpack")
def header_that_is_not_a_map(h, secs):
    h["_replace"] = [1, 2, 3]


@case(MalformedHeaderError, "msgpack")
def header_that_is_not_msgpack(h, secs):
    h["_raw_header"] = b"\xc1\xc1\xc1"


@case(MalformedHeaderError, "msgpack")
def header_with_a_missing_field(h, secs):
    del h["base"]


@case(MalformedHeaderError, "msgpack")
def string_where_an_integer_belongs(h, secs):
    h["attempt"] = "0"


@case(MalformedHeaderError, "msgpack")
def boolean_where_an_integer_belongs(h, secs):
    h["items"][5]["n"] = True


@case(MalformedHeaderError, "msgpack")
def item_that_is_not_a_map(h, secs):
    h["items"].append([MASK, "bool"])


@case(MalformedHeaderError, "msgpack")
def item_without_a_tensor_name(h, secs):
    del h["items"][5]["t"]


@case(MalformedHeaderError, "msgpack")
def negative_dimension_in_a_shape(h, secs):
    h["items"][5]["sh"] = [-40]


# structure of sections and items
@case(MalformedHeaderError, "structure")
def trailing_bytes_after_the_last_section(h, secs):
    h["_trailing"] = b"\x00\x00"


@case(MalformedHeaderError, "structure")
def section_that_appears_twice(h, secs):
    h["_duplicate_section"] = "xor1.0"


@case(MalformedHeaderError, "structure")
def section_bytes_that_no_item_reads(h, secs):
    secs["xor4.0"] += b"\x00"


@case(MalformedHeaderError, "structure")
def item_reading_past_the_end_of_a_section(h, secs):
    secs["xor1.0"] = secs["xor1.0"][:-1]


@case(MalformedHeaderError, "structure")
def item_needing_a_section_the_frame_lacks(h, secs):
    del secs["esc"]


@case(MalformedHeaderError, "structure")
def dense_item_whose_count_is_not_its_range(h, secs):
    h["items"][3]["n"] = 31


@case(MalformedHeaderError, "structure")
def more_location_symbols_than_changes(h, secs):
    h["items"][5]["n"] = 2


@case(MalformedHeaderError, "structure")
def negative_symbol_count(h, secs):
    h["items"][5]["ls"] = -1


@case(MalformedHeaderError, "structure")
def raw_section_whose_sizes_disagree(h, secs):
    h["_raw_len"] = ("xor1.0", len(secs["xor1.0"]) + 1)


@case(MalformedHeaderError, "structure")
def section_entry_with_three_fields(h, secs):
    h["_section_entry"] = ("loc", ["loc", "raw", len(secs["loc"])])


@case(MalformedHeaderError, "structure")
def zstd_section_that_is_not_zstd(h, secs):
    h["_codec"] = ("xor1.0", "zstd")


# the receiver's tensors
@case(TargetMismatchError, "target")
def tensor_the_receiver_does_not_have(h, secs):
    h["items"][5]["t"] = "model.lm_head.weight"


@case(TargetMismatchError, "target")
def dtype_the_receiver_does_not_hold(h, secs):
    h["items"][2]["dt"] = "float16"


@case(TargetMismatchError, "target")
def shape_the_receiver_does_not_hold(h, secs):
    for it in h["items"][:4]:
        it["sh"] = [16, 8]


@case(TargetMismatchError, "target")
def dtype_this_version_does_not_know(h, secs):
    h["items"][4]["dt"] = "float128"


# bool values
@case(InvalidValueError, "bool")
def bool_xor_mask_of_two(h, secs):
    secs["xor1.0"] = set_bytes(secs["xor1.0"], slice(-1, None), b"\x02")


@case(InvalidValueError, "bool")
def bool_xor_mask_of_255(h, secs):
    secs["xor1.0"] = set_bytes(secs["xor1.0"], slice(0, 1), b"\xff")


def build(name: str) -> bytes:
    """The scenario frame with case ``name``'s edit, signed again."""
    h, secs = explode(scenario()[2])
    _, fn, _ = CASES[name]
    fn(h, secs)
    zstd = h.pop("_zstd", ())
    special = {k: h.pop(k) for k in list(h) if k.startswith("_")}
    if not special:
        return assemble(h, secs, zstd=zstd)
    if "_raw_header" in special:
        body = b"".join(secs.values())
        h["sections"] = [[n, "raw", len(b), len(b)] for n, b in secs.items()]
        return sign(special["_raw_header"], body)
    if "_replace" in special:
        return pack(special["_replace"], b"".join(secs.values()))
    # edit the section table of an otherwise valid frame
    frame = assemble(h, secs, zstd=zstd)
    h2, _ = explode(frame)
    hlen = PREFIX.unpack_from(frame, 0)[2]
    body = frame[PREFIX.size + hlen:-16]
    sections = h2["sections"]
    if "_raw_len" in special:
        name_, raw = special["_raw_len"]
        next(s for s in sections if s[0] == name_)[2] = raw
    if "_codec" in special:
        name_, codec = special["_codec"]
        next(s for s in sections if s[0] == name_)[1] = codec
    if "_section_entry" in special:
        name_, entry = special["_section_entry"]
        sections[[s[0] for s in sections].index(name_)] = entry
    if "_duplicate_section" in special:
        name_ = special["_duplicate_section"]
        sections.append([name_, "raw", len(secs[name_]), len(secs[name_])])
        body += secs[name_]
    if "_trailing" in special:
        body += special["_trailing"]
    return pack(h2, body)


def _ids(group):
    return [n for n, (g, _, _) in CASES.items() if g == group]


def _check(name):
    _, _, error = CASES[name]
    rejects(build(name), error)


@pytest.mark.parametrize("name", _ids("range"))
def test_out_of_range_indices_are_rejected_and_the_target_is_untouched(name):
    _check(name)


@pytest.mark.parametrize("name", _ids("overlap"))
def test_overlapping_items_of_one_tensor_are_rejected_and_the_target_is_untouched(name):
    _check(name)


@pytest.mark.parametrize("name", _ids("size"))
def test_oversized_declared_sizes_are_rejected_and_the_target_is_untouched(name):
    _check(name)


@pytest.mark.parametrize("name", _ids("encoding"))
def test_unknown_encodings_are_rejected_and_the_target_is_untouched(name):
    _check(name)


@pytest.mark.parametrize("name", _ids("msgpack"))
def test_headers_with_extension_types_or_wrong_types_are_rejected_and_the_target_is_untouched(name):
    _check(name)


@pytest.mark.parametrize("name", _ids("structure"))
def test_inconsistent_sections_and_items_are_rejected_and_the_target_is_untouched(name):
    _check(name)


@pytest.mark.parametrize("name", _ids("target"))
def test_names_dtypes_and_shapes_the_receiver_does_not_have_are_rejected_and_the_target_is_untouched(name):
    _check(name)


@pytest.mark.parametrize("name", _ids("bool"))
def test_bool_values_other_than_zero_or_one_are_rejected_and_the_target_is_untouched(name):
    _check(name)


# --- cases that need their own frames --------------------------------------------------------------
def test_a_frame_larger_than_the_receivers_max_raw_bytes_is_rejected():
    rejects(scenario()[2], SizeLimitError, max_raw_bytes=100)


def test_a_header_length_beyond_the_limit_is_rejected_before_anything_is_parsed():
    frame = scenario()[2]
    rejects(set_bytes(frame, slice(5, 9), struct.pack("<I", MAX_HEADER_BYTES + 1)), SizeLimitError)


def _zstd_frame_with_content_size(data: bytes, claimed: int) -> bytes:
    """A zstd frame of ``data`` whose frame header claims ``claimed`` bytes of content."""
    comp = bytearray(zstandard.ZstdCompressor(level=1, write_content_size=True).compress(data))
    fhd = comp[4]  # frame header descriptor: content-size field size in bits 7-6, single segment in bit 5
    assert fhd >> 6 == 1 and fhd & 0x3 == 0, "expected a 2-byte content size field and no dictionary id"
    at = 5 if fhd & 0x20 else 6  # (a window descriptor byte precedes it unless single segment)
    comp[at:at + 2] = (claimed - 256).to_bytes(2, "little")  # the 2-byte field stores size - 256
    assert zstandard.get_frame_parameters(bytes(comp)).content_size == claimed
    return bytes(comp)


def _bootstrap_frame():
    """A dense (bootstrap) frame of the scenario's new bits."""
    _, new, _, _ = scenario()
    (frame,) = encode_frames([full_delta(n, t) for n, t in new.items()], meta(), key=KEY)
    return frame


def test_a_zstd_section_whose_frame_lies_about_its_content_size_is_rejected():
    h, secs = explode(_bootstrap_frame())
    sections, bodies = [], []
    for n, b in secs.items():
        if n == "dense4.0":  # 1000 bytes; its zstd frame and the header both claim only 900
            comp = _zstd_frame_with_content_size(b, len(b) - 100)
            sections.append([n, "zstd", len(b) - 100, len(comp)])
        else:
            comp = b
            sections.append([n, "raw", len(b), len(b)])
        bodies.append(comp)
    rejects(pack({**h, "sections": sections}, b"".join(bodies)), MalformedHeaderError)


def test_a_zstd_section_without_a_declared_content_size_is_rejected():
    h, secs = explode(scenario()[2])
    sections, bodies = [], []
    for n, b in secs.items():
        comp = zstandard.ZstdCompressor(write_content_size=False).compress(b)
        sections.append([n, "zstd", len(b), len(comp)])
        bodies.append(comp)
    rejects(pack({**h, "sections": sections}, b"".join(bodies)), SizeLimitError)


def test_a_decompression_bomb_is_rejected_before_it_is_inflated():
    h, secs = explode(scenario()[2])
    bomb = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(64 << 20))
    sections = [[n, "raw", len(b), len(b)] for n, b in secs.items()] + [["pad", "zstd", 64 << 20, len(bomb)]]
    body = b"".join(secs.values()) + bomb
    rejects(pack({**h, "sections": sections}, body), SizeLimitError, max_raw_bytes=1 << 20)


def test_two_copies_of_one_chunk_in_a_frame_are_rejected_as_duplicates():
    old, new, _, deltas = scenario()
    fb = FrameBuilder(meta(), key=KEY)
    td = deltas[2]  # the mask
    fb.add(deltas[0], deltas[0].chunks[0])
    fb.add(td, td.chunks[0])
    fb.add(td, td.chunks[0])
    rejects(fb.finish(), DuplicateIndexError)


def test_items_from_two_chunkings_of_one_tensor_that_overlap_are_rejected_as_duplicates():
    old, new, _, _ = scenario()
    by32 = diff_tensor(EMB, _bits(old[EMB]), new[EMB], chunk_elems=32)
    by48 = diff_tensor(EMB, _bits(old[EMB]), new[EMB], chunk_elems=48)
    fb = FrameBuilder(meta(), key=KEY)
    fb.add(by32, by32.chunks[1])  # [32, 64)
    fb.add(by48, by48.chunks[0])  # [0, 48)
    rejects(fb.finish(), DuplicateIndexError)


@pytest.mark.parametrize("encoding", ["ow", "dense"])
def test_bool_values_other_than_zero_or_one_are_rejected_in_overwrite_and_dense_items(encoding):
    old, new, _, deltas = scenario()
    td = deltas[2] if encoding == "ow" else full_delta(MASK, new[MASK])
    (frame,) = encode_frames([deltas[0], td], meta(), mode="overwrite", key=KEY)
    h, secs = explode(frame)
    assert h["items"][-1]["e"] == encoding
    sec = f"{encoding}1.0"
    secs[sec] = set_bytes(secs[sec], slice(-1, None), b"\x02")
    rejects(assemble(h, secs), InvalidValueError)


def test_a_receiver_that_lacks_a_tensor_of_the_frame_rejects_it():
    targets = receiver()
    del targets[MASK]
    rejects(scenario()[2], TargetMismatchError, targets=targets)


def test_a_receiver_tensor_that_cannot_be_written_in_place_fails_the_frame_before_any_write():
    targets = receiver()
    targets[MASK] = torch.stack([targets[MASK], targets[MASK]], 1)[:, 0]  # same bits, not contiguous
    assert not targets[MASK].is_contiguous()
    rejects(scenario()[2], TargetMismatchError, targets=targets)


def test_the_reader_checks_names_dtypes_and_shapes_against_a_shapes_table_too():
    frame = scenario()[2]
    shapes = {EMB: ("bfloat16", (8, 16)), NORM: ("float32", (1000,)), MASK: ("bool", (40,))}
    assert len(read_frame(frame, shapes=shapes, key=KEY).items) == 6
    with pytest.raises(TargetMismatchError):
        read_frame(frame, shapes={**shapes, MASK: ("uint8", (40,))}, key=KEY)
    with pytest.raises(TargetMismatchError):
        read_frame(frame, shapes={**shapes, NORM: ("float32", (10, 100))}, key=KEY)
    with pytest.raises(TargetMismatchError):
        read_frame(frame, shapes={EMB: shapes[EMB], NORM: shapes[NORM]}, key=KEY)


# --- fuzzing: anything re-signed either applies or is a FrameError that wrote nothing -----------------
def _outcome(frame) -> str:
    targets = receiver()
    try:
        apply_frame(frame, targets, key=KEY, expect_base=BASE)
    except FrameError as e:
        assert_untouched(targets)
        return type(e).__name__
    except DcrError as e:  # pragma: no cover - a DcrError that is not a frame error is a bug here
        raise AssertionError(f"{type(e).__name__} is not a FrameError: {e}") from e
    return "applied"


_HEADER_FIELDS = ["fmt", "transfer", "attempt", "producer", "payload", "base", "target", "sections", "items"]
_ITEM_FIELDS = ["t", "dt", "sh", "lo", "hi", "n", "e", "lm", "lw", "ls", "le", "x"]
_VALUES = st.one_of(
    st.integers(-2, 3), st.integers(-(2**63), 2**64 - 1), st.sampled_from([31, 32, 33, 40, 127, 128, 999, 1000]),
    st.text(max_size=8), st.sampled_from(["xor", "ow", "dense", "gaps", "runs", "bool", "float32", EMB, MASK]),
    st.booleans(), st.none(), st.floats(allow_nan=True), st.binary(max_size=4),
    st.lists(st.integers(-1, 2**40), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(-(2**63), 2**64 - 1), max_size=2),
)


def _nudge(data, old: int) -> int:
    """``old`` moved by a little, inside msgpack's integer range (a frame cannot carry a value outside it:
    a value drawn near 2**64 - 1 and then nudged up made the test's own packing raise)."""
    return min(max(old + data.draw(st.integers(-3, 3)), -(2**63)), 2**64 - 1)


def _edit(data, d: dict, fields: list[str]) -> None:
    """Replace a field of ``d`` with an arbitrary value, or nudge an integer field by a little."""
    field = data.draw(st.sampled_from(fields))
    old = d.get(field)
    if isinstance(old, int) and not isinstance(old, bool) and data.draw(st.booleans()):
        d[field] = _nudge(data, old)
    elif isinstance(old, list) and old and all(isinstance(x, int) for x in old) and data.draw(st.booleans()):
        d[field] = [x + data.draw(st.integers(-1, 1)) for x in old]  # a shape
    else:
        d[field] = data.draw(_VALUES)


@settings(max_examples=250)
@given(data=st.data())
def test_any_re_signed_edit_of_the_header_is_applied_or_rejected_as_a_frame_error_without_writes(data):
    h, secs = explode(scenario()[2])
    for _ in range(data.draw(st.integers(1, 3))):
        if data.draw(st.integers(0, 3)) == 0:
            _edit(data, h, _HEADER_FIELDS)
        elif isinstance(h.get("items"), list) and h["items"]:
            it = h["items"][data.draw(st.integers(0, len(h["items"]) - 1))]
            if isinstance(it, dict):
                _edit(data, it, _ITEM_FIELDS)
    body = b"".join(secs.values())
    if not isinstance(h.get("sections"), list) or data.draw(st.booleans()):
        frame = pack(h, body)
    else:
        frame = assemble(h, secs)
    event(_outcome(frame))


@settings(max_examples=150)
@given(data=st.data())
def test_any_re_signed_edit_of_the_section_bytes_is_applied_or_rejected_as_a_frame_error_without_writes(data):
    h, secs = explode(scenario()[2])
    for _ in range(data.draw(st.integers(1, 4))):
        name = data.draw(st.sampled_from(sorted(secs)))
        b = bytearray(secs[name])
        op = data.draw(st.sampled_from(["set", "cut", "grow"]))
        if op == "set" and b:
            b[data.draw(st.integers(0, len(b) - 1))] = data.draw(st.integers(0, 255))
        elif op == "cut" and b:
            del b[data.draw(st.integers(0, len(b) - 1)):]
        else:
            b += data.draw(st.binary(min_size=1, max_size=9))
        secs[name] = bytes(b)
    event(_outcome(assemble(h, secs, zstd=tuple(data.draw(st.sets(st.sampled_from(sorted(secs))))))))


@settings(max_examples=100)
@given(st.binary(max_size=200), st.booleans())
def test_arbitrary_bytes_are_rejected_as_a_frame_error(junk, with_prefix):
    data = (b"DCRF\x01" + struct.pack("<I", len(junk) // 2) + junk) if with_prefix else junk
    targets = receiver()
    with pytest.raises(FrameError):
        apply_frame(data, targets, key=KEY)
    assert_untouched(targets)
    with pytest.raises(FrameError):
        peek_meta(data)


# --- the context codings: ADD values and class-order positions ----------------------------------------
CW, CV, CI, CM = "ctx.bf16", "ctx.fp32", "ctx.int16", "ctx.mask"


@functools.lru_cache(maxsize=None)
def ctx_scenario():
    """(old tensors, new tensors, one valid keyed context-coded frame).

    Items, in order: bf16 [0,2048) ADD + class gaps; fp32 [0,600) ADD + class runs; int16 [0,300) ADD at
    flat gaps; mask [0,40) XOR. As in :func:`scenario`, damage in a late item must not let an earlier
    one be written.
    """
    g = torch.Generator().manual_seed(99)
    old = {CW: (torch.randn(2048, generator=g) * 10.0 ** torch.randint(-6, 2, (2048,), generator=g)).to(torch.bfloat16),
           CV: torch.randn(600, generator=g), CI: torch.randint(-1000, 1000, (300,), dtype=torch.int16, generator=g),
           CM: torch.rand(40, generator=g) > 0.5}
    new = {k: v.clone() for k, v in old.items()}
    w = ints(new[CW])
    small = (((w >> 7) & 0xFF) < 110).nonzero().view(-1)  # small magnitudes move (one ulp, either way)
    w[small[::6]] += 1  # a third of them: class-order gaps, not runs
    w[small[3::6]] -= 1
    v = ints(new[CV])
    v[((v >> 23) & 0xFF) == 126] += 1  # one whole exponent class
    ints(new[CI])[::7] += 3
    new[CM][[3, 20, 21]] = ~new[CM][[3, 20, 21]]
    deltas = [diff_tensor(n, _bits(old[n]), new[n], chunk_elems=4096) for n in (CW, CV, CI, CM)]
    (frame,) = encode_frames(deltas, meta(), key=KEY, coding="context")
    return old, new, frame


def ctx_receiver():
    return {k: v.clone() for k, v in ctx_scenario()[0].items()}


def ctx_rejects(frame, error: type[FrameError]) -> None:
    """Apply ``frame`` to a fresh context receiver: exactly ``error``, and nothing written."""
    targets = ctx_receiver()
    with pytest.raises(error):
        apply_frame(frame, targets, key=KEY, expect_base=BASE)
    old = ctx_scenario()[0]
    for name, t in targets.items():
        assert torch.equal(ints(t), ints(old[name])), f"{name} was written by a rejected frame"


def ctx_loc_span(h: dict, idx: int) -> slice:
    return loc_span(h, idx)


def test_the_context_scenario_frame_uses_every_new_coding_and_applies_exactly():
    _, new, frame = ctx_scenario()
    h, _ = explode(frame)
    assert [(it["t"], it["e"], it["lm"]) for it in h["items"]] == [
        (CW, "add", "cgaps"), (CV, "add", "cruns"), (CI, "add", "gaps"), (CM, "xor", "gaps")]
    targets = ctx_receiver()
    apply_frame(frame, targets, key=KEY, expect_base=BASE)
    for name in new:
        assert torch.equal(ints(targets[name]), ints(new[name]))


def _ctx_edit(edit) -> bytes:
    h, secs = explode(ctx_scenario()[2])
    edit(h, secs)
    return assemble(h, secs)


def test_a_class_mode_on_a_dtype_without_an_exponent_is_rejected_without_writes():
    ctx_rejects(_ctx_edit(lambda h, s: h["items"][2].update(lm="cgaps")), MalformedHeaderError)


def test_a_class_mode_on_a_bool_tensor_is_rejected_without_writes():
    ctx_rejects(_ctx_edit(lambda h, s: h["items"][3].update(lm="cgaps")), MalformedHeaderError)


def test_an_unknown_class_like_location_mode_is_rejected_without_writes():
    ctx_rejects(_ctx_edit(lambda h, s: h["items"][1].update(lm="cgap")), MalformedHeaderError)


def test_a_class_rank_past_the_item_span_is_rejected_without_writes():
    def edit(h, secs):
        sp = ctx_loc_span(h, 1)  # cruns of the fp32 item: its first gap becomes an escape past the span
        assert h["items"][1]["lw"] == 1 and h["items"][1]["le"] == 0
        secs["loc"] = set_bytes(secs["loc"], slice(sp.start, sp.start + 1), b"\xff")
        h["items"][1]["le"] = 1
        secs["esc"] = secs.get("esc", b"") + (70000).to_bytes(8, "little")
    ctx_rejects(_ctx_edit(edit), IndexOutOfRangeError)


def test_class_ranks_adding_up_past_the_item_span_are_rejected_without_writes():
    def edit(h, secs):
        sp = ctx_loc_span(h, 0)
        secs["loc"] = set_bytes(secs["loc"], sp, bytes([200]) * (sp.stop - sp.start))
    ctx_rejects(_ctx_edit(edit), (IndexOutOfRangeError, MalformedHeaderError))


def test_class_runs_that_cover_more_than_the_declared_changes_are_rejected_without_writes():
    def edit(h, secs):
        sp = ctx_loc_span(h, 1)
        secs["loc"] = set_bytes(secs["loc"], slice(sp.stop - 1, sp.stop), bytes([secs["loc"][sp.stop - 1] + 1]))
    ctx_rejects(_ctx_edit(edit), MalformedHeaderError)


def test_an_add_item_on_a_bool_tensor_is_rejected_without_writes():
    def edit(h, secs):
        h["items"][3]["e"] = "add"
        secs["add1.0"] = secs.pop("xor1.0")
    ctx_rejects(_ctx_edit(edit), InvalidValueError)


def test_add_values_that_run_short_of_the_declared_changes_are_rejected_without_writes():
    def edit(h, secs):
        secs["add4.3"] = secs["add4.3"][:-1]
    ctx_rejects(_ctx_edit(edit), MalformedHeaderError)


def test_a_context_frame_whose_last_item_is_damaged_writes_none_of_its_earlier_items():
    def edit(h, secs):
        secs["xor1.0"] = set_bytes(secs["xor1.0"], slice(0, 1), b"\x02")  # bool mask of 2, last item
    ctx_rejects(_ctx_edit(edit), InvalidValueError)


def _ctx_outcome(frame) -> str:
    targets = ctx_receiver()
    try:
        apply_frame(frame, targets, key=KEY, expect_base=BASE)
    except FrameError as e:
        old = ctx_scenario()[0]
        for name, t in targets.items():
            assert torch.equal(ints(t), ints(old[name])), f"{name} was written by a rejected frame"
        return type(e).__name__
    except DcrError as e:  # pragma: no cover - a DcrError that is not a frame error is a bug here
        raise AssertionError(f"{type(e).__name__} is not a FrameError: {e}") from e
    return "applied"


_CTX_VALUES = st.one_of(_VALUES, st.sampled_from(["add", "cgaps", "cruns", "float16", "bfloat16", "int16", CW, CV]))


@settings(max_examples=120)
@given(data=st.data())
def test_any_re_signed_edit_of_a_context_frame_is_applied_or_rejected_as_a_frame_error_without_writes(data):
    h, secs = explode(ctx_scenario()[2])
    for _ in range(data.draw(st.integers(1, 3))):
        if data.draw(st.booleans()):
            it = h["items"][data.draw(st.integers(0, len(h["items"]) - 1))]
            field = data.draw(st.sampled_from(_ITEM_FIELDS))
            old = it.get(field)
            if isinstance(old, int) and not isinstance(old, bool) and data.draw(st.booleans()):
                it[field] = _nudge(data, old)
            else:
                it[field] = data.draw(_CTX_VALUES)
        else:
            name = data.draw(st.sampled_from(sorted(secs)))
            b = bytearray(secs[name])
            if b and data.draw(st.booleans()):
                b[data.draw(st.integers(0, len(b) - 1))] = data.draw(st.integers(0, 255))
            elif b:
                del b[data.draw(st.integers(0, len(b) - 1)):]
            secs[name] = bytes(b)
    event(_ctx_outcome(assemble(h, secs)))
