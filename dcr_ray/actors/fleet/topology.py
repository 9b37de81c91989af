"""The topology: which engines exist, in which cluster, and the transport that reaches them.

The coordinator decides (:mod:`dcr_ray.actors.coordinator.actor`); the topology only creates and holds.
It starts one engine actor per engine of each :class:`~dcr_ray.config.ClusterSpec` (pinned to the
cluster's nodes by its resources, named ``dcr_engine:<cluster>/e<i>`` in namespace ``dcr_ray``), gives
each engine its transport's reader, and lets the transport build what it needs (relay trees).
Engines dcr_ray did not start join through ``ClusterSpec.adopt``: each gets a proxy engine actor
(``dcr_engine:<cluster>/a<i>``) whose backend drives it through its own API (Ray actor handles or server
URLs); their bootstrap first checks by digest whether they already serve the committed version.

Engines, relays and placement groups are *detached*: they do not share the coordinator's fate. A
coordinator that resumes finds them again by name (:meth:`Topology.reconnect`), and an engine that
died is re-created in its place (:meth:`Topology.respawn`) and heals in the background (from a peer of its
cluster where one holds the committed version: :mod:`~dcr_ray.actors.recovery.healing`).

Every engine actor is one *incarnation* of its engine, with an epoch (:attr:`Topology.epochs`): a
re-created engine gets a new one, and the coordinator names the epoch it means in every call that opens,
flushes or activates a transfer or hands bits over. An older incarnation still running (its node was
only unreachable, so ``ray.kill`` may not have reached it) refuses them all: a partition cannot bring it
back into a refit.

Creating, finding and routing never wait: what the transport created or routed serves once it answered
(:meth:`Topology.wire`, or the transport's ``settle`` without the coordinator's lock and ``install``
with it).

The topology also knows where its actors run and which nodes are alive (:attr:`Topology.nodes`, a
:class:`~dcr_ray.actors.fleet.nodes.NodeWatch`): an engine or relay re-created after a node was lost is placed
on a node that is alive (:meth:`Topology.near`), never left to land on the lost one while Ray has not
noticed yet.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import ray

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dcr_ray.actors.engine.actor import EngineActor
from dcr_ray.actors.fleet import placement
from dcr_ray.actors.fleet.nodes import NodeWatch
from dcr_ray.actors.owner.endpoint import owner_endpoint
from dcr_ray.config import ClusterSpec, RefitConfig
from dcr_ray.errors import RefitTimeoutError
from dcr_ray.options import NAME_RELEASE_S, actor_options, create_named
from dcr_ray.relay.transport import Transport


def engine_name(engine_id: str) -> str:
    """The Ray actor name of engine ``engine_id`` (``<cluster>/e<i>``)."""
    return f"dcr_engine:{engine_id}"


_REMOTE_ENGINE = None


def _remote_engine():
    """The engine actor class as Ray's, made once per process: a class made again at every creation is
    exported to Ray again, which under the coordinator's lock a re-creation cannot afford."""
    global _REMOTE_ENGINE
    if _REMOTE_ENGINE is None:
        _REMOTE_ENGINE = ray.remote(EngineActor)
    return _REMOTE_ENGINE


def _keyed(factory, key: bytes | None):
    """An adopted engine's factory with the refit's frame key (its workers check frames with it)."""
    if hasattr(factory, "key"):
        factory = copy.copy(factory)
        factory.key = key
    return factory


