"""Packs of whole small tensors: the same bits as per-tensor items, one header entry, bad packs refused.

Every check compares integer views of the bits. The compiled pointer kernels and the numpy fallback
(``ptrkernels.ENABLED = False``) must give identical changed sets and identical writes.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from dcr_ray.codec import FrameMeta, apply_decoded, apply_frame, diff_tensor, encode_frames, read_frame
from dcr_ray.codec import packed
from dcr_ray.codec.bits import bits_view, wire_name
from dcr_ray.codec.compiled import ptrkernels
from dcr_ray.codec.encoding.packdiff import diff_pack
from dcr_ray.codec.packed import plan_packs
from dcr_ray.errors import DuplicateIndexError, MalformedHeaderError, TargetMismatchError, UnknownEncodingError
from test_codec_malformed import assemble, explode

META = FrameMeta(transfer="t", attempt=0, producer="o", payload=0, base=1, target=2)


def ints(t: torch.Tensor) -> np.ndarray:
    return bits_view(t).copy()


def experts(n: int, shape=(8, 16), rate=0.02, seed=0, dtype=torch.bfloat16, unchanged=()):
    """(old bits, new tensors) of ``n`` expert tensors; those in ``unchanged`` keep their bits."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for i in range(n):
        name = f"model.layers.{i // 24}.mlp.experts.{i % 24}.down_proj.weight"
        t = torch.randn(shape, generator=g).to(dtype)
        old[name] = ints(t)
        if i not in unchanged:
            v = bits_view(t)
            k = max(1, int(rate * t.numel()))
            v[rng.choice(t.numel(), k, replace=False)] ^= v.dtype.type(1)
        new[name] = t
    return old, new


def pack_of(old, new):
    names = list(new)
    return diff_pack(names, [tuple(new[n].shape) for n in names], [old[n] for n in names], [new[n] for n in names])


def targets_of(old, new):
    out = {}
    for n, t in new.items():
        x = torch.empty_like(t)
        bits_view(x)[:] = old[n]
        out[n] = x
    return out


def shapes_of(new):
    return {n: (wire_name(t.dtype), tuple(t.shape)) for n, t in new.items()}


@pytest.fixture(params=[True, False], ids=["compiled", "numpy"])
def kernels(request, monkeypatch):
    if request.param and not ptrkernels.ENABLED:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(ptrkernels, "ENABLED", request.param)
    return request.param


def _tensor_deltas(pk) -> list:
    """A pack's changes as one sparse TensorDelta per tensor (what per-tensor diffs give)."""
    from dcr_ray.codec.primitives import locations
    from dcr_ray.codec.encoding.diff import ChunkDelta, TensorDelta
    from dcr_ray.codec.packed import per_tensor

    out = []
    for t, s, rel in per_tensor(pk.positions, pk.offsets):
        numel = int(pk.offsets[t + 1] - pk.offsets[t])
        ch = ChunkDelta(0, numel, len(rel), loc=locations.encode(rel, 0), xor=pk.xor[s], new=pk.new[s])
        out.append(TensorDelta(pk.names[t], pk.dtype, pk.shapes[t], numel, [ch]))
    return out


def test_a_pack_holds_exactly_the_changes_per_tensor_diffs_find(kernels):
    old, new = experts(60, unchanged={3, 17})
    pk = pack_of(old, new)
    per_tensor = {n: diff_tensor(n, old[n], t) for n, t in new.items()}
    assert pk.names == [n for n in new if per_tensor[n].changed]  # unchanged tensors are left out
    for td in _tensor_deltas(pk):
        want = per_tensor[td.name].chunks[0]
        got = td.chunks[0]
        assert np.array_equal(got.positions(), want.positions())
        assert np.array_equal(got.xor, want.xor) and np.array_equal(got.new, want.new)


