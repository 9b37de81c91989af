"""Frames are split by header size as well as by value bytes, so no tensor count builds a frame that
receivers refuse (their header limit is ``MAX_HEADER_BYTES``)."""

from __future__ import annotations

import struct

import torch

from dcr_ray.codec import FrameMeta, apply_frame, bits_equal, diff_tensor, encode_frames, bits_view
from dcr_ray.codec.encoding.encode import HEADER_BUDGET_BYTES, item_header_bound
from dcr_ray.codec.format import MAGIC, MAX_HEADER_BYTES


def _header_len(frame: bytes) -> int:
    return struct.unpack_from("<I", frame, len(MAGIC) + 1)[0]


def _many_small_changes(n: int):
    names = [f"model.layers.{i}.some.rather.long.parameter.name.weight" for i in range(n)]
    old = {name: torch.full((3,), float(i), dtype=torch.bfloat16) for i, name in enumerate(names)}
    new = {name: t + 1 for name, t in old.items()}
    deltas = [diff_tensor(name, bits_view(old[name]).copy(), new[name]) for name in names]
    return old, new, deltas


def test_the_default_header_budget_leaves_receivers_a_fourfold_margin():
    assert HEADER_BUDGET_BYTES * 4 == MAX_HEADER_BYTES


def test_many_small_tensors_are_cut_into_frames_whose_headers_stay_under_the_budget():
    old, new, deltas = _many_small_changes(3000)
    budget = 64 << 10
    meta = FrameMeta(transfer="t", attempt=0, producer="o", payload=0, base=0, target=1)
    frames = list(encode_frames(deltas, meta, bucket_bytes=64 << 20, header_bytes=budget))
    assert len(frames) > 1  # value bytes alone (18 KB) would have fitted one frame
    for f in frames:
        # the last item may take the frame past the budget by at most one item's bound
        assert _header_len(f) <= budget + item_header_bound(deltas[0])
    targets = {n: t.clone() for n, t in old.items()}
    for f in frames:
        apply_frame(f, targets, expect_base=0)
    assert all(bits_equal(targets[n], new[n]) for n in new)


def test_the_item_header_bound_is_an_upper_bound_on_real_headers():
    _, _, deltas = _many_small_changes(500)
    meta = FrameMeta(transfer="t", attempt=0, producer="o", payload=0, base=0, target=1)
    (frame,) = encode_frames(deltas, meta)
    assert _header_len(frame) <= 256 + sum(item_header_bound(td) for td in deltas)
