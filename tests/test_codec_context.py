"""The context codings: ADD values (integer differences) and class-order positions.

Every check compares integer views with ``==``. The receiver paths covered are the ones an engine
takes: decode against a shapes table (positions still unresolved), an undo record, the in-place apply,
and a rollback to the old bits; and a retry that overwrites after a partial apply.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_ray.codec import FrameMeta, apply_decoded, decode_frame, diff_tensor, encode_frames, open_frame, read_frame
from dcr_ray.codec.bits import bits_view, np_uint, wire_name
from dcr_ray.codec.compiled import kernels
from dcr_ray.codec.decoding import context
from dcr_ray.codec.decoding.decoded import DecodedFrame, DecodedItem
from dcr_ray.codec.decoding.undo import UndoLog
from dcr_ray.codec.format import Encoding
from dcr_ray.codec.primitives import classorder, estimate, intdiff

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
META = FrameMeta(transfer="t", attempt=0, producer="owner-0", payload=0, base=1, target=2)
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


def ints(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def random_tensor(dtype, n, seed) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, infinities, -0 included); bool 0/1."""
    rng = np.random.default_rng(seed)
    w = torch.empty((), dtype=dtype).element_size()
    bits = rng.integers(0, 256, n * w, dtype=np.uint8).view(np_uint(w))
    if dtype is torch.bool:
        bits = bits & 1
    return torch.from_numpy(bits.copy()).view(_INT[w]).view(dtype)


def small_step(old: torch.Tensor, seed: int, rate: float) -> torch.Tensor:
    """``rate`` of the elements move by a few units in the last place (integer view, wrapping), the
    small-magnitude ones more often: what an optimizer step does to float weights."""
    rng = np.random.default_rng(seed)
    new = old.clone()
    b = bits_view(new)
    n = len(b)
    if old.dtype is torch.bool:
        pos = rng.random(n) < rate
        b[pos] ^= 1
        return new
    p = np.full(n, rate)
    fields = classorder.EXPONENT_FIELDS.get(wire_name(old.dtype))
    if fields:
        shift, nbits = fields
        cls = (b >> b.dtype.type(shift)) & b.dtype.type((1 << nbits) - 1)
        p = np.where(cls < np.median(cls), min(1.0, 4 * rate), rate / 4)
    pos = np.flatnonzero(rng.random(n) < p)
    step = rng.integers(-3, 4, len(pos)).astype(np.int64)
    step[step == 0] = 1
    b[pos] = (b[pos].astype(np.int64) + step).astype(b.dtype)  # wraps on the unsigned view
    return new


def encode(old, new, *, name="w", chunk_elems=1 << 12, coding="context", **kw):
    td = diff_tensor(name, bits_view(old).copy(), new, chunk_elems=chunk_elems)
    return list(encode_frames([td], META, coding=coding, **kw))


def items_of(frames, shapes):
    return [it for f in frames for it in read_frame(f, shapes=shapes).items]


# --- the pieces -------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=50))
def test_zigzag_is_a_bijection_on_words_of_every_width(width, raw):
    d = np.array([x % (1 << (8 * width)) for x in raw], dtype=np_uint(width))
    z = intdiff.zigzag(d)
    assert np.array_equal(intdiff.unzigzag(z), d)
    small = np.array([0, 1, (1 << (8 * width)) - 1, 2, (1 << (8 * width)) - 2], dtype=np_uint(width))  # 0, 1, -1, 2, -2
    assert intdiff.zigzag(small).tolist() == [0, 2, 1, 4, 3]


def test_the_difference_of_new_and_old_is_exact_modulo_the_word_size():
    old = np.array([0xFFFF, 0x0000, 0x3F80, 0x8000], np.uint16)
    new = np.array([0x0000, 0xFFFF, 0x3F7F, 0x7FFF], np.uint16)
    d = intdiff.difference(new, old ^ new)
    assert d.tolist() == [1, 0xFFFF, 0xFFFF, 0xFFFF]
    assert np.array_equal(old + d, new)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("jit", [True, False], ids=["kernels", "numpy"])
@pytest.mark.parametrize("rate", [0.2, 0.01], ids=["dense-walk", "sparse-walk"])
def test_class_ranks_and_positions_are_inverse_and_agree_with_the_definition(dtype, jit, rate, monkeypatch):
    if jit and not kernels.ENABLED:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(kernels, "ENABLED", jit)
    t = random_tensor(getattr(torch, dtype), 3001, seed=len(dtype))
    old = bits_view(t)
    rel = np.flatnonzero(np.random.default_rng(5).random(len(old)) < rate)
    shift, nbits = classorder.EXPONENT_FIELDS[dtype]
    cls = (old.astype(np.uint64) >> np.uint64(shift)) & np.uint64((1 << nbits) - 1)
    order = np.argsort(cls, kind="stable")  # the definition: stable sort by class
    want = np.sort(np.argsort(order)[rel])
    r = classorder.ranks(old, rel, dtype)
    assert np.array_equal(r, want)
    assert np.array_equal(classorder.positions(old, r, dtype), rel)


