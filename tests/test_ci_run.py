"""CI's own guards (``.ci/run``, ``scripts/stage.sh``, pytest-timeout in pyproject.toml): a test that hangs fails
within its limit, naming itself, and the stage goes on; a stage that outlives its limit is stopped, named, and
fails the run; the stages' wall times are printed at the end."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

HANGS = """
import time

def test_this_one_hangs():
    time.sleep(600)

def test_this_one_passes():
    assert True
"""


def _stage(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``script`` run by bash after sourcing scripts/stage.sh, from the checkout's root."""
    return subprocess.run(["bash", "-c", f"source scripts/stage.sh\n{script}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_pytest_timeout_is_armed_for_every_test_of_the_suite(pytestconfig):
    assert pytestconfig.pluginmanager.hasplugin("timeout"), "pytest-timeout is not installed: pip install -e .[test]"
    assert float(pytestconfig.getini("timeout")) > 0


def test_a_hanging_test_fails_within_its_timeout_naming_itself_and_the_rest_of_the_stage_runs(tmp_path):
    (tmp_path / "test_hang.py").write_text(HANGS)
    t0 = time.monotonic()
    got = _stage(f"stage hang 120 {sys.executable} -m pytest -q -p no:cacheprovider --timeout 3 {tmp_path}; "
                 f"echo rc=$?; stages_summary")
    took = time.monotonic() - t0
    out = got.stdout + got.stderr
    assert took < 60, out
    assert "rc=1" in out, out  # the stage fails
    assert "test_hang.py::test_this_one_hangs" in out and "Timeout" in out, out
    assert "1 failed, 1 passed" in out, out  # the next test still ran
    assert "[ci]   hang" in out and "[ci]   total" in out, out


def test_a_stage_that_outlives_its_limit_is_stopped_and_named():
    t0 = time.monotonic()
    got = _stage("stage stuck 2 sleep 600; echo rc=$?; stages_summary")
    took = time.monotonic() - t0
    out = got.stdout + got.stderr
    assert took < 30, out
    assert "rc=124" in out, out
    assert "stage stuck TIMED OUT" in out and "limit is 2 s" in out, out


@pytest.mark.parametrize("path", [".ci/run"])
def test_ci_runs_every_stage_under_a_limit_and_prints_their_times(path):
    text = (ROOT / path).read_text()
    stages = [line for line in text.splitlines() if line.startswith("stage ")]
    assert len(stages) >= 4, stages
    assert all(line.split()[2].isdigit() for line in stages), stages
    limits = sum(int(line.split()[2]) for line in stages)
    assert limits <= 90 * 60, f"the stages' limits add up to {limits} s: over CI's 90 minutes"
    assert "trap stages_summary EXIT" in text
