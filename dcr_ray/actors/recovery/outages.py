"""Outages: lost nodes and lost capacity, found in one pass, so that the rest of the fleet goes on.

A node that dies takes its engines, its relays and every object only its store held, together; Ray
notices seconds later (:mod:`~dcr_ray.actors.fleet.nodes`). A region that goes away takes every node of a
cluster, and nothing can host that cluster's actors until a node with its resources joins. Neither
may stall a refit, nor keep the engines of the clusters that are fine from serving. So before each
attempt, and after each failed one, the coordinator sweeps (:meth:`Outages.sweep`):

1. **Clusters no live node can host** (none offers what their engines or relays ask) *wait for
   capacity*: their engines leave the required set and wait in the healing table; the transport
   suspends the cluster (its relays are gone or could not be placed). The refit commits for the
   others; ``status()["capacity"]`` and the report's warnings name the cluster and since when.
2. **Clusters that waited and can be hosted again** are resumed by the healing worker, off the refits'
   path (:meth:`Outages.begin_regain`, :meth:`Outages.end_regain`): their relays are created anew on a
   live node and serve once they answered, and their engines heal in the background (re-created, a
   copy from a peer of another cluster, one crossing of the cluster's link, then copies inside the
   cluster).
3. **Required engines on lost nodes** leave the required set at once and are re-created and healed
   after the commit; no stage of this refit calls them again.
4. **Relays on lost nodes** are re-created now, beside the live engines of their cluster.
5. **Owners on lost nodes** fail the refit at once (:class:`~dcr_ray.errors.OwnerLostError` naming
   ``Refit.replace_owner``): their committed bits went with them.

A part of :class:`~dcr_ray.actors.coordinator.actor.CoordinatorActor`; it owns the capacity table (its own
lock: ``status()`` reads it beside the writers) and is handed the shared state. The caller of a sweep
holds the coordinator's lock (a sweep changes standings); relays it re-creates are waited for at most
the stage timeout (``CommitConfig.timeout_s``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from dcr_ray.actors.fleet.state import CoordinatorState
from dcr_ray.errors import OwnerLostError

log = logging.getLogger("dcr_ray")


@dataclass
class Sweep:
    """What one sweep found (each list sorted)."""

    lost_engines: list[str] = field(default_factory=list)  #: required engines whose node is gone
    waiting: list[str] = field(default_factory=list)  #: clusters that started waiting for capacity now
    relays: list[str] = field(default_factory=list)  #: relays re-created (their node was gone, or they died)
    out_engines: list[str] = field(default_factory=list)  #: required engines of clusters now waiting

    def warnings(self, since: dict[str, float]) -> list[str]:
        """The report's warnings: every cluster waiting for capacity (``since``: when each began), and what
        this sweep changed."""
        out = [f"cluster {c!r} is waiting for capacity since {time.strftime('%H:%M:%S', time.localtime(t))}: no "
               f"live node offers what its engines ask; refits commit without it, and its engines heal when a "
               f"node with its resources joins (Refit.status()['capacity'])" for c, t in sorted(since.items())]
        out += [f"engine {e}'s node is gone: it left this refit and is re-created and healed after the commit"
                for e in self.lost_engines]
        return out


class Outages:
    """The capacity table and the sweep (see the module doc)."""

    def __init__(self, state: CoordinatorState):
        self._shared = state
        self._guard = threading.Lock()
        self._waiting: dict[str, float] = {}  # cluster -> when it started waiting for capacity (time.time())

    @property
    def waiting(self) -> dict[str, float]:
        """cluster -> when it started waiting for capacity (a copy)."""
        with self._guard:
            return dict(self._waiting)

    def waiting_for(self, clusters) -> None:
        """``clusters`` wait for capacity from now (a resumed coordinator found no live node for them)."""
        with self._guard:
            for c in clusters:
                self._waiting.setdefault(c, time.time())

    def status(self) -> dict:
        """``{cluster: {"waiting_since": time.time(), "needs": {resource: amount}}}`` of every cluster
        waiting for capacity."""
        topo = self._shared.topology
        return {c: {"waiting_since": t, "needs": topo.needs(c)} for c, t in sorted(self.waiting.items())}

    def can_host(self, cluster: str) -> bool:
        """Whether ``cluster``'s actors can be placed now (a live node offers what they ask)."""
        return self._shared.topology.can_host(cluster)

    def begin_regain(self, cluster: str, hostable: bool | None = None) -> bool:
        """If ``cluster`` waits for capacity and a live node can host it now (``hostable``: already asked,
        before): its relays are created on a live node (not waited for: :meth:`end_regain` decides, under the
        coordinator's lock, once they answered). Returns whether it can be hosted. Needs no lock: no refit
        reaches a cluster that waits for capacity, and its relays serve only once installed."""
        if cluster not in self.waiting:
            return True
        if not (self.can_host(cluster) if hostable is None else hostable):
            return False
        topo = self._shared.topology
        topo.transport.resume(topo.clusters[cluster], topo.engines, topo.engine_cluster)
        return True

    def end_regain(self, cluster: str, failed: list[str]) -> bool:
        """After the transport's ``install`` (``failed``: the clusters it dropped): ``cluster`` stops waiting if
        its relays serve. Returns whether it does. Call with the coordinator's lock held."""
        if cluster in failed:
            return False
        with self._guard:
            since = self._waiting.pop(cluster, None)
        if since is not None:
            log.warning("dcr_ray: cluster %s can be hosted again after %.0f s; its relays were re-created", cluster,
                        time.time() - since)
        return True

    def sweep(self) -> Sweep:
        """One pass over the live nodes (see the module doc); raises ``OwnerLostError`` if an owner's node is
        gone. The caller schedules the heals of ``lost_engines`` and ``out_engines``."""
        s = self._shared
        topo = s.topology
        topo.locate()
        topo.nodes.live(fresh=True)
        found = Sweep()
        # the nodes this attempt would call, asked once now (not at every poll): what is gone leaves before anyone
        # is called, and an owner lost fails the refit at once
        topo.nodes.confirm([*(f"owner:{o}" for o in s.owners), *(f"engine:{e}" for e in s.required),
                            *(f"relay:{r}" for r in topo.transport.actors())])
        owners = topo.nodes.lost(f"owner:{o}" for o in s.owners)
        if owners:
            ids = sorted(k.split(":", 1)[1] for k in owners)
            raise OwnerLostError(f"the node of owner(s) {ids} is gone, and their committed bits with it: replace each "
                                 f"with Refit.replace_owner(owner_id, handle), an actor that holds the committed "
                                 f"version's bits (e.g. restored from the committed checkpoint)")
        waiting = self.waiting
        for c in sorted(topo.clusters):
            if c not in waiting and not self.can_host(c):
                with self._guard:
                    self._waiting[c] = time.time()
                found.waiting.append(c)
                topo.transport.suspend(c)
                out = sorted(e for e in s.required if topo.engine_cluster[e] == c)
                s.standings.heal(out)
                found.out_engines += out
                log.warning("dcr_ray: cluster %s is waiting for capacity (no live node offers %s)", c, topo.needs(c))
        lost = topo.nodes.lost(f"engine:{e}" for e in s.required)
        found.lost_engines = sorted(k.split(":", 1)[1] for k in lost)
        s.standings.heal(found.lost_engines)
        relays = sorted(k.split(":", 1)[1] for k in topo.nodes.lost(f"relay:{r}" for r in topo.transport.actors()))
        if relays:
            # a relay is re-created now only where a required engine needs it; elsewhere it comes back with
            # the engines re-created there, off this refit's path
            needed = {topo.engine_cluster[e] for e in s.required}
            now = [r for r in relays if r.split("/", 1)[0] in needed]
            waiting = self.waiting
            found.relays = topo.transport.repair([topo.clusters[c] for c in topo.clusters if c not in waiting],
                                                 topo.engines, topo.engine_cluster, lost=now,
                                                 later=[r for r in relays if r not in now])
            log.warning("dcr_ray: relay(s) %s were on a lost node: %s re-created on a live one, the others come "
                        "back with their cluster's engines", relays, found.relays or "none")
            topo.wire(s.config.commit.timeout_s)  # the refit needs them: at most the stage timeout
        return found