# --- round trips ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_context_frames_round_trip_bit_exactly_on_every_dtype(dtype):
    old = random_tensor(dtype, 20000, seed=1)
    new = small_step(old, seed=2, rate=0.02)
    frames = encode(old, new)
    target = old.clone()
    for f in frames:
        read = read_frame(f, {"w": target})
        apply_decoded(read, {"w": target})
    assert torch.equal(ints(target), ints(new))
    encs = {it.encoding for it in items_of(frames, {"w": (wire_name(dtype), (20000,))})}
    assert encs <= ({"xor"} if dtype is torch.bool else {"xor", "add"})


def test_optimizer_like_float_steps_travel_as_differences_in_class_order_and_get_smaller():
    g = torch.Generator().manual_seed(7)  # fixed data: the per-item choice is an estimate, not a law
    old = (torch.randn(1 << 16, generator=g) * 10.0 ** torch.randint(-5, 1, (1 << 16,), generator=g)).to(torch.bfloat16)
    new = small_step(old, seed=3, rate=0.01)
    ctx = encode(old, new, coding="context", chunk_elems=1 << 16)
    plain = encode(old, new, coding="plain", chunk_elems=1 << 16)
    shapes = {"w": ("bfloat16", (1 << 16,))}
    assert {(it.encoding, it.ranks is not None) for it in items_of(ctx, shapes)} == {("add", True)}
    assert {(it.encoding, it.ranks is not None) for it in items_of(plain, shapes)} == {("xor", False)}
    assert sum(map(len, ctx)) < sum(map(len, plain))  # (the measured gain on real updates: BENCHMARKS.md)


@pytest.mark.parametrize("jit", [True, False], ids=["kernels", "numpy"])
def test_add_items_wrap_around_the_word_in_both_directions(jit, monkeypatch):
    if jit and not kernels.ENABLED:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(kernels, "ENABLED", jit)
    old = torch.zeros(64, dtype=torch.int16)
    old[:5] = torch.tensor([0x7FFF, -1, 0, -32768, 5])  # bit patterns 7fff ffff 0000 8000 0005
    new = old.clone()
    new[:4] = torch.tensor([-32768, 0, -1, 32767])  # +1, +1, -1, -1 modulo 2**16
    xor = bits_view(old)[:4] ^ bits_view(new)[:4]
    d = intdiff.difference(bits_view(new)[:4].copy(), xor)
    item = DecodedItem("w", Encoding.ADD, 0, 64, np.arange(4), d)
    target = old.clone()
    apply_decoded(DecodedFrame(META, [item]), {"w": target})
    assert torch.equal(target, new)


def test_retries_overwrite_at_flat_positions_whatever_the_first_attempt_used():
    old = (torch.randn(4096) * 1e-3).to(torch.bfloat16)
    new = small_step(old, seed=4, rate=0.05)
    items = items_of(encode(old, new, mode="overwrite"), {"w": ("bfloat16", (4096,))})
    assert {it.encoding for it in items} == {"ow"} and all(it.ranks is None for it in items)


# --- the engine's path: shapes-only decode, undo record, apply, rollback; a retry after a partial apply
class _Backend:
    def __init__(self, tensors):
        self.tensors = tensors

    def apply(self, frame: DecodedFrame) -> None:
        apply_decoded(frame, self.tensors)

    def flush(self) -> None:
        pass


def _model(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a": (torch.randn(3000, generator=g) * 1e-2).to(torch.bfloat16),
            "b": torch.randn(2000, generator=g) * 10.0 ** torch.randint(-4, 2, (2000,), generator=g),
            "c": torch.randint(-50, 50, (700,), dtype=torch.int32, generator=g)}


def _step(model, seed):
    return {n: small_step(t, seed=seed + i, rate=0.05) for i, (n, t) in enumerate(model.items())}


def _frames(old, new, *, coding="context", **kw):
    deltas = [diff_tensor(n, bits_view(old[n]).copy(), new[n], chunk_elems=1024) for n in old]
    return list(encode_frames(deltas, META, bucket_bytes=256, coding=coding, **kw))


