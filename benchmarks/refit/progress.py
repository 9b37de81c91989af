"""Progress lines on stderr, stamped with the seconds since the benchmark was imported."""

from __future__ import annotations

import sys
import time

_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)
