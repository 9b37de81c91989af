"""Golden wire fixtures: today's encoder must produce the committed frames byte for byte.

A failure here means the wire format changed. If that is deliberate, bump ``FORMAT_VERSION`` where old
readers cannot read the new frames, run ``python tests/golden/make_golden.py`` and commit the new
fixtures together with the change, so the diff shows it.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import msgpack
import pytest
import torch
import zstandard

from dcr_ray.codec import FORMAT_VERSION, apply_frame, peek_meta, read_frame

GOLDEN = Path(__file__).resolve().parent / "golden"
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _load_generator():
    spec = importlib.util.spec_from_file_location("dcr_golden_make", GOLDEN / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


make_golden = _load_generator()
DOC = json.loads((GOLDEN / "cases.json").read_text())
CASES = {c["name"]: c for c in DOC["cases"]}
ZSTD_NOW = ".".join(map(str, zstandard.ZSTD_VERSION))


def stored_frames(case: dict) -> list[bytes]:
    return [(GOLDEN / f).read_bytes() for f in case["frames"]]


def ints(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def logical(frame: bytes) -> tuple[dict, list[tuple[str, int, bytes]]]:
    """(header without its section table, [(section, raw length, decompressed bytes)])."""
    _, _, hlen = struct.unpack_from("<4sBI", frame, 0)
    header = msgpack.unpackb(frame[9:9 + hlen], raw=False)
    off, secs = 9 + hlen, []
    for name, codec, raw, comp in header.pop("sections"):
        body = frame[off:off + comp]
        off += comp
        secs.append((name, raw, zstandard.ZstdDecompressor().decompress(body) if codec == "zstd" else body))
    return header, secs


def test_the_golden_set_covers_every_case_the_generator_defines():
    assert set(CASES) == set(make_golden.CASE_SETTINGS)
    assert all((GOLDEN / f).is_file() for c in CASES.values() for f in c["frames"])


@pytest.mark.parametrize("name", list(CASES))
def test_re_encoding_the_golden_inputs_gives_byte_identical_frames(name):
    case = CASES[name]
    if DOC["zstd_version"] != ZSTD_NOW:
        pytest.skip(f"fixtures were compressed with zstd {DOC['zstd_version']}, this is {ZSTD_NOW}: compressed "
                    "bytes may legitimately differ (the logical-content test still runs)")
    now = make_golden.encode_case(case, make_golden.tensors_of(case))
    want = stored_frames(case)
    assert len(now) == len(want), f"{name}: {len(now)} frames today, {len(want)} in the fixtures"
    for i, (a, b) in enumerate(zip(now, want)):
        assert a == b, (f"{name} frame {i} changed on the wire ({len(a)} vs {len(b)} bytes). If deliberate, "
                        "regenerate with `python tests/golden/make_golden.py` and commit the fixtures.")


@pytest.mark.parametrize("name", list(CASES))
def test_re_encoding_the_golden_inputs_gives_the_same_headers_and_section_contents(name):
    """Independent of the zstd library version: the format, not one compressor's output."""
    case = CASES[name]
    now = make_golden.encode_case(case, make_golden.tensors_of(case))
    want = stored_frames(case)
    assert len(now) == len(want)
    for a, b in zip(now, want):
        assert a[:5] == b[:5] == b"DCRF" + bytes([FORMAT_VERSION])
        assert logical(a) == logical(b)


@pytest.mark.parametrize("name", list(CASES))
def test_the_stored_golden_frames_still_apply_to_the_expected_bits(name):
    case = CASES[name]
    key = case["key"].encode() if case["key"] else None
    tensors = make_golden.tensors_of(case)
    targets = {n: old.clone() for n, old, _ in tensors}
    for i, frame in enumerate(stored_frames(case)):
        m = peek_meta(frame)
        assert (m.transfer, m.attempt, m.producer, m.base, m.target) == tuple(
            case["meta"][k] for k in ("transfer", "attempt", "producer", "base", "target"))
        assert m.payload == case["meta"]["payload"] + i
        apply_frame(frame, targets, key=key, expect_base=case["meta"]["base"])
    for n, old, new in tensors:
        assert not torch.equal(ints(old), ints(new)), "each golden tensor changes"
        assert torch.equal(ints(targets[n]), ints(new)), f"{name}: {n} differs after applying the golden frames"


@pytest.mark.parametrize("name", list(CASES))
def test_each_golden_case_still_contains_what_it_is_named_for(name):
    case = CASES[name]
    frames = stored_frames(case)
    make_golden.check_coverage(case, frames)
    key = case["key"].encode() if case["key"] else None
    for f in frames:  # and every stored frame validates on its own
        read_frame(f, key=key, expect_base=case["meta"]["base"])
