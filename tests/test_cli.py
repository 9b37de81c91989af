"""``dcr-ray`` finds the checkout's ``benchmarks`` wherever it runs in one, and outside a checkout
``bench`` and ``chaos`` say how to run them while ``status`` works as before (subprocesses: the lookup
reads ``sys.path``, the current directory and where ``dcr_ray`` was imported from)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[1]


def _dcr_ray(args: list[str], *, cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([sys.executable, "-m", "dcr_ray.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A directory holding a copy of ``dcr_ray`` and no ``benchmarks``: the package as pip installs it."""
    site = tmp_path_factory.mktemp("site-packages")
    shutil.copytree(CHECKOUT / "dcr_ray", site / "dcr_ray", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def test_outside_a_checkout_bench_and_chaos_say_they_run_from_one_and_change_nothing(installed, tmp_path):
    for args in (["bench", "codec", "--quick"], ["bench"], ["chaos", "--refits", "1"]):
        out = _dcr_ray(args, cwd=tmp_path, pythonpath=installed)
        assert out.returncode == 2, out.stderr
        assert "run from a checkout" in out.stderr and "benchmarks/" in out.stderr
        assert out.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_outside_a_checkout_status_and_help_still_work(installed, tmp_path):
    assert _dcr_ray(["status", "--help"], cwd=tmp_path, pythonpath=installed).returncode == 0
    out = _dcr_ray(["--help"], cwd=tmp_path, pythonpath=installed)
    assert out.returncode == 0 and "bench" in out.stdout and "status" in out.stdout


def test_bench_is_found_beside_the_dcr_ray_it_runs_from_any_directory(tmp_path):
    out = _dcr_ray(["bench", "--help"], cwd=tmp_path, pythonpath=CHECKOUT)
    assert out.returncode == 0 and "codec" in out.stdout and "refit" in out.stdout, out.stderr


def test_bench_is_found_from_a_subdirectory_of_a_checkout_with_dcr_ray_installed_elsewhere(installed):
    out = _dcr_ray(["bench", "--help"], cwd=CHECKOUT / "docs", pythonpath=installed)
    assert out.returncode == 0 and "codec" in out.stdout, out.stderr
    assert f"the benchmarks of {CHECKOUT} run with dcr_ray from {installed / 'dcr_ray'}" in out.stderr


def test_a_directory_with_benchmarks_but_no_dcr_ray_is_not_a_checkout(installed, tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "__init__.py").write_text("raise RuntimeError('not ours')\n")
    out = _dcr_ray(["bench", "codec"], cwd=tmp_path, pythonpath=installed)
    assert out.returncode == 2 and "run from a checkout" in out.stderr


def test_a_benchmark_run_names_the_commit_of_the_checkout_its_benchmarks_sit_in():
    from benchmarks import provenance

    assert provenance._REPO == CHECKOUT
    if (CHECKOUT / ".git").exists():
        assert provenance.git_commit()["commit"]
