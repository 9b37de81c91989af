"""Every error path ends in the committed bits or a clear error, never in silent wrong bits.

A commit record that cannot be written is a failed attempt (engines roll back in place, owners discard
their pending sets) and the next refit after the directory is fixed is exact; a record in place whose
history line could not be appended stays committed; an engine holding writes of an unsettled transfer
refuses to open another. (Coordinator restarts on error paths: ``test_resume.py``.) Every test ends with the wrong-bits sweep (:func:`raytools.assert_no_wrong_bits`).
"""

from __future__ import annotations

import os
import random
import shutil

import raytools  # noqa: F401
from raytools import assert_no_wrong_bits, check_engines, half_written, kill_and_wait, local_ray  # noqa: F401

import pytest
import ray
import torch

import dcr_ray
from dcr_ray.errors import EngineStateError, RefitError
from dcr_ray.testing.models import ModelSpec
from dcr_ray.testing.trainer import TinyTrainer

pytestmark = pytest.mark.slow

SPEC = ModelSpec(size="tiny")
CLUSTERS = [dcr_ray.ClusterSpec(name="a", engines=2), dcr_ray.ClusterSpec(name="b", engines=1)]


def _config(commit_dir, attempts: int = 2) -> dcr_ray.RefitConfig:
    return dcr_ray.RefitConfig(codec=dcr_ray.CodecConfig(bucket_bytes=1 << 18, chunk_elems=1 << 15),
                               commit=dcr_ray.CommitConfig(dir=str(commit_dir), timeout_s=60, max_attempts=attempts))


@pytest.fixture(scope="module")
def topo(local_ray, tmp_path_factory):
    """One topology for the tests that fail refits on purpose (each leaves it committed and exact)."""
    commit = tmp_path_factory.mktemp("commit")
    trainer = ray.remote(num_cpus=0)(TinyTrainer).remote(SPEC, lr=1e-3)
    refit = dcr_ray.launch(owners=[trainer], engine=dcr_ray.HFEngine(SPEC), config=_config(commit),
                           clusters=CLUSTERS)
    yield refit, trainer, str(commit)
    refit.shutdown()


def _committed(refit, trainer) -> tuple[dict, int]:
    return ray.get(trainer.rollout_state.remote()), refit.status()["version"]


def test_a_commit_record_that_cannot_be_written_rolls_every_engine_back_and_the_next_refit_is_exact(topo):
    refit, trainer, commit = topo
    committed, v = _committed(refit, trainer)
    blocker = os.path.join(commit, "commit.json.tmp")
    os.makedirs(blocker)  # the record's temporary file cannot be created: an OSError at the durable step
    try:
        for seed in (10, 11):  # two refits in a row fail the same way, neither leaves a trace
            ray.get(trainer.step.remote(seed=seed))
            with pytest.raises(RefitError, match=r"CommitError: the commit record .* could not be written"):
                refit.run()
            assert_no_wrong_bits(refit, committed, v)
            assert all(ray.get(e.state.remote())["phase"] == "ready" for e in refit.engines().values())
            assert ray.get(trainer.dcr_state.remote()) == {"version": v, "pending": None}
    finally:
        os.rmdir(blocker)
    report = refit.run()  # the directory is writable again: the owners' diff from v is whole and exact
    assert report.version == v + 1
    check_engines(refit, trainer)
    assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), v + 1)


def test_a_history_line_that_cannot_be_appended_leaves_the_durable_record_committed(topo):
    refit, trainer, commit = topo
    _, v = _committed(refit, trainer)
    history = os.path.join(commit, "history.jsonl")
    shutil.move(history, history + ".kept")
    os.makedirs(history)  # appending to it fails after the record is in place
    try:
        ray.get(trainer.step.remote(seed=20))
        report = refit.run()
        assert report.version == v + 1
        assert any("history.jsonl could not be appended" in w for w in report.warnings), report.warnings
    finally:
        os.rmdir(history)
        shutil.move(history + ".kept", history)
    assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), v + 1)
    ray.get(trainer.step.remote(seed=21))
    assert refit.run().version == v + 2  # the coordinator and the record agree: refits go on
    assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), v + 2)


def test_an_engine_holding_writes_of_an_unsettled_transfer_refuses_to_open_another(topo):
    refit, trainer, _ = topo
    committed, v = _committed(refit, trainer)
    eng = half_written(refit, trainer, committed, base=v)  # transfer T written in place, never settled
    with pytest.raises(EngineStateError, match="holds in-place writes of transfer T"):
        ray.get(eng.prepare.remote("T2", 0, v, v + 1))
    assert ray.get(eng.abort.remote("T", True))["rolled_back"]
    assert_no_wrong_bits(refit, committed, v)
    assert refit.run().version == v + 1
    assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), v + 1)


def test_the_chaos_harness_aims_hostile_frames_only_at_engines_alive_now_found_by_name(topo):
    refit, trainer, _ = topo
    from benchmarks.chaos import _live_engine

    victim = refit.engines()["a/e0"]
    kill_and_wait(victim)
    assert _live_engine(random.Random(0), ["a/e0"]) is None  # no frame aimed at a dead handle
    eng, name, shape = _live_engine(random.Random(0), ["a/e0", "a/e1"])
    assert ray.get(eng.info.remote())["engine"] == "a/e1" and name and shape
    ray.get(trainer.step.remote(seed=30))
    report = refit.run()  # drops the dead engine, commits, re-creates it
    assert "a/e0" in report.dropped_engines
    assert_no_wrong_bits(refit, ray.get(trainer.rollout_state.remote()), report.version)
