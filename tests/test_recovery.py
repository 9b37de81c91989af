"""Failures during a refit: partial XOR repaired by an OVERWRITE retry; dead engines leave the set."""

from __future__ import annotations

import raytools  # noqa: F401
from raytools import assert_no_wrong_bits, check_engines, half_written, local_ray  # noqa: F401  (local_ray: module-scoped Ray fixture)

import pytest
import ray
import torch

import dcr_ray
from dcr_ray.testing.models import ModelSpec
from dcr_ray.testing.faults import FlakyEngine, TrainerThatFailsToPromoteOnce
from dcr_ray.testing.trainer import TinyTrainer

pytestmark = pytest.mark.slow
SPEC = ModelSpec(size="tiny")


def _start(engine, clusters, trainer_cls=TinyTrainer, max_attempts: int = 3, rollback: str = "in_place"):
    Trainer = ray.remote(num_cpus=0)(trainer_cls)
    trainer = Trainer.remote(SPEC, lr=1e-3)
    refit = dcr_ray.launch(owners=[trainer], clusters=clusters, engine=engine,
                           config=dcr_ray.RefitConfig(codec=dcr_ray.CodecConfig(bucket_bytes=1 << 18, chunk_elems=1 << 15),
                                                      commit=dcr_ray.CommitConfig(max_attempts=max_attempts),
                                                      engines=dcr_ray.EngineConfig(rollback=rollback)))
    return refit, trainer


def test_a_partially_applied_xor_attempt_is_repaired_by_an_overwrite_retry(local_ray):
    engine = FlakyEngine(dcr_ray.HFEngine(SPEC), fail_after=2)
    refit, trainer = _start(engine, [dcr_ray.ClusterSpec(name="a", engines=2)])
    try:
        ray.get(trainer.step.remote(seed=0))
        report = refit.run()
        # attempt 0 applied two XOR frames on each engine, then failed; attempt 1 overwrote them
        assert report.retries == 1 and report.mode == "overwrite" and report.version == 1
        assert report.payloads > 2
        check_engines(refit, trainer)
        ray.get(trainer.step.remote(seed=1))
        report = refit.run()  # the next refit is clean again (mixed XOR/OVERWRITE)
        assert report.retries == 0 and report.mode == "mixed"
        check_engines(refit, trainer)
    finally:
        refit.shutdown()


def test_a_dead_engine_is_dropped_from_the_refit_and_comes_back_recreated_at_the_committed_version(local_ray):
    refit, trainer = _start(dcr_ray.HFEngine(SPEC),
                            [dcr_ray.ClusterSpec(name="a", engines=2), dcr_ray.ClusterSpec(name="b", engines=1)])
    try:
        dead = refit.engines()["a/e1"]
        ray.kill(dead)
        ray.get(trainer.step.remote(seed=0))
        report = refit.run()
        assert report.dropped_engines == ["a/e1"]
        assert set(report.engine_versions) == {"a/e0", "b/e0"}
        assert any("a/e1 died; it is re-created and heals in the background" in w for w in report.warnings)
        # the refit answered at commit; a/e1 heals beside it, from its cluster's peer a/e0 (not the owners)
        st = refit.wait_healed(timeout=120)
        assert [(h["engine"], h["source"], h["version"]) for h in st["healed"]] == [("a/e1", "a/e0", 1)]
        # the fleet is back at its configured size, every engine at v1, bit for bit
        assert st["required"] == ["a/e0", "a/e1", "b/e0"]
        assert refit.engines()["a/e1"] != dead
        assert ray.get(refit.engines()["a/e1"].info.remote())["healed_from_peer"] == 1
        check_engines(refit, trainer)
        ray.get(trainer.step.remote(seed=1))
        assert set(refit.run().engine_versions) == {"a/e0", "a/e1", "b/e0"}
        check_engines(refit, trainer)
        # the whole of cluster b is lost: its engine heals from a peer of cluster a, and the report says so
        ray.kill(refit.engines()["b/e0"])
        ray.get(trainer.step.remote(seed=2))
        report = refit.run()
        assert any("b/e0 died" in w and "from a peer of another cluster: its whole cluster 'b' was lost" in w
                   for w in report.warnings), report.warnings
        refit.wait_healed(timeout=120)
        check_engines(refit, trainer)
    finally:
        refit.shutdown()


def test_a_refit_that_keeps_failing_raises_and_the_committed_version_stays(local_ray):
    engine = FlakyEngine(dcr_ray.HFEngine(SPEC), fail_after=0)
    refit, trainer = _start(engine, [dcr_ray.ClusterSpec(name="a", engines=1)], max_attempts=1)
    try:
        committed = ray.get(trainer.rollout_state.remote())
        ray.get(trainer.step.remote(seed=0))
        with pytest.raises(dcr_ray.RefitError, match="committed version stays 0"):
            refit.run()
        assert refit.status()["version"] == 0
        assert ray.get(trainer.dcr_version.remote()) == 0
        assert_no_wrong_bits(refit, committed, 0)
    finally:
        refit.shutdown()


