"""An engine that fell versions behind catches up by the deltas it missed, kept inside its cluster.

The window itself is tested as data (:class:`~dcr_ray.relay.window.CatchUpWindow`); the catch-up runs
on real Ray with real engines, through both transports: an engine hung inside a refit's flush is
evicted, misses three more refits, answers again, rolls back what it held half-open and replays the
four committed transfers its cluster kept. Every case ends with the wrong-bits sweep.
"""

from __future__ import annotations

import importlib

import raytools  # noqa: F401
from raytools import assert_no_wrong_bits, check_engines, local_ray  # noqa: F401  (local_ray: module-scoped Ray fixture)

import pytest
import ray
import torch

import dcr_ray
from dcr_ray.errors import EngineStateError, FrameError
from dcr_ray.relay.window import CatchUpWindow, CommittedStep
from dcr_ray.testing.faults import StallingEngine, release_stall
from dcr_ray.testing.models import ModelSpec
from dcr_ray.testing.trainer import TinyTrainer

SPEC = ModelSpec(size="tiny")


def _step(v: int, nbytes: int = 10, base_id: str | None = None) -> CommittedStep:
    return CommittedStep(transfer=f"t{v}", attempt=0, base=v - 1, target=v, base_id=base_id or f"t{v - 1}",
                         keys=[(f"t{v}", 0, "o", 0)], payloads=[f"p{v}"], nbytes=nbytes)


def test_the_window_answers_the_chain_from_a_held_version_to_the_newest_commit():
    w = CatchUpWindow(100)
    for v in (1, 2, 3):
        assert w.add(_step(v))
    assert [s.target for s in w.since(0, "t0")] == [1, 2, 3]
    assert [s.target for s in w.since(2, "t2")] == [3]
    assert w.since(3, "t3") == []
    assert w.since(2, "another lineage") is None
    assert w.since(-1, "t-1") is None


def test_the_window_drops_its_oldest_steps_beyond_its_bytes_and_everything_before_a_gap():
    dropped = []
    w = CatchUpWindow(25, on_drop=lambda s: dropped.append(s.target))
    for v in (1, 2, 3):
        w.add(_step(v))
    assert [s.target for s in w.steps] == [2, 3] and dropped == [1]
    assert not w.add(_step(4, nbytes=26)) and not w.steps and dropped == [1, 2, 3, 4]  # too big: a gap
    w.add(_step(5))
    w.add(_step(7, base_id="t6"))  # built on a version the window never saw
    assert [s.target for s in w.steps] == [7] and w.since(4, "t4") is None


def _launch(engines: int, lr: float, **config):
    """A TinyTrainer owner and one cluster ``a`` of ``engines`` transformers engines."""
    trainer = ray.remote(num_cpus=0)(TinyTrainer).remote(SPEC, lr=lr)
    return trainer, dcr_ray.launch(owners=[trainer], clusters=[dcr_ray.ClusterSpec(name="a", engines=engines)],
                                   engine=dcr_ray.HFEngine(SPEC), **config)


def _relay_head(refit, cluster: str):
    return ray.get(refit.actor.handles.remote())["relays"][f"{cluster}/head"]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["relay", "object_store"])
def test_an_engine_that_missed_four_refits_catches_up_by_their_deltas_without_the_owners(local_ray, transport,
                                                                                           tmp_path):
    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainer = Trainer.remote(SPEC, lr=1e-5)  # an RL-sized step: four versions of deltas are smaller than the model
    # a/e1's first delta flush hangs until released (at most 120 s); the stage timeout is 4 s: it is
    # evicted and misses refits
    release = str(tmp_path / "release")
    refit = dcr_ray.launch(owners=[trainer], clusters=[dcr_ray.ClusterSpec(name="a", engines=2)],
                           engine=StallingEngine(dcr_ray.HFEngine(SPEC), stall_s=120.0, only="a/e1",
                                                 release=release),
                           config=dcr_ray.RefitConfig(commit=dcr_ray.CommitConfig(timeout_s=4),
                                                      transport=dcr_ray.TransportConfig(kind=transport)))
    try:
        reports = []
        for seed in range(3):
            ray.get(trainer.step.remote(seed=seed))
            reports.append(refit.run())
        assert refit.status()["required"] == ["a/e0"]
        release_stall(release)  # the stall ends: a/e1 finishes the flush it hung in
        ray.get(trainer.step.remote(seed=3))
        reports.append(refit.run())  # a/e1 answers again: it heals in the background
        assert any("a/e1 answers again and heals to version 3" in w for w in reports[-1].warnings), reports[-1].warnings
        healed = refit.wait_healed(timeout=120)
        last = [h for h in healed["healed"] if h["engine"] == "a/e1"][-1]
        assert last["source"] == "window" and last["owner_bytes"] == 0 and last["steps"] == 4, last
        assert last["delta_bytes"] == sum(r.wire_bytes for r in reports)  # exactly the deltas it missed
        assert refit.status()["required"] == ["a/e0", "a/e1"]
        check_engines(refit, trainer)
        ray.get(trainer.step.remote(seed=4))
        assert set(refit.run().engine_versions) == {"a/e0", "a/e1"}  # and it takes deltas again
        assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), 5)
    finally:
        refit.shutdown()


