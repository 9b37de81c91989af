"""``Refit.status(detail=True)`` and ``dcr-ray status`` show a running topology as it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import raytools  # noqa: F401
from raytools import local_ray  # noqa: F401  (module-scoped Ray fixture)

import pytest
import ray

import dcr_ray
from dcr_ray.status import format_status
from dcr_ray.testing.models import ModelSpec
from dcr_ray.testing.trainer import TinyTrainer

pytestmark = pytest.mark.slow
SPEC = ModelSpec(size="tiny")


def test_status_lists_versions_engine_states_relays_and_the_last_refits_and_the_cli_prints_them(local_ray):
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    trainer = ray.remote(num_cpus=0)(TinyTrainer).remote(SPEC, lr=1e-3)
    refit = dcr_ray.launch(owners=[trainer], engine=dcr_ray.HFEngine(SPEC),
                           clusters=[dcr_ray.ClusterSpec(name="a", engines=2), dcr_ray.ClusterSpec(name="b", engines=1)])
    try:
        ray.get(trainer.step.remote(seed=0))
        report = refit.run()
        st = refit.status(detail=True)
        assert st["version"] == 1 and st["phase"]["phase"] == "idle"
        assert [(e["engine"], e["cluster"], e["version"], e["phase"], e["required"]) for e in st["engine_states"]] == [
            ("a/e0", "a", 1, "ready", True), ("a/e1", "a", 1, "ready", True), ("b/e0", "b", 1, "ready", True)]
        assert st["relays"] == {"a": ["a/head"], "b": ["b/head"]}
        (last,) = st["last_refits"]
        assert last["version"] == 1 and last["link_bytes"] == report.link_bytes and last["change_rate"] > 0
        text = format_status(st)
        assert "committed version 1" in text and "no refit in flight" in text and "b/e0" in text

        out = subprocess.run([sys.executable, "-m", "dcr_ray.cli", "status", "--json"], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        printed = json.loads(out.stdout)
        assert printed["version"] == 1 and len(printed["engine_states"]) == 3

        ray.kill(refit.engines()["a/e1"])
        deadline = time.monotonic() + 60  # the kill lands asynchronously
        while True:
            states = {e["engine"]: e["phase"] for e in refit.status(detail=True)["engine_states"]}
            if states["a/e1"] == "dead" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert states["a/e1"] == "dead" and states["a/e0"] == "ready"
        # the next refit drops it; it heals in the background and status shows where from
        ray.get(trainer.step.remote(seed=1))
        refit.run()
        st = refit.wait_healed(timeout=120)
        assert st["healing"] == {} and [(h["engine"], h["source"]) for h in st["healed"]] == [("a/e1", "a/e0")]
        text = format_status(refit.status(detail=True))
        assert "healing engine" in text and "healed v2" in text and "a/e0" in text
    finally:
        refit.shutdown()
    out = subprocess.run([sys.executable, "-m", "dcr_ray.cli", "status"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "no dcr_ray topology runs" in out.stderr


def test_a_refit_drawn_with_a_progress_bar_reports_bytes_and_returns_the_same_report(local_ray, monkeypatch, capsys):
    monkeypatch.setenv("DCR_PROGRESS", "1")
    trainer = ray.remote(num_cpus=0)(TinyTrainer).remote(SPEC, lr=1e-3)
    refit = dcr_ray.launch(owners=[trainer], engine=dcr_ray.HFEngine(SPEC),
                           clusters=[dcr_ray.ClusterSpec(name="a", engines=2)])
    try:
        assert "dcr_ray launch" in capsys.readouterr().err
        ray.get(trainer.step.remote(seed=0))
        report = refit.run()
        assert report.version == 1 and "dcr_ray refit" in capsys.readouterr().err
        p = ray.get(refit.actor.progress.remote())
        assert p == {"phase": p["phase"], "bytes": 0, "total": None, "engines": {}} and p["phase"]["phase"] == "idle"
    finally:
        refit.shutdown()


def test_progress_bars_follow_the_terminal_unless_dcr_progress_says_otherwise(monkeypatch):
    from dcr_ray import progress

    monkeypatch.setenv("DCR_PROGRESS", "0")
    assert not progress.enabled()
    monkeypatch.setenv("DCR_PROGRESS", "1")
    assert progress.enabled()
    monkeypatch.delenv("DCR_PROGRESS")
    assert progress.enabled() == sys.stderr.isatty()
