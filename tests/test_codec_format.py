"""The wire format's names and types, and the two-step reader (open_frame, then decode_frame)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from dcr_ray.codec import (
    DecodedFrame,
    Encoding,
    FrameHeader,
    FrameMeta,
    LocationMode,
    PayloadKey,
    apply_decoded,
    bits_view,
    decode_frame,
    diff_tensor,
    encode_frames,
    open_frame,
    peek_meta,
    read_frame,
)
from dcr_ray.codec import bits
from dcr_ray.codec.decoding import header
from dcr_ray.errors import BaseVersionMismatchError, DigestMismatchError, MalformedHeaderError

KEY = b"format-test-key"
META = FrameMeta(transfer="t", attempt=1, producer="owner-2", payload=4, base=7, target=8)


def _frames(mode: str = "mixed"):
    old = torch.arange(4096, dtype=torch.int16).view(torch.bfloat16)
    new = old.clone()
    new.view(torch.int16)[::37] ^= 1  # scattered: gap-coded
    new.view(torch.int16)[1000:1100] ^= 2  # one run
    td = diff_tensor("w", bits_view(old).copy(), new, chunk_elems=1024)
    return old, new, list(encode_frames([td], META, mode=mode, key=KEY))


def test_the_enums_are_their_wire_strings():
    assert [e.value for e in Encoding] == ["xor", "ow", "dense", "add"]
    assert [m.value for m in LocationMode] == ["gaps", "runs", "cgaps", "cruns"]
    for member in (*Encoding, *LocationMode):
        assert member == member.value and hash(member) == hash(member.value)
        assert str(member) == f"{member}" == member.value
        assert msgpack.packb({"e": member}) == msgpack.packb({"e": member.value})
    assert Encoding("ow") is Encoding.OVERWRITE and LocationMode("runs") is LocationMode.RUNS


def test_the_payload_key_is_a_plain_tuple_of_the_frame_identity():
    key = META.key
    assert isinstance(key, PayloadKey)
    assert key == ("t", 1, "owner-2", 4) and hash(key) == hash(("t", 1, "owner-2", 4))
    assert key.producer == "owner-2" and key.payload == 4


def test_open_then_decode_gives_what_read_frame_gives():
    old, new, frames = _frames()
    assert len(frames) == 1
    opened = open_frame(frames[0], key=KEY)
    assert isinstance(opened, FrameHeader)
    assert opened.meta == META == peek_meta(frames[0])
    assert opened.fields["payload"] == META.payload and opened.body_offset > 9
    two_step = decode_frame(opened, shapes={"w": ("bfloat16", (4096,))}, expect_base=META.base)
    one_step = read_frame(frames[0], key=KEY, expect_base=META.base, shapes={"w": ("bfloat16", (4096,))})
    assert isinstance(two_step, DecodedFrame) and two_step.key == META.key
    assert (two_step.wire_bytes, two_step.raw_bytes) == (one_step.wire_bytes, one_step.raw_bytes)
    for a, b in zip(two_step.items, one_step.items, strict=True):
        assert isinstance(a.encoding, Encoding) and a.encoding is b.encoding
        assert (a.name, a.lo, a.hi) == (b.name, b.lo, b.hi)
        assert np.array_equal(a.positions, b.positions) and np.array_equal(a.values, b.values)
    modes = {it["lm"] for it in opened.fields["items"] if it["e"] != "dense"}
    assert modes <= {"gaps", "runs"}
    target = {"w": old.clone()}
    apply_decoded(two_step, target)
    assert torch.equal(target["w"].view(torch.int16), new.view(torch.int16))


def test_decode_frame_checks_the_base_version():
    _, _, (frame,) = _frames()
    with pytest.raises(BaseVersionMismatchError):
        decode_frame(open_frame(frame, key=KEY), expect_base=META.base + 1)


def test_open_frame_needs_the_key_named_and_checks_the_digest_before_parsing_the_header(monkeypatch):
    _, _, (frame,) = _frames("overwrite")
    with pytest.raises(TypeError):
        open_frame(frame)  # the key is never implicit
    with pytest.raises(DigestMismatchError):
        open_frame(frame, key=None)

    calls = []
    real = header.msgpack.unpackb
    monkeypatch.setattr(header.msgpack, "unpackb", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    bad = bytearray(frame)
    bad[12] ^= 0xFF  # inside the header
    with pytest.raises(DigestMismatchError):
        open_frame(bytes(bad), key=KEY)
    assert calls == []  # the header of an unverified frame never reached msgpack
    assert open_frame(frame, key=KEY).meta == META and calls == [1]


def test_open_frame_rejects_a_signed_header_that_is_not_msgpack():
    from dcr_ray.codec.format import FORMAT_VERSION, MAGIC, digest

    junk = b"\xc1" * 8  # 0xc1 is never valid msgpack
    signed = bytes([FORMAT_VERSION]) + len(junk).to_bytes(4, "little") + junk
    with pytest.raises(MalformedHeaderError):
        open_frame(MAGIC + signed + digest(signed, KEY), key=KEY)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_one_width_table_gives_the_views_bits_view_uses(width):
    uint, sint, tint = bits.np_uint(width), bits.np_int(width), bits.torch_int(width)
    assert np.dtype(uint).itemsize == np.dtype(sint).itemsize == width
    assert np.dtype(uint).kind == "u" and torch.empty((), dtype=tint).element_size() == width
    t = torch.zeros(3, dtype=tint)
    assert bits_view(t).dtype == uint
    assert torch.from_numpy(np.zeros(3, sint)).dtype == tint
