"""The one-pass undo record: an apply that keeps the bits it replaces as it writes them.

Against the two-pass record (read the replaced bits back, then apply) it must give the same bits after
the apply, the same inverse, and a rollback to exactly the bits before, for every encoding (XOR,
OVERWRITE, ADD, DENSE), dense and sparse positions, packs of small tensors, the codec threads, the
compiled kernels and the numpy fallback; and a rollback after an apply that failed part-way must still
restore every bit. Every check compares integer views with ``==``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_ray.codec import FrameMeta, decode_frame, diff_tensor, encode_frames, open_frame
from dcr_ray.codec.bits import bits_view, np_uint, wire_name
from dcr_ray.codec.compiled import kernels, ptrkernels
from dcr_ray.codec.decoding import apply
from dcr_ray.codec.decoding.apply import apply_decoded, swap_item, write_item
from dcr_ray.codec.decoding.decoded import DecodedFrame, DecodedItem
from dcr_ray.codec.decoding.undo import FrameUndo, UndoLog
from dcr_ray.codec.format import Encoding
from dcr_ray.engines.base import TensorBackend
from dcr_ray.engines.hf import TransformersBackend
from test_codec_context import _Backend, small_step  # _Backend: inverse frames written back plainly
from test_codec_packs import experts, pack_of, targets_of

META = FrameMeta(transfer="t", attempt=0, producer="o", payload=0, base=1, target=2)
SPARSE = [Encoding.XOR, Encoding.OVERWRITE, Encoding.ADD]


@pytest.fixture(params=[True, False], ids=["compiled", "numpy"])
def jit(request, monkeypatch):
    if request.param and not (kernels.ENABLED and ptrkernels.ENABLED):
        pytest.skip("numba is not installed (or DCR_RAY_JIT=0): only the numpy path exists here")
    monkeypatch.setattr(kernels, "ENABLED", request.param)
    monkeypatch.setattr(ptrkernels, "ENABLED", request.param)
    return request.param


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(bits_view(a[n]), bits_view(b[n])) for n in a)


def _clone(ts: dict) -> dict:
    return {n: t.clone() for n, t in ts.items()}


def _threaded_step(seed: int):
    """Four tensors with 30% of their elements changed: enough for the codec threads to split a frame.
    ``(old, new, deltas, shapes)``."""
    g = torch.Generator().manual_seed(seed)
    old = {f"w{i}": (torch.randn(150_000 + i, generator=g) * 0.02).to(torch.bfloat16) for i in range(4)}
    new = {n: small_step(t, seed=10 * seed + i, rate=0.3) for i, (n, t) in enumerate(old.items())}
    deltas = [diff_tensor(n, bits_view(old[n]).copy(), new[n]) for n in old]
    shapes = {n: (wire_name(t.dtype), tuple(t.shape)) for n, t in old.items()}
    return old, new, deltas, shapes


@settings(max_examples=60)
@given(width=st.sampled_from([1, 2, 4, 8]), n=st.integers(1, 3000), share=st.sampled_from([0.001, 0.03, 0.5, 1.0]),
       enc=st.sampled_from(SPARSE + [Encoding.DENSE]), seed=st.integers(0, 2**32 - 1), compiled=st.booleans())
def test_one_item_swapped_in_one_pass_writes_and_keeps_exactly_what_two_passes_do(width, n, share, enc, seed,
                                                                                  compiled):
    if compiled and not kernels.ENABLED:
        compiled = False
    rng = np.random.default_rng(seed)
    dt = np_uint(width)
    view = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
    if enc == Encoding.DENSE:
        lo = int(rng.integers(0, n))
        hi = int(rng.integers(lo + 1, n + 1))
        pos, k = None, hi - lo
    else:
        lo, hi = 0, n
        pos = np.flatnonzero(rng.random(n) < share)
        if not len(pos):
            pos = np.array([int(rng.integers(0, n))])
        k = len(pos)
    vals = rng.integers(0, np.iinfo(dt).max, k, dtype=dt, endpoint=True)
    it = DecodedItem("w", enc, lo, hi, pos, vals)
    before = view.copy()
    was = kernels.ENABLED
    kernels.ENABLED = compiled
    try:
        two = view.copy()
        write_item(two, it)
        inverse = swap_item(view, it)
    finally:
        kernels.ENABLED = was
    assert np.array_equal(view, two)
    assert inverse.values.dtype == dt
    if enc == Encoding.DENSE:
        assert inverse.encoding == Encoding.DENSE and (inverse.lo, inverse.hi) == (lo, hi)
        assert np.array_equal(inverse.values, before[lo:hi])
    else:
        assert inverse.encoding == Encoding.OVERWRITE and inverse.positions is pos
        assert np.array_equal(inverse.values, before[pos])
    write_item(view, inverse)
    assert np.array_equal(view, before)


def _model(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": (torch.randn(40_000, generator=g) * 1e-2).to(torch.bfloat16),
            "b": torch.randn(30_000, generator=g) * 10.0 ** torch.randint(-4, 2, (30_000,), generator=g),
            "c": torch.randint(-50, 50, (7_000,), dtype=torch.int32, generator=g),
            "d": torch.randn(2_000, generator=g).to(torch.float16)}


def _frames(old: dict, new: dict, *, dense_crossover: float | None = None, bucket_bytes: int = 8 << 10,
            **kw) -> list[bytes]:
    dkw = {} if dense_crossover is None else {"dense_crossover": dense_crossover}
    deltas = [diff_tensor(n, bits_view(old[n]).copy(), new[n], chunk_elems=4096, **dkw) for n in old]
    return list(encode_frames(deltas, META, bucket_bytes=bucket_bytes, **kw))


def _decoded(data: bytes, shapes: dict, keep_packs: bool = False) -> DecodedFrame:
    return decode_frame(open_frame(data, key=None), shapes=shapes, keep_packs=keep_packs)


@pytest.mark.parametrize("kw", [dict(coding="plain"), dict(coding="context"), dict(mode="overwrite"),
                                dict(coding="plain", dense_crossover=0.0)],
                         ids=["xor", "add-and-class-order", "overwrite", "dense"])
def test_frames_applied_with_a_one_pass_record_match_two_passes_and_roll_back_exactly(jit, kw):
    old = _model(3)
    new = {n: small_step(t, seed=30 + i, rate=0.03 if i % 2 else 0.4) for i, (n, t) in enumerate(old.items())}
    frames = _frames(old, new, **kw)
    assert len(frames) > 2
    shapes = {n: (wire_name(t.dtype), tuple(t.shape)) for n, t in old.items()}
    fused, twice = _clone(old), _clone(old)
    log_fused, log_twice = UndoLog(), UndoLog()
    encodings = set()
    for f in frames:
        d = _decoded(f, shapes)
        encodings |= {it.encoding for it in d.items}
        apply_decoded(d, fused, undo=log_fused.open("t", d))
        d = _decoded(f, shapes)
        log_twice.record("t", d, twice)
        apply_decoded(d, twice)
    assert _same(fused, new) and _same(twice, new)
    assert log_fused.nbytes == log_twice.nbytes > 0
    for a, b in zip(log_fused.records, log_twice.records):
        key = lambda it: (it.name, it.lo)  # the codec threads add items in any order
        for x, y in zip(sorted(a.items, key=key), sorted(b.items, key=key)):
            assert (x.name, x.encoding, x.lo, x.hi) == (y.name, y.encoding, y.lo, y.hi)
            assert np.array_equal(x.values, y.values)
            assert (x.positions is None and y.positions is None) or np.array_equal(x.positions, y.positions)
    if "dense_crossover" in kw:
        assert Encoding.DENSE in encodings
    assert log_fused.rollback(_Backend(fused)) == len(frames)
    assert _same(fused, old)


@pytest.mark.parametrize("kw", [dict(coding="plain"), dict(coding="context"), dict(mode="overwrite")],
                         ids=["xor", "add", "overwrite"])
def test_packs_applied_with_a_one_pass_record_roll_back_exactly_and_a_retry_stacks_on_top(jit, kw):
    old, new = experts(50, rate=0.1, dtype=torch.float32)
    live = targets_of(old, new)
    shapes = {n: (wire_name(t.dtype), tuple(t.shape)) for n, t in new.items()}
    log = UndoLog()
    n = 0
    for attempt_kw in (kw, dict(mode="overwrite")):  # an attempt, then a retry over its writes
        for f in encode_frames([pack_of(old, new)], META, **attempt_kw):
            d = _decoded(f, shapes, keep_packs=True)
            assert d.packs
            apply_decoded(d, live, undo=log.open("t", d))
            n += 1
    assert all(np.array_equal(bits_view(live[k]), bits_view(t)) for k, t in new.items())
    assert log.rollback(_Backend(live)) == n
    assert all(np.array_equal(bits_view(live[k]), old[k]) for k in new)


def test_an_apply_that_fails_part_way_leaves_a_record_of_exactly_what_it_wrote(jit, monkeypatch):
    old = _model(5)
    new = {n: small_step(t, seed=50 + i, rate=0.2) for i, (n, t) in enumerate(old.items())}
    shapes = {n: (wire_name(t.dtype), tuple(t.shape)) for n, t in old.items()}
    live = _clone(old)
    log = UndoLog()
    frames = _frames(old, new, coding="context", bucket_bytes=64 << 10)
    half = len(frames) // 2
    for f in frames[:half]:
        d = _decoded(f, shapes)
        apply_decoded(d, live, undo=log.open("t", d))
    real, calls = apply.swap_item, []

    def fails_on_the_third(view, it):
        calls.append(it.name)
        if len(calls) == 3:
            raise RuntimeError("injected: the backend died mid-frame")
        return real(view, it)

    monkeypatch.setattr(apply, "swap_item", fails_on_the_third)
    d = _decoded(frames[half], shapes)
    assert len(d.items) >= 3
    with pytest.raises(RuntimeError, match="mid-frame"):
        apply_decoded(d, live, undo=log.open("t", d))
    assert len(log.records[-1].items) == 2  # the two items written, and nothing for the rest
    assert not _same(live, old)
    assert log.rollback(_Backend(live)) == half + 1
    assert _same(live, old)


def test_a_frame_large_enough_for_the_codec_threads_fills_its_record_from_every_thread(jit, monkeypatch):
    monkeypatch.setattr(apply.threads, "codec_threads", lambda: 3)
    old, new, deltas, shapes = _threaded_step(9)
    assert sum(d.changed for d in deltas) >= apply.APPLY_PARALLEL_MIN
    live = _clone(old)
    log = UndoLog()
    for f in encode_frames(deltas, META, coding="plain"):
        d = _decoded(f, shapes)
        undo = log.open("t", d)
        apply_decoded(d, live, undo=undo)
        assert sorted((it.name, it.lo) for it in undo.items) == sorted((it.name, it.lo) for it in d.items)
    assert _same(live, new)
    log.rollback(_Backend(live))
    assert _same(live, old)


class _TwoPassBackend(TensorBackend):
    """A backend that overrides nothing optional: the engine's default hook reads back, then applies."""

    applies_packs = True

    def __init__(self, tensors, fail_after_items: int | None = None):
        self.held = tensors
        self.fail_after_items = fail_after_items

    def tensors(self):
        return self.held

    def undo_tensors(self):
        return self.held

    def apply(self, frame: DecodedFrame) -> None:
        if self.fail_after_items is None:
            apply_decoded(frame, self.held)
            return
        for it in frame.items[:self.fail_after_items]:  # a backend that writes some items, then dies
            write_item(bits_view(self.held[it.name]), it)
        raise RuntimeError("injected: died after some items")

    def load_dense(self, tensors) -> None:
        raise NotImplementedError


