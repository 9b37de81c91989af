"""Failures during a refit: partial XOR repaired by an OVERWRITE retry; dead engines leave the set."""

from __future__ import annotations

import raytools  # noqa: F401

import pytest
import ray
import torch

import dcr_ray
from dcr_ray.testing import FlakyEngine
from dcr_ray.trainer import TinyTrainer

pytestmark = pytest.mark.slow
SPEC = dcr_ray.ModelSpec(size="tiny")


@pytest.fixture(scope="module")
def local_ray():
    raytools.init_local_ray()
    yield
    ray.shutdown()


def _start(engine, clusters, **cfg):
    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainer = Trainer.remote(SPEC, lr=1e-3)
    refit = dcr_ray.launch(owners=[trainer], clusters=clusters, engine=engine,
                           config=dcr_ray.RefitConfig(bucket_bytes=1 << 18, chunk_elems=1 << 15, **cfg))
    return refit, trainer


def _check(refit, trainer, engines=None):
    want = ray.get(trainer.rollout_state.remote())
    for eid, eng in refit.engines().items():
        if engines is not None and eid not in engines:
            continue
        got = ray.get(eng.tensors.remote())
        for n in want:
            assert torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)), (eid, n)


def test_a_partially_applied_xor_attempt_is_repaired_by_an_overwrite_retry(local_ray):
    engine = FlakyEngine(dcr_ray.HFEngine(SPEC), fail_after=2)
    refit, trainer = _start(engine, [dcr_ray.ClusterSpec(name="a", engines=2)])
    try:
        ray.get(trainer.step.remote(seed=0))
        report = refit.run()
        # attempt 0 applied two XOR frames on each engine, then failed; attempt 1 overwrote them
        assert report.retries == 1 and report.mode == "overwrite" and report.version == 1
        assert report.payloads > 2
        _check(refit, trainer)
        ray.get(trainer.step.remote(seed=1))
        report = refit.run()  # the next refit is clean again (mixed XOR/OVERWRITE)
        assert report.retries == 0 and report.mode == "mixed"
        _check(refit, trainer)
    finally:
        refit.shutdown()


def test_a_dead_engine_leaves_the_required_set_and_the_others_commit(local_ray):
    refit, trainer = _start(dcr_ray.HFEngine(SPEC),
                            [dcr_ray.ClusterSpec(name="a", engines=2), dcr_ray.ClusterSpec(name="b", engines=1)])
    try:
        ray.kill(refit.engines()["a/e1"])
        ray.get(trainer.step.remote(seed=0))
        report = refit.run()
        assert report.dropped_engines == ["a/e1"]
        assert set(report.engine_versions) == {"a/e0", "b/e0"}
        assert refit.status()["required"] == ["a/e0", "b/e0"]
        _check(refit, trainer, engines={"a/e0", "b/e0"})
    finally:
        refit.shutdown()


def test_a_refit_that_keeps_failing_raises_and_the_committed_version_stays(local_ray):
    engine = FlakyEngine(dcr_ray.HFEngine(SPEC), fail_after=0)
    refit, trainer = _start(engine, [dcr_ray.ClusterSpec(name="a", engines=1)], max_attempts=1)
    try:
        ray.get(trainer.step.remote(seed=0))
        with pytest.raises(dcr_ray.RefitError, match="committed version stays 0"):
            refit.run()
        assert refit.status()["version"] == 0
        assert ray.get(trainer.dcr_version.remote()) == 0
    finally:
        refit.shutdown()
