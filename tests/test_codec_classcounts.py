"""The receiver's kept class counts: one walk when they are right, the same positions whatever they are.

Every check compares integer views and positions with ``==`` / ``np.array_equal``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_ray.codec import FrameMeta, apply_decoded, diff_tensor, encode_frames, read_frame
from dcr_ray.codec.bits import bits_view, wire_name
from dcr_ray.codec.compiled import kernels
from dcr_ray.codec.decoding import classcounts
from dcr_ray.codec.decoding.undo import UndoLog
from dcr_ray.codec.primitives import classorder

META = FrameMeta(transfer="t", attempt=0, producer="owner-0", payload=0, base=1, target=2)
FLOATS = ["bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"]


@pytest.fixture(autouse=True)
def _fresh_counts():
    classcounts.forget()
    yield
    classcounts.forget()


def weights(n: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(dtype)


def optimizer_step(old: torch.Tensor, seed: int, rate: float = 0.02) -> torch.Tensor:
    """A change that depends on magnitude (small weights move more often), some crossing a power of two."""
    rng = np.random.default_rng(seed)
    new = old.clone()
    b = bits_view(new)
    mag = np.abs(old.float().numpy())
    pos = np.flatnonzero(rng.random(len(b)) < np.minimum(1.0, rate * 0.01 / np.maximum(mag, 1e-4)))
    step = rng.integers(-2, 3, len(pos)).astype(np.int64)
    step[step == 0] = 1
    b[pos] = (b[pos].astype(np.int64) + step).astype(b.dtype)
    return new


def reference_positions(old: np.ndarray, r: np.ndarray, dtype: str) -> np.ndarray:
    """The definition: the elements sorted stably by class, the ranks' elements, sorted."""
    shift, nbits = classorder.EXPONENT_FIELDS[dtype]
    cls = (old.astype(np.uint64) >> np.uint64(shift)) & np.uint64((1 << nbits) - 1)
    return np.sort(np.argsort(cls, kind="stable")[r])


def random_ranks(n: int, rate: float, seed: int) -> np.ndarray:
    return np.flatnonzero(np.random.default_rng(seed).random(n) < rate).astype(np.int64)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rate", [0.2, 0.01], ids=["dense-walk", "sparse-walk"])
def test_a_right_count_hint_places_in_one_walk_and_a_wrong_one_gives_the_same_positions(dtype, rate):
    t = weights(5003, seed=len(dtype), dtype=torch.float32).to(getattr(torch, dtype))
    old = bits_view(t)
    r = random_ranks(len(old), rate, seed=3)
    want = reference_positions(old, r, dtype)
    cold = classorder.place(old, r, dtype)
    assert np.array_equal(cold.positions, want) and not cold.counts_were_right
    assert np.array_equal(cold.counts, classorder.counts(old, dtype))
    warm = classorder.place(old, r, dtype, cold.counts)
    assert warm.counts_were_right and np.array_equal(warm.positions, want)
    assert np.array_equal(warm.hits, np.bincount(classorder.classes(old[want], dtype), minlength=len(cold.counts)))
    ncls = len(cold.counts)
    rng = np.random.default_rng(0)
    wrong = [np.roll(cold.counts, 1), rng.multinomial(len(old), np.ones(ncls) / ncls).astype(np.int64),
             np.eye(ncls, dtype=np.int64)[0] * len(old), np.zeros(ncls, np.int64), -cold.counts,
             np.zeros(ncls + 3, np.int64)]
    for hint in wrong:
        got = classorder.place(old, r, dtype, hint)
        assert np.array_equal(got.positions, want) and np.array_equal(got.counts, cold.counts)
        assert got.counts_were_right == np.array_equal(hint, cold.counts)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(FLOATS), st.integers(1, 700), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1),
       st.booleans())
def test_any_count_hint_gives_the_positions_of_the_definition(dtype, n, rate, seed, jit):
    if jit and not kernels.ENABLED:
        return
    rng = np.random.default_rng(seed)
    width = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}.get(dtype, 1)
    old = rng.integers(0, 256, n * width, dtype=np.uint8).view(f"<u{width}")
    r = np.flatnonzero(rng.random(n) < rate).astype(np.int64)
    ncls = classorder.class_count(dtype)
    hint = rng.multinomial(n, rng.dirichlet(np.ones(ncls))).astype(np.int64)
    saved = kernels.ENABLED
    kernels.ENABLED = jit
    try:
        got = classorder.place(old, r, dtype, hint)
    finally:
        kernels.ENABLED = saved
    assert np.array_equal(got.positions, reference_positions(old, r, dtype))


def frames_of(old: torch.Tensor, new: torch.Tensor, chunk: int = 1 << 18) -> list[bytes]:
    td = diff_tensor("w", bits_view(old).copy(), new, chunk_elems=chunk)
    return list(encode_frames([td], META, coding="context"))


def counted_walks(monkeypatch) -> list:
    """Record whether each class-order placement's kept counts were right."""
    seen = []
    real = classorder.place

    def spy(old, r, dtype, hint=None):
        got = real(old, r, dtype, hint)
        seen.append(got.counts_were_right)
        return got

    monkeypatch.setattr(classorder, "place", spy)
    return seen


