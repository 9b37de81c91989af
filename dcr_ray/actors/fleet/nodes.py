"""Which nodes are alive now, where each actor runs, and which clusters a live node can host.

Ray marks a node dead when its health checks miss (about 15 s with Ray's defaults). Until then a call to
an actor on a node that vanished does not fail: it waits. A refit that waited on Ray to notice would
spend those seconds with the surviving engines paused, and a relay or engine re-created in the meantime
may be placed on the dead node and wait with it. So the coordinator keeps its own view, from two
facts it can read at once:

- **Ray's node table** (``ray.nodes()``): a node Ray already marked dead is dead;
- **the node's raylet answers**: a TCP connection to the raylet's port is refused at once by a host
  whose raylet died and goes unanswered from a host that is gone (a short connect timeout). A busy but
  alive node still accepts the connection (the kernel does, whatever its processes are doing).

A node fails if either says so. Its actors are *lost*: the coordinator takes them out of the refit in
one pass (:mod:`~dcr_ray.actors.recovery.outages`) instead of finding them one stage timeout at a time. A wrongly
suspected node costs only work (its engines heal and rejoin): never bits, since an engine outside the
required set is neither written by a commit nor counted in one.

Where each actor runs is asked of the actor once (``__ray_call__``, any actor answers it) when the
coordinator first holds its handle; an actor whose node is not known yet is never reported lost here
(its calls fail or time out as before).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Mapping

import ray

log = logging.getLogger("dcr_ray")

#: How long a raylet probe waits for a TCP connection before the node counts as gone.
PROBE_TIMEOUT_S = 1.0
#: How long one view of the live nodes is reused before the node table is read and probed again.
FRESH_S = 0.25


def _node_id(_actor) -> str:
    """(Run in any actor.) The id of the node it runs on."""
    return ray.get_runtime_context().get_node_id()


def _answers(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=PROBE_TIMEOUT_S).close()
        return True
    except OSError:
        return False


class NodeWatch:
    """The live nodes (Ray's table and the raylets' answers) and the node of every actor it located."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._where: dict[str, Any] = {}  # actor key -> its node id, or the pending ref that will say it
        self._ids: dict[str, Any] = {}  # actor key -> the Ray actor id it was located for
        self._live: dict[str, dict[str, float]] = {}  # node id -> total resources
        self._at = float("-inf")
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="dcr-node-probe")

    # -- where actors run -----------------------------------------------------------------------------
    def locate(self, key: str, handle) -> None:
        """Learn where actor ``key`` runs (asked now, read when first needed; asked again only of a new
        actor under the same key). A handle that is no Ray actor's is left unknown."""
        actor_id = getattr(handle, "_actor_id", None)
        if actor_id is None or not hasattr(handle, "__ray_call__"):
            return
        with self._lock:
            if self._ids.get(key) == actor_id:
                return
            self._ids[key] = actor_id
            self._where[key] = handle.__ray_call__.remote(_node_id)

    def forget(self, key: str) -> None:
        with self._lock:
            self._where.pop(key, None)
            self._ids.pop(key, None)

    def node_of(self, key: str) -> str | None:
        """The node actor ``key`` runs on, if it said so already (never waits)."""
        with self._lock:
            where = self._where.get(key)
        if where is None or isinstance(where, str):
            return where
        ready, _ = ray.wait([where], timeout=0)
        if not ready:
            return None
        try:
            node = ray.get(where)
        except Exception:  # it died before it answered: its calls say so themselves
            return None
        with self._lock:
            if self._where.get(key) is where:
                self._where[key] = node
        return node

    # -- which nodes are alive ------------------------------------------------------------------------
    def live(self, fresh: bool = False) -> dict[str, dict[str, float]]:
        """Node id -> total resources of every node Ray has not marked dead and whose raylet answers
        (read again when the last view is older than :data:`FRESH_S`, or with ``fresh``)."""
        with self._lock:
            if not fresh and time.monotonic() - self._at < FRESH_S:
                return dict(self._live)
        table = [n for n in ray.nodes() if n.get("Alive")]
        answers = list(self._pool.map(_answers, [(n["NodeManagerAddress"], int(n["NodeManagerPort"]))
                                                 for n in table]))
        live = {n["NodeID"]: dict(n.get("Resources") or {}) for n, ok in zip(table, answers) if ok}
        with self._lock:
            newly = set(self._live) - set(live)
            self._live, self._at = live, time.monotonic()
        for n in sorted(newly):
            log.warning("dcr_ray: node %s is gone (Ray's node table or its raylet's answer)", n[:12])
        return dict(live)

    def lost(self, keys: Iterable[str]) -> list[str]:
        """Those of ``keys`` whose actor runs on a node that is not alive (known nodes only)."""
        keys = list(keys)
        nodes = {k: self.node_of(k) for k in keys}
        if not any(nodes.values()):
            return []
        live = self.live()
        return [k for k in keys if nodes[k] is not None and nodes[k] not in live]

    def can_host(self, resources: Mapping[str, float]) -> bool:
        """Whether a live node offers every one of ``resources`` (at least the amount asked): where none
        does, an actor that asks for them cannot be placed until a node that does joins."""
        return bool(self.hosts(resources))

    def hosts(self, resources: Mapping[str, float]) -> list[str]:
        """The live nodes that offer every one of ``resources``."""
        return sorted(n for n, have in self.live().items()
                      if all(have.get(r, 0.0) >= amount for r, amount in resources.items()))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
