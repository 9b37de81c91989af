"""Helpers for tests that start real Ray (loopback only, sized for a 2-core machine)."""

from __future__ import annotations

import os

# Ray 2.60 binds 127.0.0.1 for ray.init() and ray.cluster_utils.Cluster with this set: keeps all
# test traffic on loopback. Set before Ray is imported anywhere in the test process.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402


def init_local_ray(num_cpus: int = 2) -> None:
    """A fresh single-node Ray (shuts down any other first)."""
    if ray.is_initialized():
        ray.shutdown()
    # address="local": always a new instance, never another test's (or session's) cluster on this machine
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)


def kill_topology() -> None:
    """Shut down a dcr_ray topology left by a test (the coordinator is a named actor)."""
    import dcr_ray

    try:
        dcr_ray.Refit.get().shutdown()
    except (ValueError, ray.exceptions.RayActorError):
        pass  # none running, or it died while we looked it up
