"""The coordinator, engines and relays do not share a fate: a new coordinator resumes from the commit
record, a dead relay's cluster tree is re-planned, and a stale coordinator is fenced."""

from __future__ import annotations

import time

import raytools  # noqa: F401
from raytools import assert_no_wrong_bits, check_engines, half_written  # noqa: F401
from raytools import fresh_local_ray as local_ray  # noqa: F401  (this module kills and re-creates detached actors)

import pytest
import ray
import torch

import dcr_ray
from dcr_ray.actors.fleet.commit import CommitLog, CommitRecord
from dcr_ray.engines.base import checkpoint_state_dict
from dcr_ray.errors import CommitConflictError, CoordinatorGoneError
from dcr_ray.options import COORDINATOR_NAME, NAMESPACE
from dcr_ray.testing.faults import TrainerThatKillsTheCoordinatorAtPromote
from dcr_ray.testing.models import ModelSpec, build_model
from dcr_ray.testing.trainer import TinyTrainer

SPEC = ModelSpec(size="tiny")


def test_a_coordinator_of_an_older_epoch_cannot_move_the_commit_record(tmp_path):
    log = CommitLog(str(tmp_path))
    log.compare_and_set(None, CommitRecord(version=0, transfer="attach", baseline=""))
    log.compare_and_set(0, CommitRecord(version=0, transfer="attach", baseline="", epoch=1))  # a resume
    with pytest.raises(CommitConflictError, match="fenced"):
        log.compare_and_set(0, CommitRecord(version=1, transfer="t", baseline="attach", epoch=0))
    assert log.read().version == 0 and log.read().epoch == 1


def _launch(tmp_path, resume=False, owners=None, transport="relay"):
    if owners is None:
        Trainer = ray.remote(num_cpus=0)(TinyTrainer)
        owners = [Trainer.remote(SPEC, lr=1e-3)]
    config = dcr_ray.RefitConfig(codec=dcr_ray.CodecConfig(bucket_bytes=1 << 18, chunk_elems=1 << 15),
                                 commit=dcr_ray.CommitConfig(dir=str(tmp_path / "commit"), timeout_s=60),
                                 transport=dcr_ray.TransportConfig(kind=transport))
    refit = dcr_ray.launch(owners=owners, engine=dcr_ray.HFEngine(SPEC), config=config, resume=resume,
                           clusters=[dcr_ray.ClusterSpec(name="a", engines=2), dcr_ray.ClusterSpec(name="b", engines=1)])
    return refit, owners