@pytest.mark.parametrize("rollback", ["in_place", "dense"])
def test_an_abandoned_refit_that_wrote_in_place_restores_the_engines_to_the_committed_bits(local_ray, rollback):
    # the engine applies one frame in place, then fails; with one attempt allowed the refit is
    # abandoned: the engine must not keep serving (or take deltas on) half-applied weights. It rolls
    # back from its own undo record (in_place) or is re-bootstrapped densely by the coordinator.
    engine = FlakyEngine(dcr_ray.HFEngine(SPEC), fail_after=1)
    refit, trainer = _start(engine, [dcr_ray.ClusterSpec(name="a", engines=1)], max_attempts=1, rollback=rollback)
    try:
        eng = refit.engines()["a/e0"]
        committed = ray.get(trainer.rollout_state.remote())
        ray.get(trainer.step.remote(seed=0))
        with pytest.raises(dcr_ray.RefitError, match="committed version stays 0"):
            refit.run()
        assert refit.status()["version"] == 0 and refit.status()["required"] == ["a/e0"]
        got = ray.get(eng.tensors.remote())
        for n in committed:  # back at version 0, bit for bit
            assert torch.equal(got[n].view(torch.int16), committed[n].view(torch.int16)), n
        assert ray.get(eng.get_version.remote()) == 0
        assert ray.get(eng.info.remote())["rollbacks"] == (1 if rollback == "in_place" else 0)
        # and the next refit (the fault fired once) lands exactly on the trainer's bits
        ray.get(trainer.step.remote(seed=1))
        assert refit.run().version == 1
        check_engines(refit, trainer)
    finally:
        refit.shutdown()


def test_a_failure_after_the_commit_record_rolls_forward_and_is_reported_not_retried(local_ray):
    refit, trainer = _start(dcr_ray.HFEngine(SPEC), [dcr_ray.ClusterSpec(name="a", engines=1)],
                            trainer_cls=TrainerThatFailsToPromoteOnce)
    try:
        ray.get(trainer.step.remote(seed=0))
        report = refit.run()
        # committed and active on the engines, with the owner's failure reported
        assert report.version == 1 and report.retries == 0 and report.engine_versions == {"a/e0": 1}
        assert len(report.warnings) == 1 and "did not promote" in report.warnings[0]
        assert "Refit.replace_owner(owner_id, handle)" in report.warnings[0]
        assert refit.status()["version"] == 1
        check_engines(refit, trainer)
        # the owner's baseline is still v0, so its next stream is refused with a clear error and
        # nothing is written: the committed version stays 1
        ray.get(trainer.step.remote(seed=1))
        with pytest.raises(dcr_ray.RefitError, match="(?s)after 1 attempt.*committed version stays 1.*holds committed version 0"):
            refit.run()
        assert refit.status()["version"] == 1 and refit.status()["required"] == ["a/e0"]
    finally:
        refit.shutdown()


def test_an_abandoned_transfer_rolls_back_in_place_to_exactly_the_committed_bits(local_ray):
    refit, trainer = _start(dcr_ray.HFEngine(SPEC), [dcr_ray.ClusterSpec(name="a", engines=1)])
    try:
        committed = ray.get(trainer.rollout_state.remote())
        eng = half_written(refit, trainer, committed)
        assert ray.get(eng.abort.remote("T", True)) == {"engine": "a/e0", "dirty": False, "rolled_back": True}
        got = ray.get(eng.tensors.remote())
        for n in committed:
            assert torch.equal(got[n].view(torch.int16), committed[n].view(torch.int16)), n
        assert ray.get(eng.generate.remote([[1, 2, 3]], 2))["version"] == 0
        ray.get(trainer.dcr_discard.remote())
        assert refit.run().version == 1  # takes deltas on v0 again, no rejoin
        check_engines(refit, trainer)
    finally:
        refit.shutdown()