def test_an_engine_applies_context_frames_decoded_against_shapes_and_rolls_them_back_exactly():
    old = _model(7)
    new = _step(old, 70)
    frames = _frames(old, new)
    assert len(frames) > 2
    live = {n: t.clone() for n, t in old.items()}
    shapes = {n: (wire_name(t.dtype), tuple(t.shape)) for n, t in live.items()}
    undo, backend = UndoLog(), _Backend(live)
    seen = set()
    for f in frames:
        frame = decode_frame(open_frame(f, key=None), shapes=shapes, expect_base=1)
        assert all(it.positions is None for it in frame.items if it.ranks is not None)
        seen |= {(it.encoding.value, it.ranks is not None) for it in frame.items}
        undo.record("t", frame, live)
        backend.apply(frame)
    assert {("add", True), ("add", False)} <= seen  # class order (floats) and flat order (int32)
    for n in new:
        assert torch.equal(ints(live[n]), ints(new[n]))
    assert undo.rollback(backend) == len(frames)
    for n in old:
        assert torch.equal(ints(live[n]), ints(old[n])), f"{n} not rolled back exactly"


def test_a_partly_applied_first_attempt_rolls_back_exactly_and_a_retry_overwrites_it_exactly():
    old = _model(8)
    new = _step(old, 80)
    first = _frames(old, new)
    live = {n: t.clone() for n, t in old.items()}
    shapes = {n: (wire_name(t.dtype), tuple(t.shape)) for n, t in live.items()}
    undo, backend = UndoLog(), _Backend(live)
    for f in first[: len(first) // 2]:  # the attempt dies half-way
        frame = decode_frame(open_frame(f, key=None), shapes=shapes)
        undo.record("t", frame, live)
        backend.apply(frame)
    undo.rollback(backend)
    for n in old:
        assert torch.equal(ints(live[n]), ints(old[n]))
    for f in first[: len(first) // 2]:  # again half-way, and this time no rollback: a retry repairs it
        apply_decoded(read_frame(f, shapes=shapes), live)
    for f in _frames(old, new, mode="overwrite"):
        apply_decoded(read_frame(f, shapes=shapes), live)
    for n in new:
        assert torch.equal(ints(live[n]), ints(new[n]))


def test_owners_code_as_configured_and_auto_is_decided_per_refit():
    from dcr_ray.config import CodecConfig
    from dcr_ray.errors import ConfigError

    # context coding costs both sides CPU: "auto" (the default) picks it where the link bounds a refit
    assert CodecConfig().coding == "auto" and CodecConfig(coding="context").coding == "context"
    with pytest.raises(ConfigError, match=r"coding must be one of \('auto', 'context', 'plain'\)"):
        CodecConfig(coding="zigzag")


def test_the_library_default_writes_the_frames_of_earlier_releases():
    old = (torch.randn(4096) * 1e-3).to(torch.bfloat16)
    new = small_step(old, seed=6, rate=0.05)
    td = diff_tensor("w", bits_view(old).copy(), new, chunk_elems=4096)
    assert list(encode_frames([td], META)) == list(encode_frames([td], META, coding="plain"))


def test_context_items_made_absolute_for_a_capture_path_give_the_same_bits():
    old = _model(9)
    new = _step(old, 90)
    shapes = {n: (wire_name(t.dtype), tuple(t.shape)) for n, t in old.items()}
    reads = []
    live = {n: t.clone() for n, t in old.items()}
    for f in _frames(old, new):
        items = read_frame(f, shapes=shapes).items
        flat = context.absolute(items, lambda n: reads.append(n) or old[n])
        assert {it.encoding.value for it in flat} <= {"xor", "ow", "dense"}
        assert all(it.positions is not None for it in flat)
        apply_decoded(DecodedFrame(META, flat), live)
    for n in new:
        assert torch.equal(ints(live[n]), ints(new[n]))
    assert reads and len(reads) <= sum(len(read_frame(f, shapes=shapes).items) for f in _frames(old, new))


def test_a_sender_skips_the_class_walk_where_changes_do_not_depend_on_magnitude():
    g = torch.Generator().manual_seed(11)
    old = bits_view((torch.randn(1 << 16, generator=g) * 10.0 ** torch.randint(-5, 1, (1 << 16,), generator=g))
                    .to(torch.bfloat16))
    rng = np.random.default_rng(11)
    uniform = np.flatnonzero(rng.random(len(old)) < 0.02)
    cls = (old >> np.uint16(7)) & np.uint16(0xFF)
    by_size = np.flatnonzero(rng.random(len(old)) < np.where(cls < np.median(cls), 0.04, 0.001))
    assert not estimate.class_order_promising(old, uniform, "bfloat16")
    assert estimate.class_order_promising(old, by_size, "bfloat16")
    assert not estimate.class_order_promising(old, by_size, "int16")  # no exponent: never class order