@pytest.mark.parametrize("keep", [True, False], ids=["packs kept", "packs expanded"])
def test_pack_frames_leave_every_tensor_with_the_new_bits(kernels, keep):
    old, new = experts(200, rate=0.05)
    frames = list(encode_frames([pack_of(old, new)], META))
    tg = targets_of(old, new)
    for f in frames:
        d = read_frame(f, shapes=shapes_of(new), keep_packs=keep)
        assert bool(d.packs) == keep
        apply_decoded(d, tg)
    assert all(np.array_equal(ints(tg[n]), ints(t)) for n, t in new.items())


def test_retries_overwrite_and_context_coding_also_round_trip(kernels):
    old, new = experts(50, rate=0.1, dtype=torch.float32)
    pk = pack_of(old, new)
    for kw in (dict(mode="overwrite"), dict(coding="context")):
        tg = targets_of(old, new)
        for f in encode_frames([pk], META, **kw):
            apply_frame(f, tg)
        assert all(np.array_equal(ints(tg[n]), ints(t)) for n, t in new.items()), kw


def test_a_pack_takes_one_header_entry_and_a_fraction_of_the_per_tensor_bytes():
    old, new = experts(500, rate=0.02)
    items = list(encode_frames([diff_tensor(n, old[n], t) for n, t in new.items()], META))
    packs = list(encode_frames([pack_of(old, new)], META))
    assert len(msgpack.unpackb(packs[0][9:9 + int.from_bytes(packs[0][5:9], "little")])["packs"]) == 1
    assert sum(map(len, packs)) < 0.5 * sum(map(len, items))


def test_plan_packs_keeps_order_and_bounds_each_pack():
    sizes = {f"t{i}": 1 << 20 for i in range(10)}
    plan = plan_packs(sizes)
    assert [n for p in plan for n in p] == list(sizes)
    assert all(sum(sizes[n] for n in p) <= packed.PACK_SPAN_ELEMS for p in plan)
    assert not packed.packable("a\nb", 10) and not packed.packable("big", packed.PACK_MAX_ELEMS + 1)


def test_diff_pack_refuses_a_tensor_whose_shape_changed_before_reading_it():
    old, new = experts(3)
    names = list(new)
    new[names[1]] = new[names[1]].reshape(16, 8)
    with pytest.raises(ValueError, match="committed shape"):
        diff_pack(names, [(8, 16)] * 3, [old[n] for n in names], [new[n] for n in names])


# --- bad packs: refused before anything is written -------------------------------------------------
def _frame_parts():
    old, new = experts(6, rate=0.1)
    (frame,) = encode_frames([pack_of(old, new)], META)
    header, secs = explode(frame)
    return old, new, header, secs


def _refused(frame, old, new, error, match):
    tg = targets_of(old, new)
    before = {n: ints(t) for n, t in tg.items()}
    with pytest.raises(error, match=match):
        apply_frame(frame, tg)
    assert all(np.array_equal(ints(tg[n]), before[n]) for n in tg)


def test_a_pack_naming_a_tensor_twice_is_refused():
    old, new, h, secs = _frame_parts()
    names = secs["pnames"].decode().split("\n")
    names[1] = names[0]
    secs["pnames"] = "\n".join(names).encode()
    _refused(assemble(h, secs, key=None), old, new, DuplicateIndexError, "twice")


def test_a_pack_whose_shapes_differ_from_the_receivers_is_refused():
    old, new, h, secs = _frame_parts()
    dims = np.frombuffer(secs["pshape"], "<u8").copy()
    dims[1], dims[2] = dims[2], dims[1]  # (8, 16) -> (16, 8): same size, other shape
    secs["pshape"] = dims.tobytes()
    _refused(assemble(h, secs, key=None), old, new, TargetMismatchError, "shapes differ")


def test_a_pack_with_too_few_names_or_an_unknown_tensor_is_refused():
    old, new, h, secs = _frame_parts()
    short = dict(secs, pnames=secs["pnames"].split(b"\n", 1)[1])
    _refused(assemble(h, short, key=None), old, new, MalformedHeaderError, "newline-ended names")
    other = dict(secs, pnames=secs["pnames"].replace(b"experts.0.", b"experts.9."))
    _refused(assemble(h, other, key=None), old, new, TargetMismatchError, "no tensor named")


