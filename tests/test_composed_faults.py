"""Faults that compose with a refit already under way, on real Ray: what a restarted coordinator may
activate, and what a retry must carry. Each test ends with the trainer as the oracle: every engine that
says it holds a version holds the trainer's tensors of that version, bit for bit (integer views).

* A coordinator that restarts after a refit committed without an engine evicted mid-stream activates
  only the record's members that flushed its transfer; the evicted one, which holds part of it, rolls
  back and heals.
"""

from __future__ import annotations

import time

import raytools  # noqa: F401
from raytools import assert_no_wrong_bits
from raytools import fresh_local_ray as local_ray  # noqa: F401  (this module kills and re-creates detached actors)

import pytest
import ray
import torch

import dcr_ray
from dcr_ray.testing.models import ModelSpec
from dcr_ray.testing.trainer import TinyTrainer

pytestmark = pytest.mark.slow

SPEC = ModelSpec(size="tiny")


def _resumed(refit, epoch: int = 1, timeout: float = 60.0) -> dict:
    """The status of the restarted coordinator (the kill is asynchronous: the old one may answer first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            st = refit.status()
            if st["commit_record"]["epoch"] >= epoch:
                return st
        except ray.exceptions.RayActorError:
            pass
        time.sleep(0.2)
    raise AssertionError("the coordinator did not resume")


def _serves_the_trainers_bits(engine, trainer_at: dict[int, dict]) -> None:
    """The oracle: the version the engine says it holds, and the trainer's tensors of that version."""
    v = ray.get(engine.get_version.remote(), timeout=60)
    if v is None:
        return  # it holds no version: it refuses to serve
    got = ray.get(engine.tensors.remote(), timeout=60)
    for n, t in trainer_at[v].items():
        assert torch.equal(got[n].view(torch.int16), t.view(torch.int16)), (v, n)


def _frames(committed: dict, new: dict, transfer: str) -> list[bytes]:
    """Frames of ``transfer`` (v0 -> v1, built on the launch's content) as an owner would send them."""
    from dcr_ray.codec import BaselineStore, FrameMeta, encode_frames

    store = BaselineStore(in_memory=True)
    for n, t in committed.items():
        store.add(n, t)
    deltas = [d for d in (store.diff(n, t) for n, t in new.items()) if d.chunks]
    meta = FrameMeta(transfer=transfer, attempt=0, producer="owner0", payload=0, base=0, target=1, base_id="attach")
    return list(encode_frames(deltas, meta, bucket_bytes=1 << 12))


@pytest.mark.timeout(180)
def test_a_restarted_coordinator_does_not_activate_an_engine_evicted_mid_stream(local_ray, tmp_path):
    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainer = Trainer.remote(SPEC, lr=1e-3)
    config = dcr_ray.RefitConfig(commit=dcr_ray.CommitConfig(dir=str(tmp_path / "commit"), timeout_s=20.0))
    refit = dcr_ray.launch(owners=[trainer], engine=dcr_ray.HFEngine(SPEC), config=config,
                           clusters=[dcr_ray.ClusterSpec(name="a", engines=2)])
    try:
        trainer_at = {0: ray.get(trainer.rollout_state.remote())}
        refit.drain("a/e1")  # it misses the next refit, as an engine evicted as hung does
        ray.get(trainer.step.remote(seed=0))
        trainer_at[1] = ray.get(trainer.rollout_state.remote())
        report = refit.run(timeout=120)
        assert report.version == 1 and sorted(report.engine_versions) == ["a/e0"], report
        # where an engine evicted mid-stream stands: inside the committed transfer, part of its frames
        # applied in place, never flushed (its protocol driven by hand with the transfer's real frames)
        slow = refit.engines()["a/e1"]
        frames = _frames(trainer_at[0], trainer_at[1], report.transfer)
        ray.get(slow.prepare.remote(report.transfer, 0, 0, 1, "attach"))
        for f in frames[: len(frames) // 2]:
            assert ray.get(slow.deliver.remote(f)) == "applied"
        assert ray.get(slow.state.remote())["phase"] == "open"
        ray.kill(refit.actor, no_restart=False)  # the process dies; Ray restarts it and it resumes
        st = _resumed(refit)
        assert st["version"] == 1 and "a/e0" in st["required"], st["standings"]
        assert "a/e1" not in st["required"] or ray.get(slow.get_version.remote()) == 1
        for e in refit.engines().values():
            _serves_the_trainers_bits(e, trainer_at)
        refit.wait_healed(timeout=120)
        assert sorted(refit.status()["required"]) == ["a/e0", "a/e1"]
        assert_no_wrong_bits(refit, trainer_at[1], 1)
    finally:
        refit.shutdown()