def test_a_receiver_keeps_the_counts_of_the_bits_it_holds_across_refits(monkeypatch):
    seen = counted_walks(monkeypatch)
    versions = [weights(1 << 20, seed=1)]
    for k in range(3):
        versions.append(optimizer_step(versions[-1], seed=10 + k))
    live = {"w": versions[0].clone()}
    for k in range(3):
        seen.clear()
        for f in frames_of(versions[k], versions[k + 1]):
            apply_decoded(read_frame(f, live), live)
        assert torch.equal(live["w"].view(torch.int16), versions[k + 1].view(torch.int16))
        assert seen and all(seen) == (k > 0)  # the first refit counts; later ones find the counts kept
        for (_, _, lo, hi), (counts, _) in classcounts.snapshot().items():
            assert np.array_equal(counts, classorder.counts(bits_view(live["w"])[lo:hi], "bfloat16"))


def test_bits_written_another_way_cost_a_second_walk_never_a_wrong_position(monkeypatch):
    seen = counted_walks(monkeypatch)
    v0 = weights(1 << 19, seed=2)
    v1 = optimizer_step(v0, seed=20)
    v2 = optimizer_step(v1, seed=21)
    live = {"w": v0.clone()}
    for f in frames_of(v0, v1):
        apply_decoded(read_frame(f, live), live)
    # a dense copy of other bits (a peer copy, a bootstrap) behind the kept counts' back, then v1 again
    live["w"].copy_(weights(1 << 19, seed=99))
    live["w"].copy_(v1)  # the same bits: the kept counts are right again
    seen.clear()
    for f in frames_of(v1, v2):
        apply_decoded(read_frame(f, live), live)
    assert torch.equal(live["w"].view(torch.int16), v2.view(torch.int16)) and all(seen)
    # a rollback writes through OVERWRITE items the counts do not follow: the next walk finds out
    undo = UndoLog()
    v3 = optimizer_step(v2, seed=22)
    for f in frames_of(v2, v3):
        d = read_frame(f, live)
        undo.record("t3", d, live)
        apply_decoded(d, live)
    undo.rollback(_Backend(live))
    assert torch.equal(live["w"].view(torch.int16), v2.view(torch.int16))
    seen.clear()
    for f in frames_of(v2, v3):
        apply_decoded(read_frame(f, live), live)
    assert torch.equal(live["w"].view(torch.int16), v3.view(torch.int16))
    assert seen and not all(seen)


class _Backend:
    def __init__(self, tensors):
        self.tensors = tensors

    def apply(self, frame):
        apply_decoded(frame, self.tensors)

    def flush(self):
        pass


def test_short_items_keep_no_counts_and_all_counts_stay_within_their_bound(monkeypatch):
    v0 = weights(1 << 16, seed=3)
    live = {"w": v0.clone()}
    for f in frames_of(v0, optimizer_step(v0, seed=30), chunk=1 << 14):
        apply_decoded(read_frame(f, live), live)
    assert classcounts.snapshot() == {}  # every item under MIN_SPAN
    monkeypatch.setattr(classcounts, "MAX_BYTES", 3 * 2 * 256 * 8)  # room for three BF16 entries
    big = weights(1 << 20, seed=4)
    live = {"w": big.clone()}
    for f in frames_of(big, optimizer_step(big, seed=40), chunk=classcounts.MIN_SPAN):
        apply_decoded(read_frame(f, live), live)
    kept = classcounts.snapshot()
    assert len(kept) == 3  # of the eight items, the three used last
    span_bytes = classcounts.MIN_SPAN * 2
    assert all(2 * c.nbytes <= span_bytes / 64 for c, _ in kept.values())  # 1/64 of a BF16 item, as stated


def test_wire_dtype_of_the_counts_follows_the_tensor():
    t = weights(1 << 18, seed=5, dtype=torch.float32)
    new = optimizer_step(t, seed=50)
    live = {"w": t.clone()}
    for f in frames_of(t, new):
        apply_decoded(read_frame(f, live), live)
    assert torch.equal(live["w"].view(torch.int32), new.view(torch.int32))
    (counts, _), = classcounts.snapshot().values()
    assert len(counts) == classorder.class_count(wire_name(torch.float32))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("jit", [True, False], ids=["kernels", "numpy"])
def test_the_classes_at_some_positions_are_counted_the_same_by_kernels_and_numpy(dtype, jit, monkeypatch):
    if jit and not kernels.ENABLED:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(kernels, "ENABLED", jit)
    rng = np.random.default_rng(7)
    width = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}.get(dtype, 1)
    view = rng.integers(0, 256, 3000 * width, dtype=np.uint8).view(f"<u{width}")
    pos = np.flatnonzero(rng.random(3000) < 0.1)
    want = np.bincount(classorder.classes(view[pos], dtype), minlength=classorder.class_count(dtype))
    assert np.array_equal(classorder.counts_at(view, pos, dtype), want)