def _resumed(refit, epoch=1, timeout=60):
    """The status of the restarted coordinator (the kill is asynchronous: the old one may answer first)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            st = refit.status()
            if st["commit_record"]["epoch"] >= epoch:
                return st
        except ray.exceptions.RayActorError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError("the coordinator did not resume")
        time.sleep(0.5)


def _wait_gone(name, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.2)
    raise AssertionError(f"{name} still registered after {timeout} s")


@pytest.mark.slow
def test_a_crashed_coordinator_is_restarted_by_ray_and_resumes_with_the_same_engines(local_ray, tmp_path):
    refit, (trainer,) = _launch(tmp_path)
    try:
        ray.get(trainer.step.remote(seed=0))
        assert refit.run().version == 1
        engines = refit.engines()
        applied = {e: ray.get(h.info.remote())["applied"] for e, h in engines.items()}
        ray.kill(refit.actor, no_restart=False)  # the process dies; Ray restarts the actor
        st = _resumed(refit)
        assert st["version"] == 1 and st["required"] == sorted(engines)
        assert refit.engines() == engines  # the same engine actors, not re-created
        # nothing was re-sent to them: no dense bootstrap on resume
        assert {e: ray.get(h.info.remote())["applied"] for e, h in engines.items()} == applied
        ray.get(trainer.step.remote(seed=1))
        assert refit.run().version == 2
        check_engines(refit, trainer)
    finally:
        refit.shutdown()


@pytest.mark.slow
def test_a_coordinator_killed_for_good_after_its_commit_says_so_and_launch_with_resume_carries_on(
        local_ray, tmp_path):
    """The coordinator dies for good inside a refit, right after the commit record: the call answers with a
    DcrError naming the version it committed and the resume call (not Ray's ActorDiedError), and so does
    ``Refit.get()``; engines keep serving that version, and ``launch(resume=True)`` carries on."""
    trainer = ray.remote(num_cpus=0)(TrainerThatKillsTheCoordinatorAtPromote).remote(SPEC, lr=1e-3, for_good=True)
    refit, owners = _launch(tmp_path, owners=[trainer], transport="object_store")
    try:
        ray.get(trainer.step.remote(seed=0))
        with pytest.raises(CoordinatorGoneError, match=r"(?s)gone for good; this refit committed version 1 .*"
                                                       r"resume=True"):
            ray.get(refit.remote())
        _wait_gone(COORDINATOR_NAME)
        with pytest.raises(CoordinatorGoneError, match=r"(?s)the commit record holds version 1 .*resume=True"):
            dcr_ray.Refit.get()
        with pytest.raises(dcr_ray.errors.ConfigError, match="resume=True"):
            _launch(tmp_path, owners=owners, transport="object_store")  # a fresh launch on a used record...
        refit, _ = _launch(tmp_path, resume=True, owners=owners, transport="object_store")  # ...resume
        assert refit.status()["version"] == 1
        assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), 1)
        ray.get(trainer.step.remote(seed=1))
        assert refit.run().version == 2
        check_engines(refit, trainer)
        assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), 2)
    finally:
        refit.shutdown()
    with pytest.raises(dcr_ray.errors.ConfigError, match="no dcr_ray topology runs"):
        dcr_ray.Refit.get()  # shut down: nothing to resume


@pytest.mark.slow
def test_a_coordinator_that_died_inside_a_transfer_is_resumed_with_the_engines_rolled_back(local_ray, tmp_path):
    refit, (trainer,) = _launch(tmp_path)
    try:
        committed = ray.get(trainer.rollout_state.remote())
        eng = half_written(refit, trainer, committed)  # two attempts of a transfer written in place
        ray.kill(refit.actor, no_restart=False)
        assert _resumed(refit)["version"] == 0
        assert ray.get(eng.state.remote())["phase"] == "ready"  # rolled back by the resumed coordinator
        got = ray.get(eng.tensors.remote())
        for n in committed:
            assert torch.equal(got[n].view(torch.int16), committed[n].view(torch.int16)), n
        assert refit.run().version == 1
        check_engines(refit, trainer)
    finally:
        refit.shutdown()


@pytest.mark.slow
def test_a_dead_head_relay_is_replaced_and_only_its_cluster_notices_a_retry(local_ray, tmp_path):
    refit, (trainer,) = _launch(tmp_path)
    try:
        relays = ray.get(refit.actor.handles.remote())["relays"]
        ray.kill(relays["b/head"])
        ray.get(trainer.step.remote(seed=0))
        report = refit.run()
        assert report.version == 1 and report.retries >= 1
        assert set(report.engine_versions) == {"a/e0", "a/e1", "b/e0"}
        now = ray.get(refit.actor.handles.remote())["relays"]
        assert now["b/head"] != relays["b/head"] and now["a/head"] == relays["a/head"]
        check_engines(refit, trainer)
        ray.get(trainer.step.remote(seed=1))
        assert refit.run().retries == 0
        check_engines(refit, trainer)
    finally:
        refit.shutdown()


def _config(commit_dir) -> dcr_ray.RefitConfig:
    return dcr_ray.RefitConfig(codec=dcr_ray.CodecConfig(bucket_bytes=1 << 18, chunk_elems=1 << 15),
                               commit=dcr_ray.CommitConfig(dir=str(commit_dir / "commit"), timeout_s=60))


@pytest.mark.slow
def test_owners_made_by_launch_survive_a_coordinator_restart(local_ray, tmp_path):
    state = {n: t.to(torch.bfloat16).contiguous() for n, t in checkpoint_state_dict(build_model(SPEC)).items()}
    refit = dcr_ray.launch(owner_tensors=[state], engine=dcr_ray.HFEngine(SPEC), config=_config(tmp_path),
                           clusters=[dcr_ray.ClusterSpec(name="a", engines=2)])
    try:
        del state
        ray.kill(refit.actor, no_restart=False)  # the coordinator's process dies; Ray restarts it
        _resumed(refit)
        (owner,) = refit.owners().values()
        new = {n: t.clone() for n, t in ray.get(owner.dcr_tensors.remote()).items()}
        for t in new.values():
            t.view(-1).view(torch.int16)[::7] ^= 1
        ray.get(owner.set_tensors.remote(new))
        assert refit.run().version == 1
        assert_no_wrong_bits(refit, new, 1)
    finally:
        refit.shutdown()
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("dcr_owner:")]


@pytest.mark.slow
def test_a_coordinator_killed_right_after_its_commit_record_answers_with_the_committed_report(local_ray, tmp_path):
    trainer = ray.remote(num_cpus=0)(TrainerThatKillsTheCoordinatorAtPromote).remote(SPEC, lr=1e-3)
    refit = dcr_ray.launch(owners=[trainer], engine=dcr_ray.HFEngine(SPEC), config=_config(tmp_path),
                           clusters=[dcr_ray.ClusterSpec(name="a", engines=2)])
    try:
        ray.get(trainer.step.remote(seed=0))
        report = refit.run()  # the coordinator dies in this call, after the record; Ray retries the call
        assert report.version == 1 and report.from_record and report.engine_versions == {"a/e0": 1, "a/e1": 1}
        assert any("from the commit record" in w for w in report.warnings), report.warnings
        assert "answered from the commit record" in str(report) and "elements changed" not in str(report)
        assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), 1)
        ray.get(trainer.step.remote(seed=1))
        assert refit.run().version == 2  # not refit twice: the retried call did not make a version 2
        assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), 2)
    finally:
        refit.shutdown()
