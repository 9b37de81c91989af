"""Flat ranges (veRL-style ``(name, local_flat_shard, offset)`` shards) project with no gather.

A contiguous flat range of a canonical tensor becomes at most ``2n - 1`` flat-contiguous boxes, each a view
of the flat shard with an ordinary box spec. Hypothesis cuts tensors of 0-4 dimensions into flat ranges at
random points (inside rows, on row edges, empty ranges), gives each range to an owner, and checks that
projecting each owner's local changes gives exactly the (name, index, bits) set that gathering the
canonical tensors and diffing them gives, and that frames built from it rebuild the new tensors bit for
bit (the shared checks of ``test_sharding_cases``). Coverage accepts ranges that tile a tensor and names
the tensor when they leave a gap or overlap.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from test_sharding_cases import Layout, Piece, check_bootstrap, check_projection

from dcr_ray.errors import ConfigError
from dcr_ray.sharding import ShardSpecError, check_tiling
from dcr_ray.sharding.flat import flat_boxes, flat_range, flat_shards


@st.composite
def flat_layouts(draw) -> Layout:
    """One or two tensors, each cut into flat ranges owned by up to four owners (ranges may be empty)."""
    state, cuts = {}, {}
    for i in range(draw(st.integers(1, 2))):
        shape = tuple(draw(st.lists(st.integers(1, 7), min_size=0, max_size=4)))
        dtype = draw(st.sampled_from([torch.bfloat16, torch.float32]))
        numel = math.prod(shape)
        owners = draw(st.integers(1, 4))
        points = sorted(draw(st.lists(st.integers(0, numel), min_size=owners - 1, max_size=owners - 1)))
        state[f"t{i}"] = (shape, dtype)
        cuts[f"t{i}"] = [0, *points, numel]

    def build(s: dict[str, torch.Tensor], _pad_seed: int):
        pieces = []
        for name, t in s.items():
            b = cuts[name]
            for o in range(len(b) - 1):
                local = t.reshape(-1)[b[o]:b[o + 1]].clone()
                for key, sh in flat_shards(name, local, tuple(t.shape), b[o]).items():
                    pieces.append(Piece(f"rank{o}", key, sh.tensor, sh.spec))
        return {n: t.clone() for n, t in s.items()}, pieces

    return Layout("flat", state, build)


chunks = st.sampled_from([3, 8, 64, 1 << 20])


@settings(max_examples=40, deadline=None)
@given(flat_layouts(), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.05, 0.3, 0.97]), chunks)
def test_flat_range_projection_equals_gather_then_diff_bit_for_bit(layout, seed, rate, chunk):
    check_projection(layout, seed, rate, chunk)


@settings(max_examples=30, deadline=None)
@given(flat_layouts(), st.integers(0, 2**32 - 1), chunks)
def test_a_flat_range_bootstrap_sends_every_canonical_element_exactly_once(layout, seed, chunk):
    check_bootstrap(layout, seed, chunk)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=0, max_size=5), st.data())
def test_a_flat_range_is_at_most_2n_minus_1_flat_contiguous_boxes_in_order(shape, data):
    numel = math.prod(shape)
    a = data.draw(st.integers(0, numel))
    b = data.draw(st.integers(a, numel))
    boxes = flat_boxes(tuple(shape), a, b)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    ref = torch.arange(numel).reshape(shape)
    covered = []
    for lo, hi, offset, box in boxes:
        cell = ref[tuple(slice(o, o + n) for o, n in zip(offset, box))]
        assert cell.reshape(-1).tolist() == list(range(lo, hi))  # flat-contiguous, in flat order
        covered += list(range(lo, hi))
    assert covered == list(range(a, b))


def test_pieces_are_views_of_the_flat_shard_not_copies():
    flat = torch.arange(5 * 7, dtype=torch.float32)[9:30].clone()
    shards = flat_shards("w", flat, (5, 7), 9)
    assert [tuple(s.tensor.shape) for s in shards.values()] == [(1, 5), (2, 7), (1, 2)]  # partial, full, partial
    for s in shards.values():
        assert s.tensor.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_coverage_accepts_flat_ranges_that_tile_a_tensor_and_names_a_gap_or_an_overlap():
    shape = (4, 3, 5)

    def boxes(ranges):
        return [(f"rank{i}", b.start, b.stop) for i, (a, z) in enumerate(ranges)
                for p in flat_range("w", shape, a, z) for b in p.spec.boxes()]

    check_tiling("w", shape, boxes([(0, 7), (7, 31), (31, 60)]))
    with pytest.raises(ConfigError, match="'w'.*cover 59 of its 60"):
        check_tiling("w", shape, boxes([(0, 7), (8, 31), (31, 60)]))
    with pytest.raises(ConfigError, match="'w'.*both own"):
        check_tiling("w", shape, boxes([(0, 8), (7, 31), (31, 60)]))


def test_a_range_outside_the_tensor_is_refused_with_its_bounds():
    with pytest.raises(ShardSpecError, match=r"\[10, 13\).*\(3, 4\)"):
        flat_range("w", (3, 4), 10, 13)
