"""An in-place engine that applied a refit serves its version while the refit waits on another cluster
(``EngineConfig.hold_s``): its writes are set aside, and written back exactly at activation, or dropped
when the refit is abandoned. Ends with the wrong-bits sweep."""

from __future__ import annotations

from raytools import assert_no_wrong_bits, check_engines, local_ray  # noqa: F401  (loopback environment first)

import threading
import time

import pytest
import ray

import dcr_ray
from dcr_ray.testing.faults import StallOnSignal, release_stall
from dcr_ray.testing.models import ModelSpec
from dcr_ray.testing.trainer import TinyTrainer

pytestmark = pytest.mark.slow
SPEC = ModelSpec(size="tiny")


def _wait_phase(engine, phase: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while ray.get(engine.state.remote())["phase"] != phase:
        assert time.monotonic() < deadline, f"the engine never reached phase {phase}"
        time.sleep(0.02)


@pytest.mark.parametrize("outcome", ["committed", "abandoned"])
def test_an_engine_that_applied_a_refit_serves_its_version_while_another_cluster_holds_the_refit_up(
        local_ray, tmp_path, outcome):
    signal, release = str(tmp_path / "stall"), str(tmp_path / "release")
    trainer = ray.remote(num_cpus=0)(TinyTrainer).remote(SPEC, lr=1e-3)
    config = dcr_ray.RefitConfig(engines=dcr_ray.EngineConfig(hold_s=0.1),
                                 commit=dcr_ray.CommitConfig(timeout_s=8.0,
                                                             max_attempts=1 if outcome == "abandoned" else 3))
    refit = dcr_ray.launch(owners=[trainer], config=config,
                           clusters=[dcr_ray.ClusterSpec(name="a", engines=1), dcr_ray.ClusterSpec(name="b", engines=1)],
                           engine=StallOnSignal(dcr_ray.HFEngine(SPEC), signal, 120.0, release=release))
    try:
        committed = ray.get(trainer.rollout_state.remote())
        a = refit.engines()["a/e0"]
        ray.get(trainer.step.remote(seed=0))
        if outcome == "committed":  # b's flush hangs until released (it is evicted past the stage timeout)
            with open(signal, "w") as f:
                f.write("b/e0")
        else:  # b's flush fails after a while: the only attempt is abandoned
            ray.get(refit.engines()["b/e0"].__ray_call__.remote(_failing_next_flush()))
        done = {}
        th = threading.Thread(target=lambda: done.setdefault("r", _run(refit)))
        th.start()
        _wait_phase(a, "parked")  # a flushed, waited hold_s, and set its writes aside
        out = ray.get(a.generate.remote([[1, 2, 3]], 2, 5.0))
        assert out["version"] == 0  # it serves the committed version while b holds the refit up
        if outcome == "committed":
            release_stall(release)
        th.join(timeout=120)
        if outcome == "committed":
            assert done["r"].version == 1, done
            check_engines(refit, trainer)  # the set-aside writes went back exactly
            (p,) = [p for p in ray.get(a.pauses.remote()) if p["transfer"] == done["r"].transfer]
            assert p["parked_s"] > 0 and p["outcome"] == "activated"
        else:
            assert isinstance(done["r"], dcr_ray.RefitError), done
            assert ray.get(a.state.remote())["phase"] == "ready"
            assert_no_wrong_bits(refit, committed, 0)  # nothing of the abandoned refit stayed in a
        assert ray.get(a.info.remote())["parks"] == 1
    finally:
        refit.shutdown()


def _run(refit):
    try:
        return refit.run(timeout=120)
    except dcr_ray.DcrError as e:
        return e


def _failing_next_flush():
    """A function to run in an engine (``__ray_call__``; made here so that it travels by value): its next
    backend flush raises after 3 s (the other engine parks meanwhile)."""
    def install(engine_self) -> None:
        backend = engine_self.backend
        inner = backend.flush

        def flush():
            backend.flush = inner
            time.sleep(3.0)
            raise RuntimeError("injected: this engine's flush fails")
        backend.flush = flush
    return install
