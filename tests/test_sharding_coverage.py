"""Per-element ownership: every layout's boxes tile its canonical tensors exactly; a gap, an overlap or a
spec that does not describe a box of its canonical tensor is refused with an error that says where."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dcr_ray.actors.owner.coverage import check_coverage
from dcr_ray.codec.bits import wire_name
from dcr_ray.errors import ConfigError
from dcr_ray.sharding import (Shard, ShardSpec, ShardSpecError, Target, box_target, canonical_specs, check_tiling,
                              fused_gate_up, fused_qkv, resolve_shards, row_slice, stacked_experts)

from test_sharding_cases import Piece, models, owners, random_state, vocab


def _declared(pieces: list[Piece]) -> dict[str, dict]:
    """owner -> what its ``dcr_attach`` returns."""
    return {o: canonical_specs({p.local: Shard(p.tensor, p.spec) for p in ps}, wire_name)
            for o, ps in owners(pieces).items()}


def _engine(canon: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {n: (wire_name(t.dtype), tuple(t.shape)) for n, t in canon.items()}


def _check(owner_specs: dict[str, dict], engine: dict[str, tuple]) -> None:
    """:func:`check_coverage`, then :func:`check_tiling` of every tensor declared in parts (the second
    guards the first: both must accept exactly the same tilings)."""
    check_coverage(owner_specs, engine)
    boxes: dict[str, list] = {}
    for o, specs in owner_specs.items():
        for n, s in specs.items():
            parts = s[2] if len(s) > 2 else [((0,) * len(s[1]), tuple(s[1]))]
            boxes.setdefault(n, []).extend((o, tuple(a), tuple(b)) for a, b in parts)
    for n, bs in boxes.items():
        check_tiling(n, engine[n][1], bs)


def _first_uncovered(shape, pieces: list[Piece], name: str):
    mask = np.zeros(shape, dtype=bool)
    for p in pieces:
        for b in p.spec.boxes():
            if b.name == name:
                mask[tuple(slice(a, z) for a, z in zip(b.start, b.stop))] = True
    return tuple(int(x) for x in np.argwhere(~mask)[0])


def _build(layout, seed):
    return layout.build(random_state(layout, np.random.default_rng(seed)), seed)


@settings(max_examples=50, deadline=None)
@given(models(), st.integers(0, 2**16))
def test_every_layout_tiles_its_canonical_tensors_exactly_once(layout, seed):
    canon, pieces = _build(layout, seed)
    check_coverage(_declared(pieces), _engine(canon))


@settings(max_examples=50, deadline=None)
@given(models(), st.integers(0, 2**16), st.data())
def test_a_missing_shard_is_refused_naming_the_tensor_and_its_first_uncovered_element(layout, seed, data):
    canon, pieces = _build(layout, seed)
    real = [i for i, p in enumerate(pieces) if p.spec.boxes()]
    drop = pieces[data.draw(st.sampled_from(real))]
    rest = [p for p in pieces if p is not drop]
    with pytest.raises(ConfigError) as err:
        _check(_declared(rest), _engine(canon))
    msg = str(err.value)
    name = drop.spec.boxes()[0].name
    if any(b.name == name for p in rest for b in p.spec.boxes()):
        assert repr(name) in msg or name in msg
        first = _first_uncovered(tuple(canon[name].shape), rest, name)
        # several tensors may lose elements; the error names one of them with its first gap
        gaps = {n: _first_uncovered(tuple(canon[n].shape), rest, n) for n in drop.spec.names
                if any(b.name == n for p in rest for b in p.spec.boxes())}
        m = re.search(r"tensor '([^']+)': owners cover \d+ of its \d+ elements; first uncovered element (\(.*\))", msg)
        assert m, msg
        assert m.group(1) in gaps and m.group(2) == str(gaps[m.group(1)]), (msg, gaps, first)
    else:
        assert "no owner for" in msg and name in msg


@settings(max_examples=50, deadline=None)
@given(models(), st.integers(0, 2**16), st.data())
def test_a_shard_declared_by_two_owners_is_refused_naming_both(layout, seed, data):
    canon, pieces = _build(layout, seed)
    real = [p for p in pieces if p.spec.boxes()]
    dup = data.draw(st.sampled_from(real))
    extra = Piece("intruder", dup.local, dup.tensor, dup.spec)
    with pytest.raises(ConfigError) as err:
        check_coverage(_declared(pieces + [extra]), _engine(canon))
    msg = str(err.value)
    assert "both own elements" in msg and "intruder" in msg and dup.owner in msg, msg
    assert any(repr(n) in msg for n in dup.spec.names), msg


def test_check_coverage_refuses_a_lone_box_that_ends_at_the_tensor_end_but_starts_inside_it():
    with pytest.raises(ConfigError, match=r"first uncovered element \(0, 0\)"):
        check_coverage({"r1": {"w": ("bfloat16", (2, 1), [((1, 0), (2, 1))])}}, {"w": ("bfloat16", (2, 1))})


def test_a_tied_lm_head_declared_next_to_its_embedding_is_an_overlap():
    """The trainer's LM head is the embedding tensor itself: declaring both sends every row twice."""
    lay = vocab(10, 4, 2, 1, torch.bfloat16)
    canon, pieces = _build(lay, 0)
    head = [Piece(p.owner, "lm_head", p.tensor, p.spec) for p in pieces]
    with pytest.raises(ConfigError, match=r"tensor 'embed': owners r0 and r0 both own"):
        check_coverage(_declared(pieces + head), _engine(canon))