class Topology:
    """Engines per cluster, owners, and the transport between them (held by the coordinator)."""

    def __init__(self, clusters: list[ClusterSpec], owners: dict[str, Any], transport: Transport):
        self.clusters = {c.name: c for c in clusters}
        self.owners = {o: owner_endpoint(h) for o, h in owners.items()}  # an OwnerEndpoint each
        self.transport = transport
        self.engines: dict[str, Any] = {}
        self.engine_cluster: dict[str, str] = {}
        self.pgs: dict[str, Any] = {}
        self._plan: dict[str, tuple[str, Any, int | None]] = {}  # engine id -> (cluster, factory, bundle)
        self.adopted: set[str] = set()  # ids of engines dcr_ray did not start (ClusterSpec.adopt)
        self.nodes = NodeWatch()  #: the live nodes, and where each engine, relay and owner runs
        #: engine id -> the epoch of the incarnation the coordinator holds (a new one at each creation)
        self.epochs: dict[str, int] = {}
        transport.place_with(lambda cluster: self.near(cluster, relay=True))

    # -- where actors run ---------------------------------------------------------------------------
    def needs(self, cluster: str) -> dict[str, float]:
        """What one actor of ``cluster`` asks of a node: an engine's bundle where the cluster starts
        engines (its resources, GPUs, CPUs), else its resources (relays and adopted engines' proxies)."""
        c = self.clusters[cluster]
        return placement.bundle(c) if c.started else dict(c.resources)

    def can_host(self, cluster: str) -> bool:
        """Whether a live node offers what an actor of ``cluster`` asks (see :meth:`needs`)."""
        return self.nodes.can_host(self.needs(cluster))

    def room(self, cluster: str, leaving=()) -> int | float:
        """How many more engines of ``cluster`` the live nodes can hold beside those of its engines that run
        on a live node now (``leaving``: engines about to be re-created, not counted as running)."""
        live = self.nodes.live()
        placed = sum(1 for e, c in self.engine_cluster.items()
                     if c == cluster and e not in leaving and self.nodes.node_of(f"engine:{e}") in live)
        return self.nodes.room(self.needs(cluster), placed)

    def placeable(self, engine_ids: list[str]) -> list[str]:
        """Those of ``engine_ids`` (engines to re-create) the live nodes have room for: per cluster, beside
        its engines that run (:meth:`room`)."""
        out: list[str] = []
        for cluster in sorted({self.engine_cluster[e] for e in engine_ids}):
            mine = [e for e in engine_ids if self.engine_cluster[e] == cluster]
            if self.can_host(cluster):
                out += mine[:max(0, int(min(self.room(cluster, leaving=mine), len(mine))))]
        return out

    def near(self, cluster: str, relay: bool = False) -> dict:
        """Ray options that put an actor re-created now in ``cluster`` on a live node that can host it: a
        relay beside the most live engines of its cluster, an engine on the host with the fewest. Empty
        when no live node can host it (Ray then holds it pending until one joins)."""
        hosts = self.nodes.hosts(self.needs(cluster))
        if not hosts:
            return {}
        load = dict.fromkeys(hosts, 0)
        for e, c in self.engine_cluster.items():
            n = self.nodes.node_of(f"engine:{e}") if c == cluster else None
            if n in load:
                load[n] += 1
        node = (max if relay else min)(hosts, key=lambda h: (load[h], h))
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)}

    def locate(self) -> None:
        """Ask every engine, relay and owner the coordinator holds where it runs (each once per handle)."""
        for e, h in self.engines.items():
            self.nodes.locate(f"engine:{e}", h)
        for r, h in self.transport.actors().items():
            self.nodes.locate(f"relay:{r}", h)
        for o, h in self.owners.items():
            self.nodes.locate(f"owner:{o}", h.handle)

    def _plan_engines(self, backend_factory, config: RefitConfig) -> None:
        for c in self.clusters.values():
            made = [(f"{c.name}/e{i}", backend_factory, i) for i in range(c.started)]
            made += [(f"{c.name}/a{i}", _keyed(f, config.codec.key), None) for i, f in enumerate(c.adopt)]
            for eid, factory, bundle in made:
                self._plan[eid] = (c.name, factory, bundle)
                self.engine_cluster[eid] = c.name
            self.adopted.update(f"{c.name}/a{i}" for i in range(len(c.adopt)))

    def is_adopted(self, eid: str) -> bool:
        """Whether engine ``eid`` is one dcr_ray did not start (its bootstrap first checks digests)."""
        return eid in self.adopted

    def _spawn(self, eid: str, config: RefitConfig, placed: bool = False):
        cname, factory, bundle = self._plan[eid]
        c = self.clusters[cname]
        where = placement.engine_options(c, self.pgs.get(cname), bundle)
        if placed and "scheduling_strategy" not in where:  # re-created: on a live node (its bundle's, with a group)
            where.update(self.near(cname))
        opts = actor_options("engine", engine_name(eid), detached=True, namespace=config.namespace,
                             user=config.actor_options, **where)
        epoch = max(time.time_ns(), self.epochs.get(eid, 0) + 1)  # later than every earlier incarnation's
        handle = create_named(lambda: _remote_engine().options(**opts).remote(
            eid, cname, factory, config, self.transport.reader(cname), epoch=epoch), engine_name(eid),
            namespace=config.namespace)
        self.epochs[eid] = epoch
        return handle

    def wire(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until what the transport created or routed answered, and take it
        into service; ``RefitTimeoutError`` names the clusters whose relays did not answer."""
        self.transport.settle(timeout_s)
        failed = self.transport.install()
        self.locate()
        if failed:
            raise RefitTimeoutError(f"the relays of cluster(s) {failed} did not answer within {timeout_s:.0f} s "
                                    f"(CommitConfig.timeout_s); the next attempt or heal waits for them again")

    def start(self, backend_factory, config: RefitConfig) -> None:
        """Create every engine actor, then the transport's own actors."""
        self._plan_engines(backend_factory, config)
        for c in self.clusters.values():
            self.pgs[c.name] = placement.reserve(c, config.commit.timeout_s, config.namespace)
        for eid in self._plan:
            self.engines[eid] = self._spawn(eid, config)
        self.transport.build(list(self.clusters.values()), self.engines, self.engine_cluster)
        self.wire(config.commit.start_timeout_s)  # the launch's own bound: relays start beside the engines

    def reconnect(self, backend_factory, config: RefitConfig) -> tuple[list[str], list[str]]:
        """Find this topology's live actors by name (a resumed coordinator); engines that are gone are
        re-created. Clusters no live node can host are suspended at once (nothing waits for them: they
        wait for capacity). Returns ``(ids of re-created engines, clusters that cannot be hosted)``; the
        engines the caller found answer ``state()`` with their epoch (:meth:`adopt_epochs`)."""
        self._plan_engines(backend_factory, config)
        for c in self.clusters.values():
            self.pgs[c.name] = placement.find(c, config.namespace)
        self.nodes.confirm()  # every node asked now: Ray's table may not show a node lost a moment ago
        out = sorted(c for c in self.clusters if not self.can_host(c))
        for c in out:
            self.transport.suspend(c)
        fresh = []
        for eid in self._plan:
            try:
                self.engines[eid] = ray.get_actor(engine_name(eid), namespace=config.namespace)
            except ValueError:
                self.engines[eid] = self._spawn(eid, config, placed=self.engine_cluster[eid] not in out)
                fresh.append(eid)
        self.transport.reconnect([c for n, c in self.clusters.items() if n not in out], self.engines,
                                 self.engine_cluster)
        self.wire(config.commit.timeout_s)
        return fresh, out

    def adopt_epochs(self, states: dict[str, dict]) -> None:
        """The epochs of the engines a resumed coordinator found (``states``: their ``state()``)."""
        for e, st in states.items():
            if st.get("epoch") is not None:
                self.epochs[e] = st["epoch"]

    def retire(self, eid: str, config: RefitConfig, wait_s: float = NAME_RELEASE_S) -> None:
        """Kill engine ``eid``'s actor (it died, or is being replaced) and wait until its name is free, so
        that :meth:`respawn` creates the new one at once (callers hold no lock while this waits)."""
        try:
            ray.kill(self.engines[eid], no_restart=True)
        except Exception:
            pass  # already gone
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                ray.get_actor(engine_name(eid), namespace=config.namespace)
            except ValueError:
                return
            time.sleep(0.1)

    def respawn(self, eid: str, config: RefitConfig):
        """Re-create engine ``eid`` (its actor died, or is fenced off) as a new incarnation and route its
        cluster's relays to it. Never waits: its relays serve the new actor once they answered
        (:meth:`wire`, or the transport's ``settle`` and ``install``)."""
        try:
            ray.kill(self.engines[eid], no_restart=True)
        except Exception:
            pass  # already gone
        self.engines[eid] = self._spawn(eid, config, placed=True)
        cluster = self.clusters[self.engine_cluster[eid]]
        self.transport.reconnect([cluster], self.engines, self.engine_cluster)
        self.nodes.locate(f"engine:{eid}", self.engines[eid])
        return self.engines[eid]

    def teardown(self) -> None:
        """Kill every engine and relay, drop the payloads kept for catch-up and remove the placement groups
        (``Refit.shutdown``)."""
        try:
            self.transport.drop_windows()
        except Exception:  # best effort: the store's objects can be deleted by hand
            pass
        for a in [*self.engines.values(), *self.transport.actors().values()]:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        for pg in self.pgs.values():
            if pg is not None:
                try:
                    ray.util.remove_placement_group(pg)
                except Exception:
                    pass

    def handles(self) -> dict[str, dict[str, Any]]:
        """Actor handles: ``{"engines": {id: h}, "owners": {id: h}, "relays": {id: h}}``."""
        return {"engines": dict(self.engines), "owners": {o: h.handle for o, h in self.owners.items()},
                "relays": self.transport.actors()}

    def engine_specs(self, timeout_s: float) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Canonical name -> (wire dtype, shape) the engines hold (asked of one engine)."""
        specs = ray.get(next(iter(self.engines.values())).tensor_specs.remote(), timeout=timeout_s)
        return {n: (s[0], tuple(s[1])) for n, s in specs.items()}