@pytest.mark.parametrize("backend", ["transformers", "default-hook"])
def test_each_backends_apply_with_undo_rolls_back_to_exactly_the_committed_bits(backend):
    old = _model(11)
    new = {n: small_step(t, seed=110 + i, rate=0.05) for i, (n, t) in enumerate(old.items())}
    if backend == "transformers":
        b = TransformersBackend.from_tensors(_clone(old))
    else:
        b = _TwoPassBackend(_clone(old))
    shapes = b.tensor_specs()
    log = UndoLog()
    for kw in (dict(coding="context"), dict(mode="overwrite")):  # an attempt, then a retry on top of it
        for f in _frames(old, new, **kw):
            d = _decoded(f, shapes, keep_packs=True)
            b.apply_with_undo(d, log.open("t", d))
    assert _same(dict(b.tensors()), new)
    log.rollback(b)
    assert _same(dict(b.tensors()), old)


def test_the_default_hook_covers_a_backend_that_dies_half_way_through_a_frame():
    old = _model(12)
    new = {n: small_step(t, seed=120 + i, rate=0.05) for i, (n, t) in enumerate(old.items())}
    b = _TwoPassBackend(_clone(old), fail_after_items=2)
    shapes = b.tensor_specs()
    log = UndoLog()
    d = _decoded(_frames(old, new, coding="plain")[0], shapes)
    assert len(d.items) > 2
    with pytest.raises(RuntimeError, match="died after some items"):
        b.apply_with_undo(d, log.open("t", d))
    assert not _same(b.held, old)
    b.fail_after_items = None
    log.rollback(b)
    assert _same(b.held, old)


