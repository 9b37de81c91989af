"""Property tests: diff -> frames -> apply reproduces the new bits exactly, for every wire dtype.

Old and new tensors are raw integer bit patterns (so NaN payloads, +0/-0, infinities and subnormals
all occur), mixed with each dtype's special patterns and with targeted change kinds (only sign flips
of zeros, NaN -> NaN with another payload, low-mantissa flips, 100% change, no change). Sizes sit
around small chunk sizes and bucket sizes so chunk and frame boundaries are crossed often.

Equality is only ever ``torch.equal`` on integer views of the bits: never approximate comparisons, never float ``==``
on floating-point values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dcr_ray.codec import (
    BaselineStore,
    FrameMeta,
    apply_frame,
    diff_tensor,
    encode_frames,
    full_delta,
    read_frame,
)
from dcr_ray.codec.bits import WIRE_DTYPES, bits_equal, bits_view

# --- bit helpers ------------------------------------------------------------------------------------
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

ALL_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn,
                torch.float8_e5m2]
KEY = b"shared-transfer-secret"


def width(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def ints(t: torch.Tensor) -> torch.Tensor:
    """Integer view of ``t``'s bits (bool -> uint8): the only form in which tensors are compared."""
    return t.view(_TORCH_INT[t.element_size()])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(ints(got), ints(want)), "stored bits differ"