@pytest.mark.slow
def test_a_catch_up_that_does_not_fit_what_the_engine_holds_is_refused_before_any_write(local_ray):
    trainer, refit = _launch(engines=2, lr=1e-3)
    try:
        for seed in range(2):
            ray.get(trainer.step.remote(seed=seed))
            refit.run()
        steps = ray.get(_relay_head(refit, "a").window.remote(0, "attach"))
        assert [s.target for s in steps] == [1, 2]
        eng = refit.engines()["a/e0"]
        committed = ray.get(trainer.rollout_state.remote())
        with pytest.raises(EngineStateError, match="built on v0"):  # it holds v2 already
            ray.get(eng.catch_up.remote(steps, 30))
        short = steps[-1]
        short.keys = short.keys + [(short.transfer, short.attempt, "nobody", 99)]
        with pytest.raises(EngineStateError):  # the chain is checked first: still v2, not v1
            ray.get(eng.catch_up.remote([short], 30))
        assert_no_wrong_bits(refit, committed, 2)
        with pytest.raises(dcr_ray.errors.ConfigError, match="unknown engine"):
            refit.drain("a/e9")
        assert refit.drain("a/e1")["required"] == ["a/e0"]  # it keeps v2 and misses the next refit
        with pytest.raises(dcr_ray.errors.ConfigError, match="not in the required set"):
            refit.drain("a/e1")
        ray.get(trainer.step.remote(seed=2))
        assert refit.run().engine_versions == {"a/e0": 3}
        lagging = refit.engines()["a/e1"]
        assert ray.get(lagging.generate.remote([[1, 2, 3]], 2))["version"] == 2  # a drained engine serves
        steps = ray.get(_relay_head(refit, "a").window.remote(2, steps[-1].transfer))
        assert [s.target for s in steps] == [3]
        steps[0].keys = steps[0].keys + [(steps[0].transfer, steps[0].attempt, "nobody", 99)]
        # a/e1 holds v2, so the chain fits and its frames are checked: one key the record names arrives in
        # no payload, and had anything of the step been written, a/e1's bits would no longer be v2's
        with pytest.raises(FrameError, match="not the committed attempt"):
            ray.get(lagging.catch_up.remote(steps, 30))
        got = ray.get(lagging.tensors.remote())
        assert ray.get(lagging.get_version.remote()) == 2 and sorted(got) == sorted(committed)
        for n, t in committed.items():
            assert torch.equal(got[n].view(torch.int16), t.view(torch.int16)), n
        assert refit.rejoin("a/e1")["required"] == ["a/e0", "a/e1"]
        assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), 3)
    finally:
        refit.shutdown()


@pytest.mark.slow
def test_a_recreated_engine_copies_its_peer_group_by_group_and_holds_the_committed_bits(local_ray):
    trainer, refit = _launch(engines=2, lr=1e-3)
    try:
        # a/e0 hands its snapshot over in many objects even for the tiny model
        ray.get(refit.engines()["a/e0"].__ray_call__.remote(lambda self: setattr(
            importlib.import_module("dcr_ray.actors.engine.peer_copy"), "SNAPSHOT_GROUP_BYTES", 1 << 14)))
        ray.get(trainer.step.remote(seed=0))
        refit.run()
        ray.kill(refit.engines()["a/e1"])
        ray.get(trainer.step.remote(seed=1))
        assert set(refit.run().engine_versions) == {"a/e0"}
        healed = [h for h in refit.wait_healed(timeout=120)["healed"] if h["engine"] == "a/e1"][-1]
        assert healed["sources"][0] == "a/e0" and healed["owner_bytes"] == 0, healed
        rec = refit.status()["commit_record"]
        snap = ray.get(refit.engines()["a/e0"].snapshot.remote(rec["version"], rec["transfer"]))
        assert len(snap["ref"]) > 10  # what a/e1 pulled: group by group
        check_engines(refit, trainer)
        assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), 2)
    finally:
        refit.shutdown()


@pytest.mark.slow
def test_an_invalidated_engine_refuses_to_serve_until_it_heals_and_then_holds_the_committed_bits(local_ray):
    trainer, refit = _launch(engines=2, lr=1e-3)
    try:
        ray.get(trainer.step.remote(seed=0))
        refit.run()
        eng = refit.engines()["a/e1"]
        ray.get(eng.invalidate.remote("a test changed its weights"))
        with pytest.raises(EngineStateError, match="holds no version"):
            ray.get(eng.generate.remote([[1, 2, 3]], 2))
        with pytest.raises(dcr_ray.errors.ConfigError, match="unknown engine"):
            refit.invalidate("a/e9")
        st = refit.invalidate("a/e1", "its weights were reloaded from disk")
        assert st["required"] == ["a/e0", "a/e1"]
        healed = [h for h in st["healed"] if h["engine"] == "a/e1"][-1]
        assert healed["sources"] == ["a/e0"] and healed["reason"].startswith("invalidated"), healed
        assert ray.get(eng.generate.remote([[1, 2, 3]], 2))["version"] == 1
        ray.get(trainer.step.remote(seed=1))
        assert set(refit.run().engine_versions) == {"a/e0", "a/e1"}
        assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), 2)
    finally:
        refit.shutdown()
