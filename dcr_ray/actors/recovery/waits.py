"""The waits of a heal on other processes: each bounded, each watching the nodes it depends on, none
under the coordinator's lock.

A re-created engine's start (its process, imports and model: ``CommitConfig.start_timeout_s``, a model's
start-up) and a copy or catch-up into a healing engine (model-sized: the same bound) may take long; what
must not happen is a wait that outlives a node. So each looks every :data:`POLL_S` whether the nodes it
waits on are gone (:class:`~dcr_ray.actors.fleet.nodes.NodeWatch`) and, for a start, whether the
engine's cluster can still be hosted, and ends at once if not. :mod:`~dcr_ray.actors.recovery.healing`
calls them between its decisions, which it takes under the lock.
"""

from __future__ import annotations

import time

import ray

from dcr_ray.actors.fleet.state import CoordinatorState
from dcr_ray.errors import RefitError

#: How often a wait looks at the nodes it depends on.
POLL_S = 1.0


class Unplaceable(Exception):
    """The engine waited for cannot be placed (its cluster has no live node, or its node is gone): it was
    killed, and waits for capacity."""


def started(state: CoordinatorState, e: str, cluster: str) -> None:
    """Wait until engine ``e`` answers (its backend loaded); :class:`Unplaceable` (it is killed) once its
    cluster cannot be hosted or its node is gone, ``RefitError`` past ``CommitConfig.start_timeout_s``."""
    s = state
    ref = s.engines[e].get_version.remote()
    limit = s.config.commit.start_timeout_s
    deadline, since = time.monotonic() + limit, s.topology.nodes.now()
    while not ray.wait([ref], timeout=POLL_S)[0]:
        if not s.topology.can_host(cluster) or s.topology.nodes.lost([f"engine:{e}"], since=since):
            s.topology.retire(e, s.config)
            raise Unplaceable(cluster)
        if time.monotonic() > deadline:
            raise RefitError(f"engine {e} did not start within {limit:.0f} s (CommitConfig.start_timeout_s)")
    ray.get(ref)


def landed(state: CoordinatorState, e: str, peer: str | None, ref) -> dict:
    """The answer of a copy or catch-up into ``e`` (from ``peer``): at most ``CommitConfig.start_timeout_s``
    (a model-sized copy), ended at once (``RefitError``) when the node of either is gone."""
    s = state
    keys = [f"engine:{e}"] + ([f"engine:{peer}"] if peer else [])
    limit = s.config.commit.start_timeout_s
    deadline, since = time.monotonic() + limit, s.topology.nodes.now()
    while not ray.wait([ref], timeout=POLL_S)[0]:
        gone = s.topology.nodes.lost(keys, since=since)
        if gone:
            _cancel(ref)
            raise RefitError(f"healing {e}: the node of {gone} is gone")
        if time.monotonic() > deadline:
            _cancel(ref)
            raise RefitError(f"healing {e}: the copy did not land within {limit:.0f} s (CommitConfig.start_timeout_s)")
    return ray.get(ref)


def _cancel(ref) -> None:
    """Ask Ray to drop a call no one waits for any more (best effort: a running one finishes)."""
    try:
        ray.cancel(ref)
    except Exception:
        pass
