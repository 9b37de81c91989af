"""The GPU placement path's capture logic, run on plain CPU tensors with stand-in loaders.

vLLM-on-GPU cannot run on this machine, so these tests drive :class:`LoaderCapture` (the part of the
CUDA path that is plain PyTorch) with small fake models whose ``load_weights`` imitate vLLM's loaders:
fused q/k/v shards written through ``narrow``, a transposed store, a sharded (tensor-parallel-like)
read, and the loader behaviours that must *not* be replayed sparsely (dtype conversion, computed
temporaries, re-bound parameters, post-load transforms, double writes). The real vLLM loaders are
exercised the same way in ``test_vllm_backend.py`` on a never-repacked CPU model instance.

No vLLM needed: these run in the quick subset. Equality is always on integer views.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from dcr_ray.codec import BaselineStore, DecodedItem, FrameMeta, encode_frames, read_frame
from dcr_ray.engines.vllm.worker.capture import LoaderCapture
from dcr_ray.engines.vllm.worker.groups import fused_groups
from dcr_ray.engines.vllm.worker.plan import Geometry, map_positions, strict_check
from dcr_ray.engines.vllm.worker.storage import int_view
from dcr_ray.errors import BackendError, BackendUnavailableError, LoaderCaptureError

H, Q, KV = 16, 16, 8


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(int_view(a.contiguous()), int_view(b.contiguous()))


class FakeQKV(torch.nn.Module):
    """A fused q/k/v projection loaded shard by shard, like vLLM's QKVParallelLinear."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(Q + 2 * KV, H, dtype=torch.bfloat16), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(Q + 2 * KV, dtype=torch.bfloat16), requires_grad=False)

    def load(self, leaf: str, shard: str, w: torch.Tensor) -> None:
        off, size = {"q": (0, Q), "k": (Q, KV), "v": (Q + KV, KV)}[shard]
        getattr(self, leaf).data.narrow(0, off, size).copy_(w)


