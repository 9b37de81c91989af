"""Where a benchmark's numbers come from: the code (git commit, and whether the tree differed from it) and
the machine's load while they were taken (this machine is shared: other jobs move CPU-bound times)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

#: The checkout this package runs from (benchmarks/ sits at its root).
_REPO = Path(__file__).resolve().parents[1]


def git_commit() -> dict:
    """``{"commit": sha or None, "dirty": whether dcr_ray/ or benchmarks/ differs from it}``."""

    def git(*args) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(_REPO), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--", "dcr_ray", "benchmarks") if sha else None
    return {"commit": sha, "dirty": bool(status) if status is not None else None}


def loadavg() -> list[float] | None:
    """1/5/15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
