"""End-to-end refits on a real single-node Ray: owners -> relay tree / object storage -> engines."""

from __future__ import annotations

import time

import raytools  # noqa: F401  (sets the loopback environment before ray is imported)
from raytools import local_ray  # noqa: F401  (module-scoped Ray fixture)

import pytest
import ray
import torch

import dcr_ray
from dcr_ray.actors.owner.delta import BOOTSTRAP_BASE
from dcr_ray.codec import BaselineStore, FrameMeta, encode_frames
from dcr_ray.engines.base import canonical_state_dict
from dcr_ray.testing.models import ModelSpec, build_model
from dcr_ray.testing.trainer import TinyTrainer

pytestmark = pytest.mark.slow
SPEC = ModelSpec(size="tiny", seed=0)
SHARED_NS = "dcr_pipeline_shared"


def _launch(config: dcr_ray.RefitConfig, world: int = 2, engines=(2, 1)):
    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainers = [Trainer.remote(SPEC, lr=1e-4, rank=r, world=world) for r in range(world)]
    clusters = [dcr_ray.ClusterSpec(name=f"c{i}", engines=n, fanout=2 if i else 4) for i, n in enumerate(engines)]
    refit = dcr_ray.launch(owners=trainers, clusters=clusters, engine=dcr_ray.HFEngine(SPEC.with_seed(7)),
                           config=config)
    return refit, trainers


def _assert_engines_hold(refit, trainers):
    want = ray.get(trainers[0].rollout_state.remote())
    # the dense reference: the same weights loaded through the model's own loader
    dense = build_model(ModelSpec(size="tiny", seed=42))
    dense.load_state_dict(want, strict=False)
    dense_sd = canonical_state_dict(dense)
    for eid, eng in refit.engines().items():
        got = ray.get(eng.tensors.remote())
        assert set(got) == set(want)
        for n in want:
            assert torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)), (eid, n)
            assert torch.equal(got[n].view(torch.int16), dense_sd[n].view(torch.int16)), (eid, n)


@pytest.fixture(scope="module")
def shared(local_ray):
    """One default topology (2 owner ranks, clusters c0 with 2 engines and c1 with 1) for the tests that
    refit it or drive one engine's protocol by hand and leave it serving the committed version: each
    works relative to the version it finds. Both trainer ranks always take the same steps. It runs in a
    namespace of its own, beside the topologies the other tests of this module launch in the default one."""
    refit, trainers = _launch(dcr_ray.RefitConfig(namespace=SHARED_NS))
    yield refit, trainers
    refit.shutdown()


def _step_all(trainers, seed: int) -> dict:
    """Both ranks take the same optimizer step; returns the new rollout state."""
    ray.get([t.step.remote(seed=seed) for t in trainers])
    return ray.get(trainers[0].rollout_state.remote())


# both transports and every coding, each once (the codec tests pin every coding on each transport's frames);
# "auto" on a configured 1 Mbit/s link: the first refit codes plainly (nothing measured), then the link
# bounds the refit and the second codes with class order
@pytest.mark.parametrize("transport,coding", [("relay", "plain"), ("object_store", "context"), ("relay", "auto")])
def test_engines_are_bit_identical_to_the_trainer_and_a_dense_reload_after_several_refits(local_ray, transport,
                                                                                         coding):
    codec = dcr_ray.CodecConfig(coding=coding, link_mbps=1.0 if coding == "auto" else None)
    refit, trainers = _launch(dcr_ray.RefitConfig(transport=dcr_ray.TransportConfig(kind=transport), codec=codec))
    try:
        # the engines started from another seed: the dense bootstrap already made them equal
        _assert_engines_hold(refit, trainers)
        codings = []
        for step in range(3):
            ray.get([t.step.remote(seed=step) for t in trainers])
            report = ray.get(refit.remote())
            assert report.version == step + 1
            assert set(report.engine_versions.values()) == {step + 1}
            assert report.changed > 0 and report.wire_bytes > 0 and report.retries == 0
            assert 0 < report.change_rate < 1
            assert report.coding_reason
            codings.append((report.coding, report.coding_reason))
            # process CPU time of every actor of the refit, per role
            assert set(report.cpu_seconds["owners"]) == {"owner0", "owner1"} and set(report.cpu_seconds["engines"]) \
                == set(report.engine_versions)
            assert all(s > 0 for s in report.cpu_seconds["owners"].values())
            assert len(report.cpu_seconds["relays"]) == (2 if transport == "relay" else 0)
            _assert_engines_hold(refit, trainers)
        if coding == "auto":  # then class order is measured, and the third refit judges on both codings' costs
            assert [c for c, _ in codings[:2]] == ["plain", "context"] and codings[2][1].count("(measured)") == 2
        else:
            assert [c for c, _ in codings] == [coding] * 3
        # each cluster received every payload's bytes exactly once
        assert set(report.link_bytes) == {"c0", "c1"}
        if transport == "relay":
            assert all(b == report.wire_bytes for b in report.link_bytes.values())
        else:  # object storage: every engine reads its own copy
            assert report.link_bytes == {"c0": 2 * report.wire_bytes, "c1": report.wire_bytes}
        # each engine counted the thread CPU of its payload path, the parts within the whole
        for eng in refit.engines().values():
            cpu = ray.get(eng.cpu_parts.remote())
            assert cpu["calls"] >= 3 and cpu["deliver"] > 0 and cpu["apply"] > 0, cpu
            assert cpu["open"] + cpu["decode"] + cpu["apply"] <= cpu["deliver"] * 1.01 + 1e-3, cpu
    finally:
        refit.shutdown()


