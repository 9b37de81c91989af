"""A version switch falls between two decoding steps of a running request, not between requests
(``EngineConfig(switch="in_flight")``, the default): a refit never waits for a request to finish, the
request goes on under the new version, its answer names the versions that produced its tokens, and the
weights every decoding step reads are one committed version, bit for bit the trainer's tensors of that
version (integer views), at the step before the switch and at the step after it, and the request keeps the
KV cache its earlier steps computed (a `transformers` engine shares no cache between requests, so a new
request never reads KV of an older version).
``switch="drain"`` keeps one version per answer: the refit waits for the running request instead.

The engine's model gets a forward pre-hook (run inside its actor) that slows every decoding step and
keeps a copy of every canonical tensor that step reads, so the test reads what the step saw, not a record.
"""

from __future__ import annotations

from raytools import local_ray  # noqa: F401  (loopback environment first; module-scoped Ray fixture)

import sys
import threading
import time

import pytest
import ray
import torch

import dcr_ray
from dcr_ray.testing.models import ModelSpec
from dcr_ray.testing.trainer import TinyTrainer

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the probes run in the engine actors
SPEC = ModelSpec(size="tiny")
TOKENS = 40
STEP_S = 0.05  # each decoding step of the probed engine takes at least this long


def _probe(engine, step_s: float) -> None:
    """(Run in the engine actor.) Every forward pass of the model first sleeps ``step_s``, then keeps a
    copy of every canonical tensor it is about to read and how many new positions it feeds, in order."""
    model = engine.backend.model
    engine._test_seen = seen = []
    engine._test_fed = fed = []

    def hook(_module, args, kwargs):
        time.sleep(step_s)
        seen.append({n: t.clone() for n, t in engine.backend.tensors().items()})
        ids = kwargs.get("input_ids", args[0] if args else None)
        fed.append(int(ids.shape[1]))

    model.register_forward_pre_hook(hook, with_kwargs=True)


def _steps_seen(engine, which: list[int] | None = None):
    """(Run in the engine actor.) How many steps ran, or the tensors the steps ``which`` read."""
    return len(engine._test_seen) if which is None else [engine._test_seen[i] for i in which]


def _positions_fed(engine) -> list[int]:
    """(Run in the engine actor.) How many new positions each forward pass fed the model."""
    return list(engine._test_fed)


def _bits_equal(got: dict, want: dict) -> bool:
    return sorted(got) == sorted(want) and all(
        torch.equal(got[n].view(torch.int16), t.view(torch.int16)) for n, t in want.items())


def _launch(apply: str, switch: str):
    trainer = ray.remote(num_cpus=0)(TinyTrainer).remote(SPEC, lr=1e-3)
    config = dcr_ray.RefitConfig(engines=dcr_ray.EngineConfig(apply=apply, switch=switch))
    refit = dcr_ray.launch(owners=[trainer], clusters=[dcr_ray.ClusterSpec(name="a", engines=1)],
                           engine=dcr_ray.HFEngine(SPEC.with_seed(7)), config=config)
    (engine,) = refit.engines().values()
    ray.get(engine.__ray_call__.remote(_probe, STEP_S))
    return refit, trainer, engine


def _refit_during_a_long_request(refit, trainer, engine, sampling=None):
    """A long request runs; after its fifth step the trainer steps and a refit runs. Returns the answer, the
    refit's report, when the refit returned (engine clock), and the trainer's tensors before and after."""
    before = ray.get(trainer.rollout_state.remote())
    pending = engine.generate.remote([[1, 2, 3]], TOKENS, None, sampling)
    deadline = time.monotonic() + 60
    while ray.get(engine.__ray_call__.remote(_steps_seen)) < 5:
        assert time.monotonic() < deadline, "the long request never started decoding"
        time.sleep(0.02)
    ray.get(trainer.step.remote(seed=1))
    after = ray.get(trainer.rollout_state.remote())
    report = refit.run()
    t_refit = time.time()
    return ray.get(pending), report, t_refit, before, after


@pytest.mark.timeout(240)
@pytest.mark.parametrize("apply,sampling", [("staged", None), ("in_place", {"temperature": 1.0, "seed": 3})],
                         ids=["staged greedy", "in place sampled"])
def test_a_refit_switches_a_running_request_between_two_steps_and_each_step_reads_one_committed_version(
        local_ray, apply, sampling):
    refit, trainer, engine = _launch(apply, "in_flight")
    try:
        v0 = refit.status()["version"]
        res, report, t_refit, before, after = _refit_during_a_long_request(refit, trainer, engine, sampling)
        assert report.version == v0 + 1
        # the refit did not wait for the request: it returned while the request was still decoding
        assert res["t_end"] > t_refit
        (pause,) = [p for p in ray.get(engine.pauses.remote()) if p["outcome"] == "activated"]
        assert pause["mode"] == apply and pause["inflight_s"] < 1.0, pause  # at most a step in progress, not a drain
        (out,) = res["outputs"]
        assert len(out["token_ids"]) == TOKENS
        (first, start0), (second, k) = out["versions"]  # one switch, between two of its steps
        assert (first, start0, second) == (v0, 0, v0 + 1) and 5 <= k < TOKENS, out["versions"]
        assert res["version"] == v0  # the answer's version is the oldest that produced its tokens
        # forward k-1 produced token k-1 under v0, forward k token k under v0+1: the trainer is the oracle
        step_before, step_after = ray.get(engine.__ray_call__.remote(_steps_seen, [k - 1, k]))
        assert _bits_equal(step_before, before) and not _bits_equal(step_before, after)
        assert _bits_equal(step_after, after)
        assert _bits_equal(ray.get(engine.tensors.remote()), after)
        # the request kept the KV its v0 steps computed: after the prefill every step fed one new position,
        # the step after the switch included (nothing was recomputed under v0+1)
        fed = ray.get(engine.__ray_call__.remote(_positions_fed))
        assert fed[0] == 3 and fed[1:TOKENS] == [1] * (TOKENS - 1), fed
    finally:
        refit.shutdown()


@pytest.mark.timeout(240)
def test_a_draining_engine_waits_for_the_running_request_and_answers_it_from_one_version(local_ray):
    refit, trainer, engine = _launch("staged", "drain")
    try:
        v0 = refit.status()["version"]
        short: dict = {}
        res, report, t_refit, _, after = _refit_during_a_long_request(refit, trainer, engine)
        assert report.version == v0 + 1 and res["t_end"] <= t_refit  # the refit waited for the request
        (out,) = res["outputs"]
        assert out["versions"] == [(v0, 0)] and res["version"] == v0
        (pause,) = [p for p in ray.get(engine.pauses.remote()) if p["outcome"] == "activated"]
        assert pause["inflight_s"] > 10 * STEP_S, pause  # it drained the request's remaining steps
        th = threading.Thread(target=lambda: short.setdefault("r", ray.get(engine.generate.remote([[4]], 2))))
        th.start()
        th.join(60)
        assert short["r"]["outputs"][0]["versions"] == [(v0 + 1, 0)]
        assert _bits_equal(ray.get(engine.tensors.remote()), after)
    finally:
        refit.shutdown()