def test_an_engine_left_with_half_written_weights_refuses_work_until_it_rejoins(local_ray):
    # drive the engine protocol by hand: one frame of a transfer applied in place, then the transfer
    # is abandoned; the engine must say it holds no version instead of serving or taking deltas
    # with rollback="dense" (as for backends that cannot read their bits back) the engine holds no version
    refit, trainer = _start(dcr_ray.HFEngine(SPEC), [dcr_ray.ClusterSpec(name="a", engines=1)], rollback="dense")
    try:
        committed = ray.get(trainer.rollout_state.remote())
        eng = half_written(refit, trainer, committed)
        assert ray.get(eng.abort.remote("T", True)) == {"engine": "a/e0", "dirty": True}
        with pytest.raises(dcr_ray.DcrError, match="holds no version"):
            ray.get(eng.generate.remote([[1, 2, 3]], 2))
        with pytest.raises(dcr_ray.DcrError, match="must be bootstrapped"):
            ray.get(eng.prepare.remote("U", 0, 0, 1))
        refit.rejoin("a/e0")  # dense bootstrap to the committed version 0
        got = ray.get(eng.tensors.remote())
        for n in committed:
            assert torch.equal(got[n].view(torch.int16), committed[n].view(torch.int16)), n
        assert ray.get(eng.generate.remote([[1, 2, 3]], 2))["version"] == 0
        assert_no_wrong_bits(refit, committed, 0)
    finally:
        refit.shutdown()


def test_a_dead_owner_fails_the_refit_cleanly_and_a_replacement_with_the_committed_bits_takes_its_place(local_ray):
    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainers = [Trainer.remote(SPEC, lr=1e-3, rank=r, world=2) for r in range(2)]
    refit = dcr_ray.launch(owners=trainers, clusters=[dcr_ray.ClusterSpec(name="a", engines=2)],
                           engine=dcr_ray.HFEngine(SPEC),
                           config=dcr_ray.RefitConfig(codec=dcr_ray.CodecConfig(bucket_bytes=1 << 18, chunk_elems=1 << 15)))
    try:
        ray.get([t.step.remote(seed=0) for t in trainers])
        assert refit.run().version == 1
        committed = ray.get(trainers[0].rollout_state.remote())
        ray.kill(trainers[1])
        ray.get(trainers[0].step.remote(seed=1))
        with pytest.raises(dcr_ray.RefitError, match="owner actor.*died.*committed version stays 1|committed version stays 1"):
            refit.run()
        # the engines were rolled back in place (no owner is needed for that) and still serve v1
        for eid, eng in refit.engines().items():
            got = ray.get(eng.tensors.remote())
            assert ray.get(eng.get_version.remote()) == 1
            for n in committed:
                assert torch.equal(got[n].view(torch.int16), committed[n].view(torch.int16)), (eid, n)
        # a replacement that does not hold v1 is refused and changes nothing
        stale = Trainer.remote(SPEC, lr=1e-3, rank=1, world=2)
        with pytest.raises(dcr_ray.errors.ConfigError, match="does not hold committed version 1"):
            refit.replace_owner("owner1", stale)
        # one restored to v1 (here: the same step replayed) takes owner1's place; refits go on
        good = Trainer.remote(SPEC, lr=1e-3, rank=1, world=2)
        ray.get(good.step.remote(seed=0))
        refit.replace_owner("owner1", good)
        ray.get(good.step.remote(seed=1))
        assert refit.run().version == 2
        check_engines(refit, good)
        check_engines(refit, trainers[0])
    finally:
        refit.shutdown()


def test_a_hung_engine_is_evicted_at_the_stage_timeout_and_rejoins_when_it_answers_again(local_ray, tmp_path):
    from dcr_ray.testing.faults import StallingEngine, release_stall

    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainer = Trainer.remote(SPEC, lr=1e-3)
    # engine a/e1's first delta flush hangs until released (at most 120 s); the stage timeout is 4 s
    release = str(tmp_path / "release")
    refit = dcr_ray.launch(owners=[trainer], clusters=[dcr_ray.ClusterSpec(name="a", engines=2)],
                           engine=StallingEngine(dcr_ray.HFEngine(SPEC), stall_s=120.0, only="a/e1",
                                                 release=release),
                           config=dcr_ray.RefitConfig(commit=dcr_ray.CommitConfig(timeout_s=4)))
    try:
        ray.get(trainer.step.remote(seed=0))
        report = refit.run()
        assert report.version == 1 and set(report.engine_versions) == {"a/e0"}
        assert any("a/e1 did not answer and is evicted" in w for w in report.warnings)
        assert refit.status()["required"] == ["a/e0"]
        check_engines(refit, trainer, engines={"a/e0"})
        release_stall(release)  # the stall ends: a/e1 finishes the flush it hung in
        ray.get(trainer.step.remote(seed=1))
        report = refit.run()
        # it hung inside the flush of the transfer that committed v1, having applied all of it: it is
        # activated at v1 (no dense bootstrap) and takes part in the refit to v2
        assert any("a/e1 answers again and rejoined at version 1 (it had applied the committed transfer" in w
                   for w in report.warnings), report.warnings
        assert set(report.engine_versions) == {"a/e0", "a/e1"}
        assert refit.status()["required"] == ["a/e0", "a/e1"]
        check_engines(refit, trainer)
    finally:
        refit.shutdown()