def test_a_refit_with_no_change_commits_an_empty_version(shared):
    refit, trainers = shared
    v = refit.run().version  # whatever an earlier test left uncommitted, committed now
    report = refit.run()
    assert report.version == v + 1 and report.changed == 0 and report.payloads == 0
    _assert_engines_hold(refit, trainers)


def _frames_for(committed: dict, new: dict, base: int, target: int, transfer: str, attempt: int = 0):
    """Frames turning ``committed`` into ``new``, labelled as the transfer ``base`` -> ``target``."""
    store = BaselineStore(in_memory=True)
    for n, t in committed.items():
        store.add(n, t)
    deltas = [store.diff(n, new[n]) for n in committed]
    meta = FrameMeta(transfer=transfer, attempt=attempt, producer="test", payload=0, base=base, target=target)
    return list(encode_frames([d for d in deltas if d.chunks], meta))


def _committed(refit, trainers) -> tuple[dict, int]:
    """Commit what the trainers hold now; returns (those bits, the version)."""
    return ray.get(trainers[0].rollout_state.remote()), refit.run().version


def test_a_duplicate_delivery_is_applied_once_and_a_wrong_base_version_is_rejected(shared):
    refit, trainers = shared
    committed, v = _committed(refit, trainers)
    eng = refit.engines()["c0/e0"]
    before = ray.get(eng.tensors.remote())
    new = _step_all(trainers, seed=5)
    # an engine at version v opens transfer T; a frame for T built on base v applies once
    ray.get(eng.prepare.remote("T", 0, v, v + 1))
    frames = _frames_for(committed, new, base=v, target=v + 1, transfer="T")
    assert frames
    assert ray.get(eng.deliver.remote(frames[0])) == "applied"
    after_once = ray.get(eng.tensors.remote())
    assert ray.get(eng.deliver.remote(frames[0])) == "duplicate"
    after_twice = ray.get(eng.tensors.remote())
    for n in before:
        assert torch.equal(after_once[n].view(torch.int16), after_twice[n].view(torch.int16))
    # T is abandoned (rolled back in place: no transfer opens over another's writes); a frame of the
    # next transfer built on base v + 7 is rejected and writes nothing
    assert ray.get(eng.abort.remote("T", True))["rolled_back"]
    ray.get(eng.prepare.remote("T2", 0, v, v + 1))
    snapshot = ray.get(eng.tensors.remote())
    bad = _frames_for(committed, new, base=v + 7, target=v + 8, transfer="T2")
    assert ray.get(eng.deliver.remote(bad[0])) == "rejected"
    untouched = ray.get(eng.tensors.remote())
    for n in snapshot:
        assert torch.equal(snapshot[n].view(torch.int16), untouched[n].view(torch.int16))
    with pytest.raises(dcr_ray.DcrError, match=f"built on version {v + 7}"):
        ray.get(eng.flush.remote("T2", 0, [("T2", 0, "test", 0)], 5.0))
    # restore: the engine re-joins at the committed version, then refits work again
    ray.get(eng.abort.remote("T2"))
    refit.rejoin("c0/e0")
    assert refit.run().version == v + 1
    _assert_engines_hold(refit, trainers)


