"""Frames are bound to the content they were built on, not only to its version number.

Every committed version has an identity: the transfer that produced it (the commit record's
``transfer``). Owners write it into each frame as ``base_id``; an engine knows the id of what it holds
and refuses frames (and whole transfers) built on other content with the same version number, before
writing anything. Decompression is bounded by two of the largest bucket a sender may use.
"""

from __future__ import annotations

import pytest
import torch

import dcr_ray
from dcr_ray.actors.engine.actor import EngineActor
from dcr_ray.codec import BaselineStore, FrameMeta, apply_frame, encode_frames, peek_meta, read_frame
from dcr_ray.codec.format import DEFAULT_MAX_RAW_BYTES, MAX_BUCKET_BYTES
from dcr_ray.engines.base import canonical_state_dict
from dcr_ray.errors import BaseVersionMismatchError, ConfigError, EngineStateError
from dcr_ray.testing.models import ModelSpec, build_model

SPEC = ModelSpec(size="tiny", seed=0)


class _Direct:
    """The transport's engine side for frames handed over as bytes."""

    def read(self, payload):
        return payload


def _changed(state: dict, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: (t + 1e-2 * torch.randn(t.shape, generator=g).to(t.dtype)) if t.is_floating_point() else t
            for n, t in state.items()}


def _frames(old: dict, new: dict, *, base_id: str, transfer: str = "T") -> list[bytes]:
    store = BaselineStore(in_memory=True)
    for n, t in old.items():
        store.add(n, t)
    meta = FrameMeta(transfer=transfer, attempt=0, producer="owner0", payload=0, base=0, target=1,
                     base_id=base_id)
    return list(encode_frames([d for d in (store.diff(n, new[n]) for n in old) if d.chunks], meta))


def _bits(state: dict) -> dict:
    return {n: t.view(torch.int16).clone() if t.dtype == torch.bfloat16 else t.clone() for n, t in state.items()}


def test_a_frame_carries_its_base_content_id_and_apply_frame_refuses_other_content():
    old = canonical_state_dict(build_model(SPEC))
    new = _changed(old)
    frames = _frames(old, new, base_id="v3-aaaa")
    assert peek_meta(frames[0]).base_id == "v3-aaaa"
    targets = {n: t.clone() for n, t in old.items()}
    before = _bits(targets)
    with pytest.raises(BaseVersionMismatchError, match="another update with the same version number"):
        apply_frame(frames[0], targets, expect_base=0, expect_base_id="v3-bbbb")
    after = _bits(targets)
    assert all(torch.equal(before[n], after[n]) for n in before)
    for f in frames:
        apply_frame(f, targets, expect_base=0, expect_base_id="v3-aaaa")
    assert all(torch.equal(targets[n].view(torch.int16), new[n].view(torch.int16)) for n in new
               if new[n].dtype == torch.bfloat16)


def test_a_frame_without_a_content_id_has_no_such_header_field_and_is_refused_where_one_is_required():
    old = canonical_state_dict(build_model(SPEC))
    (first, *_) = _frames(old, _changed(old), base_id="")
    assert b"base_id" not in first[:4096]  # byte-identical to frames written before the field existed
    assert read_frame(first, old, expect_base=0).meta.base_id == ""
    with pytest.raises(BaseVersionMismatchError):
        read_frame(first, old, expect_base=0, expect_base_id="attach")


def test_an_engine_refuses_a_transfer_and_frames_built_on_other_content_with_the_same_version_number():
    engine = EngineActor("c0/e0", "c0", dcr_ray.HFEngine(SPEC), dcr_ray.RefitConfig(), _Direct())
    engine.activate(0, version_id="attach")  # as after the launch's dense bootstrap
    old = {n: t.clone() for n, t in engine.backend.tensors().items()}
    snapshot = _bits(old)
    new = _changed(old)
    with pytest.raises(EngineStateError, match="another lineage"):
        engine.prepare("T", 0, 0, 1, "v0-elsewhere")
    engine.prepare("T", 0, 0, 1, "attach")
    foreign = _frames(old, new, base_id="v0-elsewhere")
    assert engine.deliver(foreign[0]) == "rejected"
    assert all(torch.equal(snapshot[n], _bits(engine.backend.tensors())[n]) for n in snapshot)
    with pytest.raises(BaseVersionMismatchError):
        engine.flush("T", 0, [("T", 0, "owner0", 0)], 1.0)
    engine.abort("T")
    engine.prepare("T2", 0, 0, 1, "attach")
    frames = _frames(old, new, base_id="attach", transfer="T2")
    assert [engine.deliver(f) for f in frames] == ["applied"] * len(frames)


def test_decompression_is_bounded_by_two_of_the_largest_bucket_a_sender_may_use():
    assert DEFAULT_MAX_RAW_BYTES == 2 * MAX_BUCKET_BYTES < 1 << 30
    with pytest.raises(ConfigError, match="bucket_bytes must be an integer in"):
        dcr_ray.CodecConfig(bucket_bytes=MAX_BUCKET_BYTES * 2)
    dcr_ray.CodecConfig(bucket_bytes=MAX_BUCKET_BYTES)


def test_peek_meta_walks_past_a_hostile_header_without_building_it():
    import struct
    import tracemalloc

    import msgpack

    from dcr_ray.codec.format import DIGEST_SIZE, FORMAT_VERSION, MAGIC

    header = msgpack.packb({"fmt": FORMAT_VERSION, "transfer": "T", "attempt": 0, "producer": "p", "payload": 0,
                            "base": 0, "target": 1, "items": [{}] * 1_000_000, "sections": []})
    data = MAGIC + bytes([FORMAT_VERSION]) + struct.pack("<I", len(header)) + header + bytes(DIGEST_SIZE)
    tracemalloc.start()
    meta = peek_meta(data)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert meta.transfer == "T" and meta.base_id == ""
    assert peak < 4 << 20  # a million empty maps would take ~100 MB as Python objects


def test_zstd_level_zero_stores_sections_raw_and_the_frames_apply_exactly():
    old = canonical_state_dict(build_model(SPEC))
    new = _changed(old)
    store = BaselineStore(in_memory=True)
    for n, t in old.items():
        store.add(n, t)
    deltas = [d for d in (store.diff(n, new[n]) for n in old) if d.chunks]
    meta = FrameMeta(transfer="T", attempt=0, producer="o", payload=0, base=0, target=1)
    frames = list(encode_frames(deltas, meta, zstd_level=0))
    targets = {n: t.clone() for n, t in old.items()}
    for f in frames:
        frame = read_frame(f, targets, expect_base=0)
        assert frame.wire_bytes > frame.raw_bytes  # nothing compressed: header and digest on top
        apply_frame(f, targets, expect_base=0)
    assert all(torch.equal(targets[n].view(torch.int16), new[n].view(torch.int16)) for n in new
               if new[n].dtype == torch.bfloat16)
    with pytest.raises(ConfigError, match="0..22"):
        dcr_ray.CodecConfig(zstd_level=-1)