def test_a_record_opened_for_another_transfer_starts_a_new_log():
    old = _model(13)
    shapes = {n: (wire_name(t.dtype), tuple(t.shape)) for n, t in old.items()}
    new = {n: small_step(t, seed=130 + i, rate=0.05) for i, (n, t) in enumerate(old.items())}
    d = _decoded(_frames(old, new)[0], shapes)
    log = UndoLog()
    first = log.open("t1", d)
    assert isinstance(first, FrameUndo) and log.transfer == "t1"
    log.open("t2", d)
    assert log.transfer == "t2" and len(log.records) == 1
    assert (log.records[0].meta.base, log.records[0].meta.target) == (META.target, META.base)


def test_a_threaded_apply_that_fails_on_one_thread_is_still_undone_whole(jit, monkeypatch):
    # the other threads finish their items before the error reaches the caller, so the record holds
    # every write there was and a rollback finds no thread still writing
    monkeypatch.setattr(apply.threads, "codec_threads", lambda: 3)
    old, _, deltas, shapes = _threaded_step(14)
    live = _clone(old)
    frames = list(encode_frames(deltas, META, coding="plain"))
    d = _decoded(frames[0], shapes)
    assert len(d.items) >= 4 and sum(len(it.values) for it in d.items) >= apply.APPLY_PARALLEL_MIN
    real, victim = apply.swap_item, d.items[1].name

    def fails_on_one(view, it):
        if it.name == victim and it.lo == d.items[1].lo:
            raise RuntimeError("injected: one thread died")
        return real(view, it)

    monkeypatch.setattr(apply, "swap_item", fails_on_one)
    log = UndoLog()
    with pytest.raises(RuntimeError, match="one thread died"):
        apply_decoded(d, live, undo=log.open("t", d))
    assert not _same(live, old)
    log.rollback(_Backend(live))
    assert _same(live, old)
