"""Bounded waiting on first-hop acknowledgements, shared by every owner-side sink."""

from __future__ import annotations

import ray

from dcr_ray.errors import RefitTimeoutError


def wait_bounded(pending: list, bound: int, timeout: float) -> list:
    """Wait until at most ``bound`` of ``pending`` (ObjectRefs) are outstanding; returns those.

    Errors of finished hops surface here; no progress within ``timeout`` raises ``RefitTimeoutError``.
    """
    while len(pending) > bound:
        ready, pending = ray.wait(pending, num_returns=len(pending) - bound, timeout=timeout)
        if not ready:
            raise RefitTimeoutError(f"no hop acknowledgement within {timeout:.0f} s (CommitConfig.timeout_s)")
        ray.get(ready)
    return pending