class FakeModel(torch.nn.Module):
    """Checkpoint names -> fused / transformed storage, with one loader per behaviour under test."""

    def __init__(self, *, post_transform: bool = False, double_write: bool = False):
        super().__init__()
        self.qkv = FakeQKV()
        self.norm = torch.nn.Parameter(torch.ones(H, dtype=torch.bfloat16), requires_grad=False)
        self.wt = torch.nn.Parameter(torch.zeros(H, 2 * H, dtype=torch.bfloat16), requires_grad=False)
        self.emb = torch.nn.Parameter(torch.ones(H + 4, H, dtype=torch.bfloat16), requires_grad=False)
        self.shard = torch.nn.Parameter(torch.zeros(H // 2, H, dtype=torch.bfloat16), requires_grad=False)
        self.f32 = torch.nn.Parameter(torch.zeros(H, dtype=torch.float32), requires_grad=False)
        self.scaled = torch.nn.Parameter(torch.zeros(H, dtype=torch.bfloat16), requires_grad=False)
        self.rebound = torch.nn.Parameter(torch.zeros(H, dtype=torch.bfloat16), requires_grad=False)
        self.post_transform = post_transform
        self.double_write = double_write

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            if name.startswith(("q_proj", "k_proj", "v_proj")):
                leaf = name.split(".")[1]
                self.qkv.load(leaf, name[0], w)
                loaded.add(f"qkv.{leaf}")
            elif name == "norm.weight":
                self.norm.data.copy_(w)
                if self.double_write:
                    self.norm.data.copy_(w)
                loaded.add("norm")
            elif name == "wt.weight":  # stored transposed: a strided view copy (still affine)
                self.wt.data.copy_(w.t())
                loaded.add("wt")
            elif name == "emb.weight":  # vocabulary padding zeroed, like VocabParallelEmbedding
                self.emb.data[:H].copy_(w)
                self.emb.data[H:].fill_(0)
                loaded.add("emb")
            elif name == "shard.weight":  # this "rank" keeps rows H/2.. only (tensor-parallel-like)
                self.shard.data.copy_(w.narrow(0, H // 2, H // 2))
                loaded.add("shard")
            elif name == "f32.weight":  # dtype conversion in the copy: not bit-replayable
                self.f32.data.copy_(w)
                loaded.add("f32")
            elif name == "scaled.weight":  # a computed temporary
                self.scaled.data.copy_(w * 2)
                loaded.add("scaled")
            elif name == "rebound.weight":  # re-binds the parameter instead of copying into it
                self.rebound.data = w.clone()
                loaded.add("rebound")
            elif name == "rotary.inv_freq":  # ignored by the loader
                pass
            else:
                raise KeyError(name)
        return loaded

    def process_after_loading(self) -> None:
        if self.post_transform:
            self.norm.data += 1


def _canonical(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    return {
        "q_proj.weight": r(Q, H), "k_proj.weight": r(KV, H), "v_proj.weight": r(KV, H),
        "q_proj.bias": r(Q), "k_proj.bias": r(KV), "v_proj.bias": r(KV),
        "norm.weight": r(H), "emb.weight": r(H, H), "wt.weight": r(2 * H, H), "shard.weight": r(H, H),
        "f32.weight": r(H),
        "scaled.weight": r(H), "rebound.weight": r(H), "rotary.inv_freq": r(H // 2),
    }


def _perturb(state: dict[str, torch.Tensor], seed: int, frac: float = 0.1) -> dict[str, torch.Tensor]:
    """Flip low mantissa bits of a fraction of elements (what a small optimizer step does to BF16)."""
    rng = np.random.default_rng(seed)
    out = {}
    for n, t in state.items():
        t = t.clone()
        v = int_view(t).view(-1).numpy()
        idx = rng.choice(len(v), size=max(1, int(len(v) * frac)), replace=False)
        v[idx] ^= rng.integers(1, 8, size=len(idx)).astype(v.dtype)
        out[n] = t
    return out


def _loaded(state, **kw) -> FakeModel:
    m = FakeModel(**kw)
    m.load_weights(list(state.items()))
    m.process_after_loading()
    return m


def _frames_items(store: BaselineStore, new: dict[str, torch.Tensor], base: int, specs) -> list[DecodedItem]:
    deltas = [d for d in (store.diff(n, t) for n, t in new.items()) if d.chunks]
    items = []
    meta = FrameMeta(transfer=f"t{base}", attempt=0, producer="p", payload=0, base=base, target=base + 1)
    for data in encode_frames(deltas, meta, bucket_bytes=256):
        frame = read_frame(data, shapes=specs, expect_base=base)
        items += frame.items
    store.begin(base + 1)
    for d in deltas:
        store.add_pending(d)
    store.promote(base + 1)
    return items


def _specs(state):
    from dcr_ray.codec.bits import wire_name

    return {n: (wire_name(t.dtype), tuple(t.shape)) for n, t in state.items()}


def test_map_positions_inverts_whole_narrowed_and_transposed_views():
    """Contiguous blocks (the whole tensor, a slice along the first dimension, one with a dimension of 1) map by a
    shift; the others dimension by dimension; each finds every element of the view once."""
    base = torch.arange(6 * 8).reshape(6, 8)
    for view in (base, base.narrow(0, 2, 3), base.narrow(0, 5, 1), base.reshape(6, 1, 8), base.narrow(1, 1, 5),
                 base.t(), base.t().narrow(0, 3, 4)):
        src = Geometry.of(view)
        dst = Geometry((*view.shape,), tuple(torch.empty(view.shape).stride()), 7)
        pos = torch.arange(base.numel())
        valid, out = map_positions(pos, src, dst)
        # every element of the view is found exactly once, at its row-major place in dst
        assert int(valid.sum()) == view.numel()
        expect = torch.empty(7 + view.numel(), dtype=torch.int64).fill_(-1)
        expect[7:] = view.reshape(-1)
        assert torch.equal(expect[out[valid]], pos[valid])


def test_geometry_knows_a_contiguous_block_from_a_strided_view():
    assert Geometry((4, 4), (4, 1), 16).row_major() and Geometry((4, 1, 4), (4, 99, 1), 0).row_major()
    assert not Geometry((4, 4), (1, 4), 0).row_major() and not Geometry((4, 3), (4, 1), 0).row_major()


def test_geometry_rejects_overlapping_views():
    assert Geometry((4, 4), (4, 1), 0).non_overlapping()
    assert Geometry((4, 4), (1, 4), 0).non_overlapping()
    assert not Geometry((4, 4), (0, 1), 0).non_overlapping()
    assert not Geometry((4, 4), (2, 1), 0).non_overlapping()


def test_captured_loader_copies_replay_deltas_bit_exactly_on_a_stand_in_model():
    v0 = _canonical(0)
    live = _loaded(v0)
    cap = LoaderCapture(live)
    for n, t in v0.items():
        cap.probe(n, t)
    cap.finish()
    kinds = {n: k for n, (k, _) in cap.summary().items()}
    affine = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias",
              "norm.weight", "emb.weight", "wt.weight", "shard.weight"}
    assert {n for n, k in kinds.items() if k == "affine"} == affine
    assert {n for n, k in kinds.items() if k == "fallback"} == {"f32.weight", "scaled.weight", "rebound.weight"}
    assert kinds["rotary.inv_freq"] == "ignored"
    # probing wrote nothing and re-bound nothing
    ref0 = _loaded(v0)
    for (n, p), (_, q) in zip(live.named_parameters(), ref0.named_parameters()):
        assert _bits_equal(p, q), n

    store = BaselineStore(in_memory=True)
    for n, t in v0.items():
        store.add(n, t)
    state = v0
    for step in range(3):
        state = _perturb(state, seed=step + 1)
        items = _frames_items(store, {n: state[n] for n in affine}, step, _specs(v0))
        assert {it.encoding for it in items} <= {"xor", "dense"} and items
        assert cap.apply(items) > 0
    dense = _loaded({**v0, **{n: state[n] for n in affine}})
    for n in ("qkv.weight", "qkv.bias", "norm", "emb", "wt", "shard"):
        assert _bits_equal(live.get_parameter(n), dense.get_parameter(n)), n
    for n in affine - {"shard.weight"}:
        assert _bits_equal(cap.readback(n), state[n]), n
    with pytest.raises(BackendError, match="part of the tensor"):
        cap.readback("shard.weight")  # this stand-in rank holds only half of it


def test_probing_a_loader_never_writes_or_rebinds_live_storage():
    v0 = _canonical(0)
    live = _loaded(v0)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in live.named_parameters()}
    cap = LoaderCapture(live)
    for n, t in _perturb(v0, seed=9, frac=1.0).items():  # values unlike what storage holds
        cap.probe(n, t)
    for n, p in live.named_parameters():
        assert p.data_ptr() == before[n][0], n
        assert _bits_equal(p, before[n][1]), n
    # the stored bits are not the probed ones, so nothing may be replayed sparsely
    assert all(k != "affine" for k, _ in cap.summary().values())


def test_overwrite_items_repair_a_partially_applied_xor_attempt():
    v0 = _canonical(0)
    live = _loaded(v0)
    cap = LoaderCapture(live)
    for n in ("q_proj.weight", "norm.weight"):
        cap.probe(n, v0[n])
    cap.finish()
    v1 = _perturb({n: v0[n] for n in ("q_proj.weight", "norm.weight")}, seed=5, frac=0.3)
    store = BaselineStore(in_memory=True)
    for n in v1:
        store.add(n, v0[n])
    deltas = [store.diff(n, t) for n, t in v1.items()]
    meta = FrameMeta(transfer="t", attempt=0, producer="p", payload=0, base=0, target=1)
    first = read_frame(next(iter(encode_frames(deltas[:1], meta))), shapes=_specs(v0))
    cap.apply(first.items)  # attempt 0, partial
    retry = FrameMeta(transfer="t", attempt=1, producer="p", payload=0, base=0, target=1)
    for data in encode_frames(deltas, retry, mode="overwrite"):
        fr = read_frame(data, shapes=_specs(v0))
        assert {i.encoding for i in fr.items} <= {"ow", "dense"}
        cap.apply(fr.items)
    dense = _loaded({**v0, **v1})
    assert _bits_equal(live.qkv.weight, dense.qkv.weight) and _bits_equal(live.norm, dense.norm)


def test_post_load_transforms_and_double_writes_fall_back_to_the_native_loader():
    v0 = _canonical(0)
    for kw, reason in (({"post_transform": True}, "differ from the checkpoint"),
                       ({"double_write": True}, "more than once")):
        live = _loaded(v0, **kw)
        cap = LoaderCapture(live)
        cap.probe("norm.weight", v0["norm.weight"])
        cap.finish()
        kind, why = cap.summary()["norm.weight"]
        assert kind == "fallback" and reason in why
        with pytest.raises(BackendError, match="native loader"):
            cap.apply([DecodedItem("norm.weight", "dense", 0, H, None, int_view(v0["norm.weight"]).numpy())])
        with pytest.raises(LoaderCaptureError, match="norm.weight"):
            strict_check(cap.summary())


def test_apply_checks_every_item_before_the_first_write():
    v0 = _canonical(0)
    live = _loaded(v0)
    cap = LoaderCapture(live)
    cap.probe("norm.weight", v0["norm.weight"])
    cap.probe("q_proj.weight", v0["q_proj.weight"])
    before = live.qkv.weight.detach().clone()
    good = DecodedItem("q_proj.weight", "ow", 0, 4, np.array([0, 1, 2, 3]), np.array([1, 2, 3, 4], np.uint16))
    bad = DecodedItem("norm.weight", "xor", 0, H, np.array([0, H + 5]), np.array([1, 1], np.uint16))
    with pytest.raises(BackendError, match="out of range"):
        cap.apply([good, bad])
    assert _bits_equal(live.qkv.weight, before)
    with pytest.raises(BackendError, match="never probed"):
        cap.apply([DecodedItem("nope", "ow", 0, 1, np.array([0]), np.array([1], np.uint16))])


class _Mapper:
    """Like vLLM's WeightsMapper with stacked entries (checkpoint part -> fused module)."""

    def map_name(self, name):
        if name.endswith("inv_freq"):
            return None
        return name.replace(".q_proj", ".qkv_proj").replace(".k_proj", ".qkv_proj").replace(".v_proj", ".qkv_proj")


class _VllmLike(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, mapper=None):
        super().__init__()
        if mapper is not None:
            self.hf_to_vllm_mapper = mapper
        self.layer = torch.nn.ModuleDict({
            "qkv_proj": torch.nn.Linear(2, 2), "gate_up_proj": torch.nn.Linear(2, 2),
            "down_proj": torch.nn.Linear(2, 2), "norm": torch.nn.LayerNorm(2)})


def test_fused_groups_come_from_the_models_own_mappings():
    names = ["layer.q_proj.weight", "layer.k_proj.weight", "layer.v_proj.weight", "layer.q_proj.bias",
             "layer.gate_proj.weight", "layer.up_proj.weight", "layer.down_proj.weight", "layer.norm.weight"]
    for model in (_VllmLike(), _VllmLike(_Mapper())):
        info = fused_groups(model, names)
        groups = sorted(sorted(g) for g in info["groups"])
        assert sorted(["layer.q_proj.weight", "layer.k_proj.weight", "layer.v_proj.weight",
                       "layer.q_proj.bias"]) in groups
        assert sorted(["layer.gate_proj.weight", "layer.up_proj.weight"]) in groups
        assert ["layer.down_proj.weight"] in groups and ["layer.norm.weight"] in groups
        assert not info["unresolved"]
    info = fused_groups(_VllmLike(_Mapper()), names + ["layer.rotary.inv_freq"])
    assert info["ignored"] == ["layer.rotary.inv_freq"]
    # a name no module loads: every tensor is reloaded together (a dense reload is always exact)
    info = fused_groups(_VllmLike(), names + ["elsewhere.weight"])
    assert info["unresolved"] == ["elsewhere.weight"] and len(info["groups"]) == 1
    assert sorted(info["groups"][0]) == sorted(names + ["elsewhere.weight"])


def test_the_llvmlite_shim_keeps_every_module_global_inspectable_for_vllm_start_up():
    # vLLM 0.32 calls vars(value).get("kernel") on every module global that has a __dict__ when an
    # engine starts; llvmlite's ffi.lib (loaded with numba) breaks that scan unless the shim ran
    from dcr_ray.engines.vllm.compat import make_llvmlite_safe_for_vllm

    pytest.importorskip("numba")
    import llvmlite.binding.ffi as ffi

    make_llvmlite_safe_for_vllm()
    assert vars(ffi.lib) == {}  # the object that broke the scan now has an ordinary, empty __dict__
    scanned = 0
    for module in list(sys.modules.values()):
        for value in list((getattr(module, "__dict__", None) or {}).values()):
            if hasattr(value, "__dict__"):
                vars(value).get("kernel")  # what vLLM's start-up does; raised AttributeError before the shim
                scanned += 1
    assert scanned > 1000  # the scan really walked the process's globals (numba's included)
    make_llvmlite_safe_for_vllm()  # idempotent: a second call leaves the shimmed class in place
    assert vars(ffi.lib) == {}


def test_the_vllm_backend_says_how_to_install_vllm_when_it_is_missing(tmp_path, monkeypatch):
    import dcr_ray
    from dcr_ray.engines import vllm as vb
    from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint

    assert dcr_ray is not None
    save_checkpoint(build_model(ModelSpec(arch="llama")), str(tmp_path))
    monkeypatch.setitem(sys.modules, "vllm", None)  # "import vllm" now raises ImportError
    for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_HOST_IP", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'dcr_ray\[vllm"):
        vb.VllmBackend(str(tmp_path))


def test_capture_on_packed_cpu_weights_and_unknown_settings_are_refused_before_vllm_starts(tmp_path, monkeypatch):
    from dcr_ray.engines import vllm as vb
    from dcr_ray.errors import ConfigError
    from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    save_checkpoint(build_model(ModelSpec(arch="llama")), str(tmp_path))
    monkeypatch.setitem(sys.modules, "vllm", None)  # proves vLLM is never imported on this path
    with pytest.raises(ConfigError, match="cpu_weights='unpacked'"):
        vb.VllmBackend(str(tmp_path), mode="capture", cpu_weights="packed")
    with pytest.raises(ConfigError, match="one of"):
        vb.VllmBackend(str(tmp_path), mode="gpu")
    with pytest.raises(ConfigError, match="one of"):
        vb.VllmBackend(str(tmp_path), cpu_weights="fast")


def test_add_items_become_overwrites_read_only_at_their_positions_and_undo_puts_every_bit_back():
    v0 = _canonical(0)
    live = _loaded(v0)
    cap = LoaderCapture(live)
    for n in ("q_proj.weight", "shard.weight", "wt.weight"):
        cap.probe(n, v0[n])
    cap.finish()
    before = {n: p.detach().clone() for n, p in live.named_parameters()}
    pos = np.array([0, 5, 77, H * H - 1])
    delta = np.array([1, 2, 0xFFFF, 3], np.uint16)  # unsigned differences: 0xFFFF is -1, wrapping
    undo: list = []
    n = cap.apply([DecodedItem("q_proj.weight", "add", 0, Q * H, pos, delta),
                   DecodedItem("wt.weight", "add", 0, 2 * H * H, pos, delta),
                   # this stand-in rank holds rows H/2.. of shard.weight: the positions it lacks are not written
                   DecodedItem("shard.weight", "add", 0, H * H, pos, delta)], undo=undo)
    assert n == 4 + 4 + 1  # of shard.weight, only the last position lies in the rows this rank holds
    for name, t in (("q_proj.weight", live.qkv.weight.detach()[:Q]), ("wt.weight", live.wt.detach().t())):
        want = int_view(v0[name]).reshape(-1).numpy().view(np.uint16).copy()
        want[pos] += delta
        assert np.array_equal(int_view(t.contiguous()).reshape(-1).numpy().view(np.uint16), want), name
    want = int_view(v0["shard.weight"]).reshape(-1).numpy().view(np.uint16).copy()
    want[pos] += delta
    got = int_view(live.shard.detach()).reshape(-1).numpy().view(np.uint16)
    assert np.array_equal(got, want[H * H // 2:])
    cap.undo(undo)
    for name, p in live.named_parameters():
        assert _bits_equal(p, before[name]), name