def tensor_from_bits(bits: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` holding the unsigned bit patterns ``bits``."""
    w = width(dtype)
    if not isinstance(bits, np.ndarray):  # a list of Python ints (may exceed the int64 range)
        bits = np.array(bits, dtype=np.uint64)
    raw = np.ascontiguousarray(bits, dtype=_NP_UINT[w]).view(_NP_INT[w]).copy()
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def uint_bits(t: torch.Tensor) -> np.ndarray:
    return bits_view(t.contiguous()).copy()


# --- special bit patterns per dtype ------------------------------------------------------------------
def _float_specials(exp_bits: int, man_bits: int, has_inf: bool = True):
    """(special patterns, NaN patterns, infinity patterns) of an IEEE-like format."""
    w = 1 + exp_bits + man_bits
    sign = 1 << (w - 1)
    exp_all = ((1 << exp_bits) - 1) << man_bits
    man_all = (1 << man_bits) - 1
    nans = [exp_all | 1, exp_all | man_all, exp_all | (1 << (man_bits - 1)), exp_all | (man_all >> 1)]
    if not has_inf:  # float8_e4m3fn: only S.1111.111 is NaN, there is no infinity
        nans = [exp_all | man_all]
    nans = sorted({v | s for v in nans for s in (0, sign)})
    specials = [0, sign, 1, man_all, sign | 1, sign | man_all,  # +-0, smallest/largest subnormals
                1 << man_bits, (exp_all - (1 << man_bits)) | man_all]  # smallest normal, largest finite
    infs = [exp_all, exp_all | sign] if has_inf else []
    return sorted(set(specials + nans + infs)), nans, infs


SPECIALS: dict[torch.dtype, list[int]] = {}
NANS: dict[torch.dtype, list[int]] = {}
INFS: dict[torch.dtype, list[int]] = {}
for _dt, (_e, _m, _inf) in {torch.float16: (5, 10, True), torch.bfloat16: (8, 7, True),
                            torch.float32: (8, 23, True), torch.float64: (11, 52, True),
                            torch.float8_e4m3fn: (4, 3, False), torch.float8_e5m2: (5, 2, True)}.items():
    SPECIALS[_dt], NANS[_dt], INFS[_dt] = _float_specials(_e, _m, _inf)
for _dt in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
    _w = 8 * width(_dt)
    SPECIALS[_dt] = [0, 1, (1 << _w) - 1, 1 << (_w - 1), (1 << (_w - 1)) - 1]
SPECIALS[torch.bool] = [0, 1]


def test_the_special_patterns_really_are_what_their_names_say():
    for dt in FLOAT_DTYPES:
        sign = 1 << (8 * width(dt) - 1)
        vals = tensor_from_bits(NANS[dt], dt, (-1,)).float()
        assert torch.isnan(vals).all(), dt
        zeros = tensor_from_bits([0, sign], dt, (-1,)).float()
        assert (zeros == 0).all() and torch.signbit(zeros).tolist() == [False, True]
        if INFS[dt]:
            assert torch.isinf(tensor_from_bits(INFS[dt], dt, (-1,)).float()).all()
        sub = tensor_from_bits([1], dt, (-1,)).double()
        assert 0 < sub.item() < torch.finfo(dt).tiny  # a subnormal


# --- strategies -----------------------------------------------------------------------------------
CHANGE_KINDS = ("random", "sparse_low_bits", "blocks", "none", "all", "independent", "zero_sign_flips",
                "nan_payloads")


def max_bits(dtype: torch.dtype) -> int:
    return 1 if dtype is torch.bool else (1 << (8 * width(dtype))) - 1


@st.composite
def sizes(draw, chunk: int) -> int:
    near = [0, 1, 2, chunk - 1, chunk, chunk + 1, 2 * chunk - 1, 2 * chunk, 2 * chunk + 1, 3 * chunk + 5]
    return draw(st.one_of(st.sampled_from(near), st.integers(1, 4 * chunk)))


@st.composite
def shapes_for(draw, n: int) -> tuple[int, ...]:
    if n == 0:
        return draw(st.sampled_from([(0,), (0, 3), (2, 0)]))
    if n == 1:
        return draw(st.sampled_from([(), (1,), (1, 1)]))
    divisors = [d for d in range(2, min(n, 9)) if n % d == 0]
    if divisors and draw(st.booleans()):
        d = draw(st.sampled_from(divisors))
        return (d, n // d)
    return (n,)


@st.composite
def old_and_new_bits(draw, dtype: torch.dtype, n: int, kind: str | None = None):
    """(old, new) unsigned bit arrays of ``n`` elements and the change kind that produced them."""
    npdt = _NP_UINT[width(dtype)]
    top = max_bits(dtype)
    any_bits = st.one_of(st.sampled_from(SPECIALS[dtype]), st.integers(0, top))
    every = st.nothing()  # no "fill" value: every element is drawn on its own
    if kind is None:
        kinds = [k for k in CHANGE_KINDS if dtype in FLOAT_DTYPES or k != "nan_payloads"]
        kind = draw(st.sampled_from(kinds), label="change kind")
    if kind == "nan_payloads" and dtype not in FLOAT_DTYPES:
        kind = "random"
    sign = 1 << (8 * width(dtype) - 1) if dtype is not torch.bool else 1
    if kind == "zero_sign_flips":  # every value is +0 or -0 before and after: equal as floats
        old = draw(hnp.arrays(npdt, n, elements=st.sampled_from([0, sign]), fill=every))
        flips = draw(hnp.arrays(np.bool_, n, elements=st.booleans(), fill=every))
        return old, old ^ np.where(flips, npdt(sign), npdt(0)), kind
    if kind == "nan_payloads":  # NaN before and after, possibly with another payload or sign
        nans = st.sampled_from(NANS[dtype])
        old = draw(hnp.arrays(npdt, n, elements=nans, fill=every))
        return old, draw(hnp.arrays(npdt, n, elements=nans, fill=every)), kind
    old = draw(hnp.arrays(npdt, n, elements=any_bits))
    if kind == "independent":
        return old, draw(hnp.arrays(npdt, n, elements=any_bits, fill=every)), kind
    mask = np.zeros(n, npdt)
    if kind == "all":
        mask[:] = draw(hnp.arrays(npdt, n, elements=st.integers(1, top), fill=every))
    elif kind != "none" and n:
        if kind == "sparse_low_bits":  # what an Adam step does to BF16: a few low mantissa bits
            where = draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=max(1, n // 8)))
            flips = st.integers(1, min(top, 7))
        elif kind == "blocks":  # rows that change together: the runs location mode
            where = set()
            for _ in range(draw(st.integers(1, 2))):
                a = draw(st.integers(0, n - 1))
                where |= set(range(a, min(n, a + draw(st.integers(1, 12)))))
            flips = st.integers(1, top)
        else:
            where = draw(st.sets(st.integers(0, n - 1), min_size=1))
            flips = st.one_of(st.integers(1, top), st.sampled_from(sorted({1, sign, top})))
        where = sorted(where)
        mask[where] = draw(hnp.arrays(npdt, len(where), elements=flips, fill=every))
    return old, old ^ mask, kind


@st.composite
def tensor_pairs(draw, dtype: torch.dtype, chunk: int, count: int):
    """``count`` named (old, new) tensor pairs of ``dtype``."""
    out = {}
    for i in range(count):
        n = draw(sizes(chunk))
        shape = draw(shapes_for(n))
        old, new, _ = draw(old_and_new_bits(dtype, n))
        out[f"layers.{i}.weight"] = (tensor_from_bits(old, dtype, shape), tensor_from_bits(new, dtype, shape))
    return out


# --- checks ---------------------------------------------------------------------------------------
def check_changed_set(td, old: torch.Tensor, new: torch.Tensor, chunk: int) -> None:
    """The changed set says exactly which elements differ, chunk by chunk, with the right bits."""
    ob, nb = uint_bits(old), uint_bits(new)
    differ = np.flatnonzero(ob != nb)
    assert td.changed == sum(c.count for c in td.chunks)
    covered = []
    last_hi = 0
    for ch in td.chunks:
        assert ch.lo % chunk == 0 and ch.hi == min(ch.lo + chunk, len(ob)) and ch.lo >= last_hi
        last_hi = ch.hi
        here = differ[(differ >= ch.lo) & (differ < ch.hi)]
        assert len(here) > 0, "a chunk without changes must not be emitted"
        if ch.is_dense:
            assert ch.count == ch.hi - ch.lo
            assert np.array_equal(ch.dense, nb[ch.lo:ch.hi])
        else:
            pos = ch.positions()
            assert np.array_equal(pos, here) and ch.count == len(here)
            assert np.array_equal(ch.xor, ob[pos] ^ nb[pos])
            assert np.array_equal(ch.new, nb[pos])
        covered.append(here)
    all_covered = np.concatenate(covered) if covered else np.empty(0, np.int64)
    assert np.array_equal(all_covered, differ), "every changed element lies in exactly one emitted chunk"


def meta(base: int = 6, payload: int = 0, attempt: int = 0) -> FrameMeta:
    return FrameMeta(transfer="refit-7", attempt=attempt, producer="owner-0", payload=payload, base=base,
                     target=base + 1)


# --- properties -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@settings(max_examples=30)
@given(data=st.data())
def test_applying_every_frame_to_the_old_bits_gives_the_new_bits_exactly(dtype, data):
    chunk = data.draw(st.sampled_from([8, 16, 17]), label="chunk_elems")
    pairs = data.draw(tensor_pairs(dtype, chunk, data.draw(st.integers(1, 3), label="tensors")))
    mode = data.draw(st.sampled_from(["mixed", "overwrite"]), label="mode")
    key = data.draw(st.sampled_from([None, KEY]), label="key")
    bucket = data.draw(st.sampled_from([1, 7, 40, 1 << 20]), label="bucket_bytes")
    xor_ok = {name: data.draw(st.booleans()) for name in pairs}
    first_payload = data.draw(st.integers(0, 3))

    deltas = []
    for name, (old, new) in pairs.items():
        td = diff_tensor(name, uint_bits(old), new, chunk_elems=chunk)
        check_changed_set(td, old, new, chunk)
        assert td.dtype == str(dtype).removeprefix("torch.") and td.shape == tuple(new.shape)
        for ch in td.chunks:
            event("dense chunk" if ch.is_dense else f"sparse chunk, {ch.loc.mode} w{ch.loc.width}")
        deltas.append(td)
    frames = list(encode_frames(deltas, meta(payload=first_payload), mode=mode, bucket_bytes=bucket, key=key,
                                xor_ok=xor_ok))
    nchunks = sum(len(td.chunks) for td in deltas)
    if nchunks == 0:
        assert frames == [], "an empty changed set needs no payload"
    event(f"{len(frames)} frames" if len(frames) < 3 else "3+ frames")
    if bucket == 1:
        assert len(frames) == nchunks, "a chunk is never split and a full bucket closes its frame"
    assert len(frames) <= max(nchunks, 1)

    targets = {name: old.clone() for name, (old, _) in pairs.items()}
    decoded = [read_frame(f, targets, key=key, expect_base=6) for f in frames]
    assert [d.meta.payload for d in decoded] == list(range(first_payload, first_payload + len(frames)))
    assert sum(d.changed for d in decoded) == sum(td.changed for td in deltas)
    for d in decoded:
        for it in d.items:
            if it.encoding != "dense":
                want = {"xor", "add"} if (mode == "mixed" and xor_ok[it.name]) else {"ow"}
                assert it.encoding in want
    for name, (old, _) in pairs.items():  # reading wrote nothing
        assert_same_bits(targets[name], old)

    order = data.draw(st.permutations(range(len(frames))), label="apply order")
    for i in order:  # items of distinct frames never overlap, so any order gives the same bits
        apply_frame(frames[i], targets, key=key, expect_base=6)
    for name, (_, new) in pairs.items():
        assert_same_bits(targets[name], new)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@settings(max_examples=12)
@given(data=st.data())
def test_an_overwrite_retry_repairs_a_target_that_xor_frames_left_half_applied(dtype, data):
    chunk = data.draw(st.sampled_from([8, 17]))
    pairs = data.draw(tensor_pairs(dtype, chunk, 2))
    deltas = [diff_tensor(n, uint_bits(o), w, chunk_elems=chunk) for n, (o, w) in pairs.items()]
    first = list(encode_frames(deltas, meta(attempt=0), mode="mixed", bucket_bytes=1))
    retry = list(encode_frames(deltas, meta(attempt=1), mode="overwrite", bucket_bytes=1))
    targets = {name: old.clone() for name, (old, _) in pairs.items()}
    applied = data.draw(st.lists(st.sampled_from(range(len(first))), unique=True) if first else st.just([]))
    for i in applied:  # an attempt that died half-way
        apply_frame(first[i], targets)
    for f in retry:
        apply_frame(f, targets)
    for f in retry[: len(retry) // 2]:  # a retried delivery of an overwrite frame changes nothing
        apply_frame(f, targets)
    for name, (_, new) in pairs.items():
        assert_same_bits(targets[name], new)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@settings(max_examples=10)
@given(data=st.data())
def test_a_dense_bootstrap_gives_any_receiver_the_new_bits(dtype, data):
    chunk = data.draw(st.sampled_from([8, 16, 17]))
    pairs = data.draw(tensor_pairs(dtype, chunk, 2))
    deltas = [full_delta(n, w, chunk_elems=chunk) for n, (_, w) in pairs.items()]
    for td, (_, w) in zip(deltas, pairs.values()):
        assert all(c.is_dense for c in td.chunks) and td.changed == w.numel()
    targets = {n: o.clone() for n, (o, _) in pairs.items()}  # whatever the receiver held before
    for f in encode_frames(deltas, meta(), mode=data.draw(st.sampled_from(["mixed", "overwrite"])),
                           bucket_bytes=data.draw(st.sampled_from([1, 50, 1 << 20]))):
        apply_frame(f, targets)
    for name, (_, new) in pairs.items():
        assert_same_bits(targets[name], new)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@settings(max_examples=10)
@given(data=st.data())
def test_a_baseline_store_promotes_exactly_the_new_bits_and_discard_keeps_the_old(dtype, data):
    chunk = data.draw(st.sampled_from([8, 16, 17]))
    in_memory = data.draw(st.booleans(), label="in_memory")
    pairs = data.draw(tensor_pairs(dtype, chunk, 2))
    store = BaselineStore(in_memory=in_memory, chunk_elems=chunk)
    try:
        for name, (old, _) in pairs.items():
            store.add(name, old)
        assert all(isinstance(store.bits(n), np.memmap) != in_memory for n in pairs if pairs[n][0].numel())

        # attempt 1 is abandoned: the baseline keeps the old bits and the retry recomputes the same set
        store.begin(1)
        first = [store.diff(name, new) for name, (_, new) in pairs.items()]
        for td in first:
            store.add_pending(td)
        store.discard()
        assert store.version == 0 and store.pending_version is None
        for name, (old, _) in pairs.items():
            assert np.array_equal(store.bits(name), uint_bits(old))
            assert_same_bits(store.tensor(name), old)

        store.begin(1)
        again = [store.diff(name, new) for name, (_, new) in pairs.items()]
        m = meta(base=0)
        assert list(encode_frames(first, m, bucket_bytes=1)) == list(encode_frames(again, m, bucket_bytes=1))
        for td, (name, (old, new)) in zip(again, pairs.items()):
            check_changed_set(td, old, new, chunk)
            store.add_pending(td)
        written = store.promote(1)
        assert written == sum(td.changed for td in again)
        assert store.version == 1 and store.promote(1) == 0, "a repeated promote is a no-op"
        for name, (_, new) in pairs.items():
            assert np.array_equal(store.bits(name), uint_bits(new))
            assert_same_bits(store.tensor(name), new)
            assert store.diff(name, new).chunks == [], "nothing changed since the promoted version"
    finally:
        store.close()


@settings(max_examples=15)
@given(data=st.data())
def test_a_receiver_and_its_owner_baseline_agree_bit_for_bit_after_every_committed_step(data):
    """Several refits in a row, mixed dtypes in one transfer, each frame built on the committed base."""
    chunk = data.draw(st.sampled_from([8, 17]))
    dtypes = data.draw(st.lists(st.sampled_from(ALL_DTYPES), min_size=1, max_size=4))
    current = {}
    for i, dt in enumerate(dtypes):
        n = data.draw(sizes(chunk))
        shape = data.draw(shapes_for(n))
        bits, _, _ = data.draw(old_and_new_bits(dt, n, "none"))
        current[f"t{i}"] = tensor_from_bits(bits, dt, shape)
    store = BaselineStore(in_memory=data.draw(st.booleans()), chunk_elems=chunk)
    engine = {name: t.clone() for name, t in current.items()}
    try:
        for name, t in current.items():
            store.add(name, t)
        for step in range(1, 4):
            for name, t in current.items():  # the trainer's optimizer step
                _, new, _ = data.draw(old_and_new_bits(t.dtype, t.numel()))
                current[name] = tensor_from_bits(new, t.dtype, t.shape)
            store.begin(step)
            deltas = []
            for name, t in current.items():
                deltas.append(store.diff(name, t))
                store.add_pending(deltas[-1])
            for f in encode_frames(deltas, meta(base=step - 1), bucket_bytes=data.draw(st.sampled_from([1, 64]))):
                apply_frame(f, engine, expect_base=step - 1)
            store.promote(step)
            for name, t in current.items():
                assert_same_bits(engine[name], t)
                assert_same_bits(store.tensor(name), t)
    finally:
        store.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float64],
                         ids=lambda d: str(d).removeprefix("torch."))
@settings(max_examples=15)
@given(data=st.data())
def test_changes_far_apart_use_wide_or_escaped_location_symbols_and_still_round_trip(dtype, data):
    n = data.draw(st.sampled_from([300, 5_000, 70_000, 200_000]), label="numel")
    chunk = data.draw(st.sampled_from([n, 1 << 17, 4096]), label="chunk_elems")
    where = sorted(data.draw(st.sets(st.one_of(st.integers(0, 40), st.integers(0, n - 1)), min_size=1,
                                     max_size=60), label="changed"))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    old_bits = rng.integers(0, max_bits(dtype), n, dtype=np.uint64, endpoint=True)
    new_bits = old_bits.copy()
    new_bits[where] ^= np.uint64(1)
    old, new = tensor_from_bits(old_bits, dtype, (n,)), tensor_from_bits(new_bits, dtype, (n,))
    td = diff_tensor("w", uint_bits(old), new, chunk_elems=chunk)
    check_changed_set(td, old, new, chunk)
    for ch in td.chunks:
        if not ch.is_dense:
            event(f"{ch.loc.mode} w{ch.loc.width}" + (" with escapes" if ch.loc.nesc else ""))
    mode = data.draw(st.sampled_from(["mixed", "overwrite"]))
    target = old.clone()
    for f in encode_frames([td], meta(), mode=mode, bucket_bytes=data.draw(st.sampled_from([64, 1 << 20]))):
        apply_frame(f, {"w": target})
    assert_same_bits(target, new)


# --- targeted cases -----------------------------------------------------------------------------------
def roundtrip(old: torch.Tensor, new: torch.Tensor, *, chunk: int = 16, mode: str = "mixed", key=None):
    td = diff_tensor("w", uint_bits(old), new, chunk_elems=chunk)
    target = old.clone()
    for f in encode_frames([td], meta(), mode=mode, key=key, bucket_bytes=1):
        apply_frame(f, {"w": target}, key=key)
    assert_same_bits(target, new)
    return td


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("mode", ["mixed", "overwrite"])
def test_a_flip_between_plus_zero_and_minus_zero_is_a_change_that_is_delivered(dtype, mode):
    sign = 1 << (8 * width(dtype) - 1)
    old = tensor_from_bits(np.zeros(40, np.uint64), dtype, (40,))
    bits = np.zeros(40, np.uint64)
    bits[[0, 13, 39]] = sign
    new = tensor_from_bits(bits, dtype, (40,))
    assert (new.float() == old.float()).all(), "the values compare equal, the bits do not"
    td = roundtrip(old, new, mode=mode)
    assert td.changed == 3
    back = roundtrip(new, old, mode=mode)  # and back from -0 to +0
    assert back.changed == 3


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("mode", ["mixed", "overwrite"])
def test_a_nan_that_only_changes_its_payload_is_a_change_that_is_delivered(dtype, mode):
    nans = NANS[dtype]
    n = 34
    old_bits = np.array([nans[i % len(nans)] for i in range(n)], dtype=np.uint64)
    new_bits = np.array([nans[(i + 1) % len(nans)] for i in range(n)], dtype=np.uint64)
    old = tensor_from_bits(old_bits, dtype, (2, 17))
    new = tensor_from_bits(new_bits, dtype, (2, 17))
    assert torch.isnan(old.float()).all() and torch.isnan(new.float()).all()
    td = roundtrip(old, new, chunk=17, mode=mode)
    assert td.changed == n


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", [(0,), (3, 0), (), (1,)], ids=["empty", "empty-2d", "scalar", "one"])
def test_tensors_with_zero_or_one_element_round_trip(dtype, shape):
    n = int(np.prod(shape, dtype=np.int64))
    old = tensor_from_bits(np.zeros(n, np.uint64), dtype, shape)
    new = tensor_from_bits(np.ones(n, np.uint64), dtype, shape)
    td = roundtrip(old, new)
    assert td.changed == n and td.numel == n
    assert roundtrip(old, old.clone()).chunks == []


def test_an_unchanged_tensor_produces_no_frames():
    t = torch.randn(100).to(torch.bfloat16)
    td = diff_tensor("w", uint_bits(t), t.clone(), chunk_elems=16)
    assert td.chunks == [] and td.changed == 0
    assert list(encode_frames([td], meta())) == []


def test_a_whole_changed_chunk_is_sent_densely_and_a_sparse_one_is_not():
    old = torch.zeros(64, dtype=torch.bfloat16)
    new = old.clone()
    ints(new)[:16] = 1  # chunk [0, 16): every element changed
    ints(new)[20] = 1  # chunk [16, 32): one element changed
    td = roundtrip(old, new, chunk=16)
    assert [(c.lo, c.hi, c.is_dense, c.count) for c in td.chunks] == [(0, 16, True, 16), (16, 32, False, 1)]


def test_mixed_dtypes_share_one_frame_and_still_apply_exactly():
    rng = np.random.default_rng(0)
    old = {str(dt): tensor_from_bits(rng.integers(0, max_bits(dt), 37, dtype=np.uint64, endpoint=True), dt, (37,))
           for dt in ALL_DTYPES}
    new = {}
    for name, t in old.items():
        b = uint_bits(t)
        b[::5] ^= b.dtype.type(1)
        new[name] = tensor_from_bits(b, t.dtype, t.shape)
    deltas = [diff_tensor(n, uint_bits(old[n]), new[n], chunk_elems=16) for n in old]
    frames = list(encode_frames(deltas, meta(), key=KEY))
    assert len(frames) == 1
    targets = {n: t.clone() for n, t in old.items()}
    apply_frame(frames[0], targets, key=KEY)
    for n in old:
        assert bits_equal(targets[n], new[n])
        assert_same_bits(targets[n], new[n])


def test_wire_dtypes_are_exactly_the_supported_set():
    assert set(WIRE_DTYPES.values()) == set(ALL_DTYPES)