def test_an_engine_that_was_not_prepared_rejects_payloads_and_writes_nothing(shared):
    refit, trainers = shared
    committed, v = _committed(refit, trainers)
    eng = refit.engines()["c1/e0"]
    frames = _frames_for(committed, _step_all(trainers, seed=1), base=v, target=v + 1, transfer="X")
    before, rejected = ray.get(eng.tensors.remote()), ray.get(eng.info.remote())["rejected"]
    assert ray.get(eng.deliver.remote(frames[0])) == "rejected"
    after = ray.get(eng.tensors.remote())
    for n in before:
        assert torch.equal(before[n].view(torch.int16), after[n].view(torch.int16))
    assert ray.get(eng.info.remote())["rejected"] == rejected + 1
    assert BOOTSTRAP_BASE == -1
    assert refit.run().version == v + 1
    _assert_engines_hold(refit, trainers)


def test_owners_that_do_not_cover_the_engines_tensors_are_refused_with_a_clear_error(local_ray):
    model = build_model(SPEC)
    sd = canonical_state_dict(model)
    half = dict(list(sd.items())[: len(sd) // 2])
    with pytest.raises(Exception, match="no owner for"):
        dcr_ray.launch(owner_tensors=[half], clusters=[dcr_ray.ClusterSpec(name="x", engines=1)],
                       engine=dcr_ray.HFEngine(SPEC))
    # and the failed launch cleaned up after itself: the coordinator's name is free again
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            ray.get_actor(dcr_ray.options.COORDINATOR_NAME, namespace=dcr_ray.options.NAMESPACE)
        except ValueError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("a failed launch() left its coordinator running")
    raytools.kill_topology()


def test_a_staging_engine_keeps_serving_the_old_version_until_flush_and_then_the_new_bits(local_ray):
    refit, trainers = _launch(dcr_ray.RefitConfig(engines=dcr_ray.EngineConfig(apply="staged")), world=1, engines=(1, 1))
    try:
        eng = refit.engines()["c0/e0"]
        prompts = [[1, 2, 3, 4], [5, 6, 7]]
        served0 = ray.get(eng.generate.remote(prompts, 4))
        assert served0["version"] == 0
        before = ray.get(eng.tensors.remote())
        committed = ray.get(trainers[0].rollout_state.remote())
        ray.get(trainers[0].step.remote(seed=3))
        new = ray.get(trainers[0].rollout_state.remote())
        ray.get(eng.prepare.remote("S", 0, 0, 1))
        frames = _frames_for(committed, new, base=0, target=1, transfer="S")
        for f in frames:
            assert ray.get(eng.deliver.remote(f)) == "applied"
        during = ray.get(eng.generate.remote(prompts, 4))  # still serving v0, bit for bit
        assert during["version"] == 0 and during["outputs"] == served0["outputs"]
        staged = ray.get(eng.tensors.remote())
        for n in before:
            assert torch.equal(staged[n].view(torch.int16), before[n].view(torch.int16))
        keys = [("S", 0, "test", i) for i in range(len(frames))]
        ray.get(eng.flush.remote("S", 0, keys, 30.0))
        # acknowledged, not committed: the engine still serves v0, bit for bit (the frames wait, decoded)
        after_flush = ray.get(eng.generate.remote(prompts, 4))
        assert after_flush["version"] == 0 and after_flush["outputs"] == served0["outputs"]
        assert all(torch.equal(t.view(torch.int16), before[n].view(torch.int16))
                   for n, t in ray.get(eng.tensors.remote()).items())
        ray.get(eng.activate.remote(1, "S"))  # after the commit record: the writes, the only pause
        (pause,) = ray.get(eng.pauses.remote())  # on the engine's own clock
        assert (pause["mode"], pause["outcome"], pause["version"]) == ("staged", "activated", 1)
        assert 0 < pause["apply_s"] <= pause["pause_s"], pause
        got = ray.get(eng.tensors.remote())
        for n in new:
            assert torch.equal(got[n].view(torch.int16), new[n].view(torch.int16))
        assert ray.get(eng.generate.remote(prompts, 4))["version"] == 1
    finally:
        refit.shutdown()


def test_an_in_place_engine_pauses_generation_while_a_transfer_is_open(shared):
    refit, trainers = shared
    _, v = _committed(refit, trainers)
    eng = refit.engines()["c1/e0"]
    ray.get(eng.prepare.remote("P", 0, v, v + 1))
    with pytest.raises(dcr_ray.DcrError, match="paused"):
        ray.get(eng.generate.remote([[1, 2]], 2, 1.0))
    ray.get(eng.abort.remote("P"))
    assert ray.get(eng.generate.remote([[1, 2]], 2))["version"] == v


def _alive(*names: str, namespace: str = dcr_ray.options.NAMESPACE) -> set[str]:
    """Which of these named dcr_ray actors exist in ``namespace``."""
    out = set()
    for n in names:
        try:
            ray.get_actor(n, namespace=namespace)
            out.add(n)
        except ValueError:
            pass
    return out


LAUNCH_NAMES = ("dcr_coordinator", "dcr_owner:owner0", "dcr_engine:a/e0", "dcr_engine:other/e0",
                "dcr_relay:a/head", "dcr_relay:other/head")


def test_a_second_launch_in_the_same_ray_cluster_fails_with_a_clear_error_and_leaves_the_first_running(shared):
    refit, trainers = shared
    with pytest.raises(dcr_ray.errors.ConfigError, match="already runs in namespace"):
        dcr_ray.launch(owners=trainers, clusters=[dcr_ray.ClusterSpec(name="other")], engine=dcr_ray.HFEngine(SPEC),
                       config=dcr_ray.RefitConfig(namespace=SHARED_NS))
    assert _alive(*LAUNCH_NAMES, "dcr_engine:c0/e0", namespace=SHARED_NS) == {"dcr_coordinator", "dcr_engine:c0/e0"}
    v = refit.status()["version"]
    _step_all(trainers, seed=2)
    assert ray.get(refit.remote()).version == v + 1  # the first topology still refits
    _assert_engines_hold(refit, trainers)


def test_bad_set_ups_are_refused_before_any_actor_is_spawned(local_ray):
    Plain = ray.remote(num_cpus=0)(type("NotAnOwner", (), {"ping": lambda self: 1}))
    plain = Plain.remote()
    sd = canonical_state_dict(build_model(SPEC))
    bad = [
        (dict(owner_tensors=[sd], clusters=[]), "at least one"),
        (dict(owner_tensors=[sd], clusters=[dcr_ray.ClusterSpec(name="a"), dcr_ray.ClusterSpec(name="a")]),
         r"unique; \['a'\]"),
        (dict(owner_tensors=[], clusters=[dcr_ray.ClusterSpec(name="a")]), "at least one owner"),
        (dict(owners=[], clusters=[dcr_ray.ClusterSpec(name="a")]), "at least one owner"),
        (dict(owners=[plain], clusters=[dcr_ray.ClusterSpec(name="a")]), "mix in dcr_ray.OwnerMixin"),
        (dict(owner_tensors=[sd], clusters=[dcr_ray.ClusterSpec(name="a")],
              config=dcr_ray.RefitConfig(actor_options={"coordinator": {"resources": {"TPU": 1}}})),
         r"no alive node offers the coordinator's resources \{'TPU': 1\}"),
    ]
    for kw, msg in bad:
        with pytest.raises(dcr_ray.errors.ConfigError, match=msg):
            dcr_ray.launch(engine=dcr_ray.HFEngine(SPEC), **kw)
        assert _alive(*LAUNCH_NAMES) == set(), kw
    for make, msg in [(lambda: dcr_ray.ClusterSpec(name="a", engines=2.5), "must be an integer"),
                      (lambda: dcr_ray.CommitConfig(timeout_s=float("nan")), "finite"),
                      (lambda: dcr_ray.CommitConfig(timeout_s=float("inf")), "finite"),
                      (lambda: dcr_ray.CommitConfig(max_attempts=1.5), "integer >= 1"),
                      (lambda: dcr_ray.CommitConfig(start_timeout_s=-1), "start_timeout_s"),
                      (lambda: dcr_ray.EngineConfig(rollback="undo"), "rollback"),
                      (lambda: dcr_ray.CodecConfig(zstd_level=100), "0..22")]:
        with pytest.raises(dcr_ray.errors.ConfigError, match=msg):
            make()
    ray.kill(plain)


def test_a_staging_engine_over_its_byte_budget_fails_the_refit_at_once_and_keeps_serving_its_version(local_ray):
    config = dcr_ray.RefitConfig(engines=dcr_ray.EngineConfig(apply="staged", staging_budget_bytes=2048))
    refit, trainers = _launch(config, world=1, engines=(1, 1))
    try:
        eng = refit.engines()["c0/e0"]
        served = ray.get(eng.generate.remote([[1, 2, 3]], 4))
        ray.get(trainers[0].step.remote(seed=9))
        with pytest.raises(dcr_ray.RefitError, match=r"StagingBudgetError.*staging_budget_bytes=2048") as err:
            refit.run()
        assert "after 1 attempt(s)" in str(err.value)  # not retried: more attempts cannot fit either
        assert refit.status()["version"] == 0
        again = ray.get(eng.generate.remote([[1, 2, 3]], 4))
        assert (again["version"], again["outputs"]) == (0, served["outputs"])  # still v0, bit for bit the same
    finally:
        refit.shutdown()


def test_engines_of_a_cluster_with_placement_run_in_one_placement_group_and_refit_exactly(local_ray):
    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainers = [Trainer.remote(SPEC, lr=1e-4)]
    cluster = dcr_ray.ClusterSpec(name="pg", engines=2, cpus_per_engine=0.1, placement="SPREAD")
    refit = dcr_ray.launch(owners=trainers, clusters=[cluster], engine=dcr_ray.HFEngine(SPEC.with_seed(3)))
    try:
        groups = {ray.get(e.info.remote())["placement_group"] for e in refit.engines().values()}
        assert len(groups) == 1 and None not in groups
        ray.get(trainers[0].step.remote(seed=1))
        assert refit.run().version == 1
        _assert_engines_hold(refit, trainers)
    finally:
        refit.shutdown()


def test_a_launch_that_outlasts_its_timeout_removes_everything_it_created_and_a_later_launch_works(local_ray):
    from dcr_ray.testing.faults import SlowStartEngine

    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainers = [Trainer.remote(SPEC, lr=1e-4)]
    clusters = [dcr_ray.ClusterSpec(name="a")]
    # the error says where the start stood: where the 2 s ran out depends on the machine's load (the
    # coordinator still starting, attaching the owner, or waiting for the slow engine)
    with pytest.raises(dcr_ray.errors.RefitTimeoutError,
                       match=r"launch did not finish within 2 s \(.*; (the coordinator had not begun to start the "
                             r"topology|the coordinator was in phase '[a-z ]+' for \d+ s)\)"):
        dcr_ray.launch(owners=trainers, clusters=clusters, engine=SlowStartEngine(dcr_ray.HFEngine(SPEC), 60),
                       config=dcr_ray.RefitConfig(commit=dcr_ray.CommitConfig(start_timeout_s=2)))
    assert _alive(*LAUNCH_NAMES) == set()
    refit = dcr_ray.launch(owners=trainers, clusters=clusters, engine=dcr_ray.HFEngine(SPEC.with_seed(3)))
    try:
        ray.get(trainers[0].step.remote(seed=1))
        assert refit.run().version == 1
        _assert_engines_hold(refit, trainers)
    finally:
        refit.shutdown()
        ray.kill(trainers[0])


def test_a_placement_ray_cannot_satisfy_fails_launch_with_a_clear_error_instead_of_hanging(local_ray):
    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainers = [Trainer.remote(SPEC, lr=1e-4)]
    cluster = dcr_ray.ClusterSpec(name="big", engines=2, cpus_per_engine=64, placement="STRICT_PACK")
    # refused before anything starts: no alive node has the CPUs of one engine
    with pytest.raises(dcr_ray.errors.ConfigError,
                       match=r"cluster 'big': the alive nodes hold 0 of its 2 engines \(each asks \{'CPU': 64\}"):
        dcr_ray.launch(owners=trainers, clusters=[cluster], engine=dcr_ray.HFEngine(SPEC),
                       config=dcr_ray.RefitConfig(commit=dcr_ray.CommitConfig(timeout_s=3)))
    assert _alive("dcr_coordinator", "dcr_engine:big/e0") == set()
    for t in trainers:
        ray.kill(t)