def test_check_tiling_refuses_no_owner_and_boxes_outside_the_tensor():
    with pytest.raises(ConfigError, match="'w' has no owner"):
        check_tiling("w", (4, 4), [])
    with pytest.raises(ConfigError, match=r"owner b declares box \(2, 0\)..\(5, 4\) of tensor 'w', outside"):
        check_tiling("w", (4, 4), [("a", (0, 0), (2, 4)), ("b", (2, 0), (5, 4))])
    with pytest.raises(ConfigError, match=r"owners a and b both own elements of \(1, 2\)..\(2, 4\)"):
        check_tiling("w", (4, 4), [("a", (0, 0), (2, 4)), ("b", (1, 2), (4, 4)), ("c", (2, 0), (4, 2))])
    with pytest.raises(ConfigError, match=r"covered|cover 12 of its 16 elements; first uncovered element \(3, 0\)"):
        check_tiling("w", (4, 4), [("a", (0, 0), (3, 4))])
    check_tiling("w", (4, 4), [("a", (0, 0), (3, 4)), ("b", (3, 0), (4, 4))])


def test_engines_and_owners_that_disagree_on_shape_or_names_are_refused():
    spec = {"o": {"w": ("bfloat16", (4, 4))}}
    with pytest.raises(ConfigError, match="dtype/shape differ"):
        check_coverage(spec, {"w": ("bfloat16", (4, 5))})
    with pytest.raises(ConfigError, match=r"no owner for \['v'\]"):
        check_coverage(spec, {"w": ("bfloat16", (4, 4)), "v": ("bfloat16", (1,))})
    with pytest.raises(ConfigError, match="owners disagree"):
        check_coverage({"o": {"w": ("bfloat16", (4, 4), [((0, 0), (2, 4))])},
                        "p": {"w": ("float32", (4, 4), [((2, 0), (4, 4))])}}, {"w": ("bfloat16", (4, 4))})


@pytest.mark.parametrize("make, match", [
    (lambda: ShardSpec.box("w", (4, 4), (2, 0), (3, 4)), r"exceeds the canonical shape"),
    (lambda: ShardSpec.box("w", (4, 4), (0, 2), (4, 3)), r"exceeds the canonical shape"),
    (lambda: ShardSpec.box("w", (4, 4), (4, 0), (1, 4)), r"base 16 outside"),
    (lambda: ShardSpec((4, 4), (Target("w", (4, 4), 0, (4, 1)),) * 2), r"2 cells for a grid of 1"),
    (lambda: ShardSpec((4, 4), (None,) * 3, ((2,), ())), r"3 cells for a grid of 2"),
    (lambda: ShardSpec((4, 4), (None,) * 3, ((3, 1), ())), r"cuts of dim 0 must be increasing"),
    (lambda: ShardSpec((4, 4), (None,) * 3, ((2, 2), ())), r"cuts of dim 0 must be increasing"),
    (lambda: ShardSpec((4, 4), (None,) * 2, ((4,), ())), r"inside \(0, 4\)"),
    (lambda: ShardSpec((4, 4), (None,) * 2, ((0,), ())), r"inside \(0, 4\)"),
    (lambda: ShardSpec((4, 4), (None,), ((),)), r"cuts has 1 dims"),
    (lambda: ShardSpec((4, 4), (Target("w", (4, 4), 0, (3, 1)),)), r"steps 3 elements"),
    (lambda: ShardSpec((4, 4), (Target("w", (4, 4), 0, (1, 1)),)), r"not a free dimension"),
    (lambda: ShardSpec((4,), (Target("w", (4, 4), 0, (4, 1)),)), r"2 strides for a 1-d cell"),
    (lambda: box_target("w", (4, 4), (0,)), r"offset \(0,\) has 1 dims"),
    (lambda: box_target("w", (4, 4, 4), (0, 0, 0), local_ndim=2), r"a 2-d cell cannot fill a 3-d box"),
    (lambda: row_slice("w", (4, 4), 0, (2, 4)) and ShardSpec((2, 4), (None, None), ((1, 1), ())), r"increasing"),
    (lambda: fused_qkv((12, 4), "q", "k", "v", num_heads=6, num_kv_heads=4, head_dim=1), r"divisible"),
    (lambda: fused_qkv((12, 4), "q", "k", "v", num_heads=8, num_kv_heads=2, head_dim=1, tp_size=4), r"divisible"),
    (lambda: fused_qkv((11, 4), "q", "k", "v", num_heads=8, num_kv_heads=2, head_dim=1), r"cover 12 rows"),
    (lambda: fused_gate_up((6, 4), "g", "u", intermediate=3, tp_size=2), r"divisible by tp_size"),
    (lambda: stacked_experts((2, 5, 4), lambda e: (f"g{e}", f"u{e}")), r"does not split into 2"),
    (lambda: stacked_experts((2, 4, 4), lambda e: f"e{e}", canonical_shape=(4, 4), inner_offset=(2, 0)),
     r"exceeds the canonical shape"),
])
def test_a_spec_that_is_not_a_box_of_its_canonical_tensor_is_refused(make, match):
    with pytest.raises(ShardSpecError, match=match):
        make()


def test_a_shard_whose_tensor_does_not_match_its_spec_is_refused():
    spec = ShardSpec.box("w", (4, 4), (0, 0), (2, 4))
    with pytest.raises(ShardSpecError, match=r"tensor shape \(3, 4\) differs from its spec's local shape \(2, 4\)"):
        resolve_shards({"w0": Shard(torch.zeros(3, 4), spec)})
    with pytest.raises(ShardSpecError, match="is a list"):
        resolve_shards({"w": [1, 2]})
    assert issubclass(ShardSpecError, ConfigError)