@pytest.mark.parametrize("field,value,error", [("e", "dense", UnknownEncodingError),
                                               ("lm", "cgaps", UnknownEncodingError),
                                               ("k", 0, MalformedHeaderError),
                                               ("dt", "float32", TargetMismatchError)])
def test_a_pack_declaring_what_packs_never_use_is_refused(field, value, error):
    old, new, h, secs = _frame_parts()
    h["packs"][0][field] = value
    _refused(assemble(h, secs, key=None), old, new, error, None)


def test_an_undo_log_returns_pack_writes_to_the_committed_bits(kernels):
    from dcr_ray.codec.decoding.undo import UndoLog
    from dcr_ray.engines.hf import TransformersBackend

    old, new = experts(40, rate=0.1, dtype=torch.float32)
    backend = TransformersBackend.from_tensors(targets_of(old, new))
    log = UndoLog()
    for kw in (dict(coding="context"), dict(mode="overwrite")):  # an ADD/XOR attempt, then a retry on top
        for f in encode_frames([pack_of(old, new)], META, **kw):
            d = read_frame(f, backend.tensors(), keep_packs=True)
            log.record("t", d, backend.tensors())
            backend.apply(d)
    assert all(np.array_equal(ints(backend.tensors()[n]), ints(t)) for n, t in new.items())
    assert log.rollback(backend) == 2
    assert all(np.array_equal(ints(backend.tensors()[n]), old[n]) for n in new)


def test_a_baseline_promotes_pending_packs_to_exactly_the_new_bits_and_rebuilds_their_masks(kernels, tmp_path):
    from dcr_ray.codec.encoding.baseline import BaselineStore

    old, new = experts(300, rate=0.03, unchanged={7})
    store = BaselineStore(directory=str(tmp_path), chunk_elems=1 << 12)
    for n in new:
        t = torch.empty_like(new[n])
        bits_view(t)[:] = old[n]
        store.add(n, t)
    assert len(list(tmp_path.iterdir())) == 1  # 300 tensors, one arena map
    plans = store.plan_packs(list(new))
    assert len(plans) > 1 and [n for p in plans for n in p.names] == list(new)
    store.begin(1)
    fresh = [pd for p in plans for pd in [store.diff_pack(p, [new[n] for n in p.names])] if pd is not None]
    for pd in fresh:
        store.add_pending(pd)
    pending = store.pending()
    assert all(pd.xor is None for pd in pending)  # kept as positions and new bits
    assert all(np.array_equal(store.with_xor(p).xor, f.xor) for p, f in zip(pending, fresh))
    assert 0 < store.pending_pages() <= sum(p.changed for p in pending)
    assert store.promote(1) == sum(p.changed for p in fresh)
    assert all(np.array_equal(store.bits(n), ints(t)) for n, t in new.items())


def test_a_pack_of_the_wrong_dtype_is_refused_before_the_scan(tmp_path):
    from dcr_ray.codec.encoding.baseline import BaselineStore
    from dcr_ray.errors import BaselineError

    old, new = experts(4)
    store = BaselineStore(in_memory=True)
    for n, t in new.items():
        store.add(n, t)
    (plan,) = store.plan_packs(list(new))
    with pytest.raises(BaselineError, match="same canonical dtype"):
        store.diff_pack(plan, [t.float() for t in new.values()])


def test_a_pack_with_a_torn_or_oversized_shapes_table_is_refused_as_a_frame_error():
    from dcr_ray.errors import SizeLimitError

    old, new, h, secs = _frame_parts()
    torn = dict(secs, pshape=secs["pshape"][:-3])
    with pytest.raises(MalformedHeaderError, match="whole uint64s"):
        read_frame(assemble(h, torn, key=None))
    dims = np.frombuffer(secs["pshape"], "<u8").copy()
    dims[1] = 1 << 40  # a self-described frame (no receiver tensors) declaring a huge tensor
    with pytest.raises(SizeLimitError):
        read_frame(assemble(h, dict(secs, pshape=dims.tobytes()), key=None))
