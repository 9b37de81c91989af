"""Faults that compose with a refit already under way, on real Ray: what a restarted coordinator may
activate, and what a retry must carry. Each test ends with the trainer as the oracle: every engine that
says it holds a version holds the trainer's tensors of that version, bit for bit (integer views).

* A head relay killed mid-stream (its owners' sends fail while their lazy diff has read part of the
  tensors): the retry carries the whole changed set, and every engine of both clusters holds the
  trainer's bits.
* A coordinator that restarts after a refit committed without an engine evicted mid-stream activates
  only the record's members that flushed its transfer; the evicted one, which holds part of it, rolls
  back and heals.
* A failure between attempts (the sweep) is neither a lost owner nor an escape from the refit; whatever
  escapes the attempts still ends with the final abort; the healing worker outlives a failed re-creation.
  These three inject one exception into the coordinator's own process (``__ray_call__``): the real
  triggers (a relay's wiring that times out, Ray's node table unreachable) take minutes or a broken GCS.
* Bad input changes nothing: a dense bootstrap of an engine that is not required, a launch whose clusters
  no node can hold, a replacement owner named with the wrong id first.
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
from dcr_ray.errors import ConfigError, RefitError, RefitTimeoutError
from dcr_ray.failpoints import remote as fp_remote
from dcr_ray.failpoints.plan import Fault
from dcr_ray.testing.faults import FlakyEngine
from dcr_ray.testing.links import EmulatedLinks
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


@pytest.mark.timeout(300)
def test_a_head_relay_killed_mid_stream_costs_a_retry_that_carries_the_whole_changed_set(local_ray, tmp_path):
    spec = ModelSpec(size="mini")  # chunked MLP tensors: each owner streams dozens of 32 KiB frames
    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainers = [Trainer.remote(spec, lr=1e-3, rank=r, world=2) for r in range(2)]
    config = dcr_ray.RefitConfig(codec=dcr_ray.CodecConfig(bucket_bytes=1 << 15, chunk_elems=1 << 12),
                                 commit=dcr_ray.CommitConfig(dir=str(tmp_path / "commit"), timeout_s=60.0))
    transport = EmulatedLinks(config, {"a": (10.0, 0.0), "b": (10.0, 0.0)})  # a refit's stream takes seconds
    refit = dcr_ray.launch(owners=trainers, engine=dcr_ray.HFEngine(spec), config=config, transport=transport,
                           clusters=[dcr_ray.ClusterSpec(name=c, engines=2) for c in "ab"])
    try:
        ray.get([t.step.remote(seed=0) for t in trainers])
        refit.run(timeout=180)
        ray.get([t.step.remote(seed=1) for t in trainers])
        head = ray.get(refit.actor.handles.remote())["relays"]["a/head"]
        pending = refit.remote()
        deadline = time.monotonic() + 60
        while refit.status()["phase"]["phase"] != "stream":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.5)  # a few frames crossed, most of the diff still unread
        ray.kill(head)
        report = ray.get(pending, timeout=240)
        assert report.version == 2 and report.attempts == 2 and report.mode == "overwrite", report
        assert sorted(report.engine_versions) == ["a/e0", "a/e1", "b/e0", "b/e1"]
        assert_no_wrong_bits(refit, ray.get(trainers[0].rollout_state.remote()), 2)
    finally:
        refit.shutdown()


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


def _launch(engine, clusters, tmp_path, **commit):
    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainer = Trainer.remote(SPEC, lr=1e-3)
    config = dcr_ray.RefitConfig(codec=dcr_ray.CodecConfig(bucket_bytes=1 << 14, chunk_elems=1 << 11),
                                 commit=dcr_ray.CommitConfig(dir=str(tmp_path / "commit"), **commit))
    return dcr_ray.launch(owners=[trainer], engine=engine, config=config, clusters=clusters), trainer


def _failing_once(part: str, method: str, error: Exception, skip: int = 0):
    """A function to run in the coordinator (``__ray_call__``; made here so that it travels by value): the
    ``skip + 1``-th call of ``part.method`` raises ``error``, the others run as before."""
    def install(coordinator) -> None:
        obj = coordinator
        for name in part.split("."):
            obj = getattr(obj, name)
        inner = getattr(obj, method)
        calls = []

        def wrapped(*args, **kwargs):
            calls.append(1)
            if len(calls) == skip + 1:
                raise error
            return inner(*args, **kwargs)
        setattr(obj, method, wrapped)
    return install


@pytest.mark.timeout(240)
@pytest.mark.parametrize("error", [RefitTimeoutError("injected: a relay's wiring timed out"),
                                   ConnectionError("injected: Ray's node table could not be read")],
                         ids=["timeout", "connection"])
def test_a_sweep_that_fails_between_attempts_is_no_lost_owner_and_the_next_attempt_commits(local_ray, tmp_path, error):
    # attempt 0 fails on every engine after two frames; the sweep after it raises once
    refit, trainer = _launch(FlakyEngine(dcr_ray.HFEngine(SPEC), fail_after=2), [dcr_ray.ClusterSpec(name="a", engines=2)],
                             tmp_path)
    try:
        ray.get(refit.actor.__ray_call__.remote(_failing_once("_outages", "sweep", error, skip=1)))
        ray.get(trainer.step.remote(seed=0))
        report = refit.run(timeout=120)
        assert report.version == 1 and report.attempts == 2, report
        assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), 1)
    finally:
        refit.shutdown()


@pytest.mark.timeout(240)
def test_an_error_escaping_the_attempts_still_ends_with_the_final_abort_and_the_engines_serve_the_committed_bits(
        local_ray, tmp_path):
    refit, trainer = _launch(FlakyEngine(dcr_ray.HFEngine(SPEC), fail_after=2), [dcr_ray.ClusterSpec(name="a", engines=2)],
                             tmp_path)
    try:
        committed = ray.get(trainer.rollout_state.remote())
        ray.get(refit.actor.__ray_call__.remote(_failing_once("_recovery", "repair", RuntimeError("injected"))))
        ray.get(trainer.step.remote(seed=0))
        with pytest.raises(dcr_ray.RefitError, match="committed version stays 0.*injected"):
            refit.run(timeout=120)
        for e in refit.engines().values():  # closed, rolled back in place, serving v0
            st = ray.get(e.state.remote())
            assert (st["phase"], st["transfer"]) == ("ready", None), st
            assert ray.get(e.generate.remote([[1, 2, 3]], 1, 30.0))["version"] == 0
        assert_no_wrong_bits(refit, committed, 0)
        report = refit.run(timeout=120)  # the owners discarded their pending set: the next refit is whole
        assert report.version == 1
        assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), 1)
    finally:
        refit.shutdown()


@pytest.mark.timeout(240)
def test_an_error_before_any_attempt_fails_the_refit_with_a_refit_error_that_names_the_retry(local_ray, tmp_path):
    """Found by ``dcr-ray chaos --enumerate`` (coordinator.refit and coordinator.sweep with raise): an error
    raised before the attempts reached the caller as itself, naming no fix."""
    refit, trainer = _launch(dcr_ray.HFEngine(SPEC), [dcr_ray.ClusterSpec(name="a", engines=2)], tmp_path)
    try:
        committed = ray.get(trainer.rollout_state.remote())
        fp_remote.arm_actor(refit.actor, [Fault(point="coordinator.refit", action="raise")])
        ray.get(trainer.step.remote(seed=0))
        with pytest.raises(RefitError, match="committed version is 0.*Refit.run\\(\\) tries again"):
            refit.run(timeout=120)
        fp_remote.report_of(refit.actor, disarm=True)
        assert_no_wrong_bits(refit, committed, 0)
        assert refit.run(timeout=120).version == 1
        assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), 1)
    finally:
        refit.shutdown()


@pytest.mark.timeout(240)
def test_the_healing_worker_outlives_a_failed_re_creation(local_ray, tmp_path):
    refit, trainer = _launch(dcr_ray.HFEngine(SPEC), [dcr_ray.ClusterSpec(name="a", engines=2)], tmp_path)
    try:
        ray.get(refit.actor.__ray_call__.remote(_failing_once("_shared.topology", "retire", RuntimeError("injected"))))
        raytools.kill_and_wait(refit.engines()["a/e1"])
        ray.get(trainer.step.remote(seed=0))
        report = refit.run(timeout=120)
        assert report.dropped_engines == ["a/e1"], report
        refit.wait_healed(timeout=120)
        assert sorted(refit.status()["required"]) == ["a/e0", "a/e1"]
        assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), 1)
    finally:
        refit.shutdown()


@pytest.mark.timeout(240)
def test_a_dense_bootstrap_of_an_engine_that_is_not_required_is_refused_before_any_write(local_ray, tmp_path):
    refit, trainer = _launch(dcr_ray.HFEngine(SPEC), [dcr_ray.ClusterSpec(name="a", engines=2)], tmp_path)
    try:
        committed = ray.get(trainer.rollout_state.remote())
        refit.drain("a/e1")
        before = ray.get(refit.engines()["a/e1"].info.remote())["applied"]
        with pytest.raises(ConfigError, match="'a/e1' is 'out'.*Refit.rejoin"):
            ray.get(refit.actor.bootstrap_dense.remote(["a/e1"]))
        assert ray.get(refit.engines()["a/e1"].info.remote())["applied"] == before
        assert refit.status()["standings"]["a/e1"] == "out"
        assert_no_wrong_bits(refit, committed, 0)
    finally:
        refit.shutdown()


@pytest.mark.timeout(240)
def test_a_dense_bootstrap_that_fails_mid_stream_leaves_its_engine_healing_and_the_next_refit_commits(
        local_ray, tmp_path):
    """Found by ``dcr-ray chaos --enumerate`` (owner.bootstrap/raise): the engine a failed dense bootstrap
    wrote into held no version yet stayed required, and every later refit failed on it."""
    refit, trainer = _launch(dcr_ray.HFEngine(SPEC), [dcr_ray.ClusterSpec(name="a", engines=2)], tmp_path)
    try:
        fp_remote.arm_actor(trainer, [Fault(point="owner.bootstrap", action="raise")])
        with pytest.raises(RefitError, match="left the required set and heal.*Refit.wait_healed"):
            ray.get(refit.actor.bootstrap_dense.remote(["a/e0"]))
        fp_remote.report_of(trainer, disarm=True)
        ray.get(trainer.step.remote(seed=0))
        report = refit.run(timeout=120)
        assert report.version == 1
        refit.wait_healed(timeout=120)
        assert sorted(refit.status()["required"]) == ["a/e0", "a/e1"]
        assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), 1)
    finally:
        refit.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cluster", [dict(resources={"nowhere": 0.01}), dict(cpus_per_engine=2.0)],
                         ids=["a resource no node has", "room for one of two engines"])
def test_a_launch_whose_engines_the_nodes_cannot_hold_is_refused_before_anything_starts(local_ray, tmp_path,
                                                                                       cluster):
    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainer = Trainer.remote(SPEC)
    config = dcr_ray.RefitConfig(commit=dcr_ray.CommitConfig(dir=str(tmp_path / "commit"), start_timeout_s=20.0))
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="the alive nodes hold (0|1) of its 2 engines"):
        dcr_ray.launch(owners=[trainer], engine=dcr_ray.HFEngine(SPEC), config=config,
                       clusters=[dcr_ray.ClusterSpec(name="a", engines=2, **cluster)])
    assert time.monotonic() - t0 < 15.0
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("dcr_")]


@pytest.mark.timeout(300)
def test_a_replacement_owner_named_with_the_wrong_id_first_takes_its_place_under_the_right_one(local_ray, tmp_path):
    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainers = [Trainer.remote(SPEC, lr=1e-3, rank=r, world=2) for r in range(2)]
    config = dcr_ray.RefitConfig(commit=dcr_ray.CommitConfig(dir=str(tmp_path / "commit")))
    refit = dcr_ray.launch(owners=trainers, engine=dcr_ray.HFEngine(SPEC), config=config,
                           clusters=[dcr_ray.ClusterSpec(name="a", engines=1)])
    try:
        ray.get([t.step.remote(seed=0) for t in trainers])
        assert refit.run(timeout=120).version == 1
        raytools.kill_and_wait(trainers[1])
        ray.get(trainers[0].step.remote(seed=1))
        with pytest.raises(dcr_ray.RefitError, match="replace_owner"):
            refit.run(timeout=120)
        new = Trainer.remote(SPEC, lr=1e-3, rank=1, world=2)
        ray.get(new.step.remote(seed=0))  # it holds the committed bits (v1) of rank 1
        with pytest.raises(ConfigError, match="covers other tensors"):
            refit.replace_owner("owner0", new)  # the wrong id: refused
        refit.replace_owner("owner1", new)
        ray.get(new.step.remote(seed=1))  # then it takes the step the other rank took
        assert refit.run(timeout=120).version == 2
        assert_no_wrong_bits(refit, ray.get(trainers[0].rollout_state.remote()), 2)
    finally:
        refit.shutdown()


@pytest.mark.timeout(240)
def test_a_heal_from_the_owners_whose_stream_stalls_gives_the_coordinator_lock_back_within_the_stage_timeout(
        local_ray, tmp_path):
    """The last resort of a heal (no peer, no window: the owners send the committed version densely) holds
    the coordinator's lock, since a refit's promote would replace the baseline under the stream; each of its
    waits is bounded by the stage timeout (3 s here), not ``start_timeout_s`` (30 min), so a stalled owner
    costs the refits one stage, and the heal's next round lands the trainer's bits."""
    from dcr_ray.failpoints import remote as failpoints_remote

    refit, trainer = _launch(dcr_ray.HFEngine(SPEC), [dcr_ray.ClusterSpec(name="a", engines=1)], tmp_path,
                             timeout_s=3.0)
    try:
        ray.get(trainer.step.remote(seed=0))
        refit.run(timeout=120)
        failpoints_remote.arm_actor(trainer, "owner.bootstrap=stall(8)")  # the first dense send stalls 8 s
        t0 = time.monotonic()
        refit.invalidate("a/e0")  # its only copy is in doubt: nothing but the owners can hand it over
        st = refit.wait_healed(timeout=120)
        healed = [h for h in st["healed"] if h["engine"] == "a/e0"][-1]
        assert healed["sources"][-1] == "owners", healed
        # before the bound, the first round held the lock for the whole 8 s stall (and up to 30 min)
        assert healed["lock_longest_seconds"] < 3.0 + 2.0, healed
        assert time.monotonic() - t0 < 60
        assert failpoints_remote.report_of(trainer, disarm=True)["fired"], "the stall never fired"
        assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), 1)
    finally:
        refit.shutdown()
