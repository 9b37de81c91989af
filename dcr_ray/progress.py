"""Progress of long coordinator work (launch and its dense bootstrap, refits) on the driver's terminal.

:func:`wait` waits for an ``ObjectRef`` of the coordinator while polling its lock-free
``progress()`` (the phase in flight and the decompressed bytes the engines validated so far), and
draws a ``tqdm`` bar on stderr: bytes against the expected total where it is known (a dense
bootstrap: the model's canonical bytes times the engines being bootstrapped), a running count with
the phase otherwise. The bar shows only when stderr is a terminal, or with ``DCR_PROGRESS=1``;
``DCR_PROGRESS=0`` turns it off. Waiting and its timeout behave exactly as ``ray.get``.
"""

from __future__ import annotations

import os
import sys
import time

import ray

#: Seconds between two polls of the coordinator.
POLL_S = 0.5


def enabled() -> bool:
    """Whether progress bars are drawn (``DCR_PROGRESS`` overrides the terminal check)."""
    env = os.environ.get("DCR_PROGRESS")
    if env is not None:
        return env not in ("", "0", "false", "no")
    return sys.stderr.isatty()


def wait(ref, coordinator, *, desc: str, timeout: float | None = None):
    """``ray.get(ref, timeout=timeout)``, with a progress bar fed by ``coordinator.progress()``."""
    if not enabled():
        return ray.get(ref, timeout=timeout)
    from tqdm.auto import tqdm

    deadline = None if timeout is None else time.monotonic() + timeout
    with tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False) as bar:
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait([ref], timeout=POLL_S if left is None else min(POLL_S, left))
            if ready or (left is not None and left <= 0):
                return ray.get(ref, timeout=0 if not ready else None)
            try:
                p = ray.get(coordinator.progress.remote(), timeout=POLL_S * 4)
            except Exception:  # a restarting coordinator: keep waiting on the result
                continue
            bar.set_postfix_str(p["phase"].get("phase", ""), refresh=False)
            if p["total"] is not None and bar.total != p["total"]:  # a phase with a known size starts
                bar.reset(total=p["total"])
            done = min(p["bytes"], p["total"]) if p["total"] else p["bytes"]
            if done > bar.n:  # engines' counters reset when their attempt closes: never step back
                bar.update(done - bar.n)
            else:
                bar.refresh()


__all__ = ["POLL_S", "enabled", "wait"]
