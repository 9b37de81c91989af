"""The relay-tree transport: payloads through the Ray object store, across each cluster boundary once.

Owners ``ray.put`` each frame and push its ref (nested in a list, so Ray does not resolve it) to every
targeted cluster's head relay; the head pulls it across the boundary once, re-owns it and fans it out
inside the cluster (see :mod:`dcr_ray.relay.relay`). Engines receive the bytes themselves: a top-level
ref argument that Ray resolves before ``deliver`` runs.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping

import ray

from dcr_ray.codec import PayloadKey
from dcr_ray.failpoints import failpoint
from dcr_ray.options import actor_options, create_named
from dcr_ray.relay.backpressure import wait_bounded
from dcr_ray.relay.relay import RelayActor
from dcr_ray.relay.tree import plan_tree
from dcr_ray.relay.window import CommittedStep


class RelaySink:
    """Owner side: ``ray.put`` each frame, push it to the heads, keep at most a bounded number unacked.

    The owner keeps each object alive until every head holds a copy (``drain``): the heads' copies then
    outlive the owner, so a late engine or a retry does not need it.
    """

    def __init__(self, heads: list, targets: list[str] | None, *, max_inflight: int, timeout_s: float):
        self.heads = heads
        self.targets = targets
        self.bound = max_inflight * max(1, len(heads))
        self.timeout = timeout_s
        self._acks: list = []
        self._refs: list = []

    def send(self, frame: bytes, key: PayloadKey) -> None:
        ref = ray.put(frame)
        self._refs.append(ref)
        for h in self.heads:
            self._acks.append(h.push.remote(tuple(key), [ref], self.targets))
        self._acks = wait_bounded(self._acks, self.bound, self.timeout)

    def drain(self) -> None:
        wait_bounded(self._acks, 0, self.timeout)
        self._acks, self._refs = [], []


#: A relay re-created in place of a dead one waits this long for the old one's name.
RELAY_NAME_RELEASE_S = 30.0


_REMOTE_RELAY = None


def _remote_relay():
    """The relay actor class as Ray's, made once per process (made again, it is exported to Ray again)."""
    global _REMOTE_RELAY
    if _REMOTE_RELAY is None:
        _REMOTE_RELAY = ray.remote(RelayActor)
    return _REMOTE_RELAY


class BytesReader:
    """Engine side: Ray already resolved the ref, so what arrives is the frame."""

    def read(self, payload: Any) -> bytes:
        return payload


class RelayTransport:
    """Builds one relay tree per cluster; its head relays count the bytes that crossed the boundary.

    ``on_cross`` optionally maps a cluster to a callable each of its head relays calls with the size of
    every payload that crosses into the cluster (benchmarks pass a link emulator; production: none).
    """

    kind = "relay"

    def __init__(self, config, on_cross: Mapping[str, Callable[[int], None]] | None = None):
        self.config = config
        self.on_cross = dict(on_cross or {})
        self.heads: dict[str, Any] = {}
        self.relays: dict[str, Any] = {}
        self._engine_cluster: dict[str, str] = {}
        self._near: Callable[[str], dict] | None = None
        self.suspended: set[str] = set()  # clusters out for lack of capacity (no relay of theirs runs)
        #: cluster -> (its relays by id, their routing calls, the head's id, the ids created anew): trees
        #: routed but not yet taken by :meth:`install`
        self._wiring: dict[str, tuple[dict, list, str, set]] = {}
        self._generation = 0  # the last routing sent (:meth:`_next_generation`)

    def reader(self, cluster: str) -> BytesReader:
        return BytesReader()

    def build(self, clusters: list, engines: Mapping[str, Any], engine_cluster: Mapping[str, str]) -> None:
        """Create every cluster's relay tree (detached relays, named ``dcr_relay:<relay id>``); they serve
        once :meth:`install` took them."""
        self._wire(clusters, engines, engine_cluster, find=False)

    def reconnect(self, clusters: list, engines: Mapping[str, Any], engine_cluster: Mapping[str, str]) -> None:
        """Find the relays of ``clusters`` (the handles held, else by name), create the ones that are gone,
        and route every relay to the current engine handles (a resumed coordinator, a re-created engine
        or relay); :meth:`install` takes them. Clusters that are suspended stay out."""
        self._wire([c for c in clusters if c.name not in self.suspended], engines, engine_cluster, find=True)

    def settle(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, until every relay created or routed since the last :meth:`install`
        answered its routing. Changes nothing: call it without the coordinator's lock."""
        failpoint("transport.wire")
        refs = [r for w in list(self._wiring.values()) for r in w[1]]  # a copy: the lock's holder may route
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)

    def install(self) -> list[str]:
        """Take the relay trees whose every relay answered its routing (never waits); returns the clusters
        whose trees did not. A tree still starting stays pending (a later routing of its cluster reuses
        its relays, and a later install takes it); one with a relay that died is dropped, and the relays
        created for it killed."""
        failed = []
        for cluster, (made, refs, head, created) in list(self._wiring.items()):
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            try:
                ray.get(ready, timeout=0)
            except Exception:  # a relay died while it was routed: the tree is dropped
                self._drop_wiring(cluster)
                failed.append(cluster)
                continue
            if len(ready) < len(refs):
                failed.append(cluster)  # still starting (or not placed): it stays pending
                continue
            del self._wiring[cluster]
            self.relays.update(made)
            self.heads[cluster] = made[head]
            self.suspended.discard(cluster)
        return sorted(failed)

    def _drop_wiring(self, cluster: str) -> None:
        """Forget ``cluster``'s pending tree, killing the relays created for it (their names are free again)."""
        made, _refs, _head, created = self._wiring.pop(cluster, ({}, [], "", set()))
        for rid in created:
            try:
                ray.kill(made[rid], no_restart=True)
            except Exception:
                pass

    def repair(self, clusters: list, engines: Mapping[str, Any], engine_cluster: Mapping[str, str],
               timeout_s: float = 10.0, lost: Iterable[str] = (), later: Iterable[str] = ()) -> list[str]:
        """Re-create relays that died, and those in ``lost`` (their node is gone: a call to them would wait
        until Ray notices), re-planning each cluster's tree around them; returns their ids. The others are
        asked at once whether they live, and given ``timeout_s`` together to answer. Relays in ``later``
        (gone, in a cluster no required engine is left in) are killed and forgotten, not re-created now:
        an engine re-created there brings them back (:meth:`reconnect`)."""
        for rid in [r for r in later if r in self.relays]:
            try:
                ray.kill(self.relays.pop(rid), no_restart=True)
            except Exception:
                pass
            cluster = rid.split("/", 1)[0]
            if rid == f"{cluster}/head":
                self.heads.pop(cluster, None)
        lost = {r for r in lost if r in self.relays}
        ask = {rid: r.stats.remote() for rid, r in self.relays.items() if rid not in lost}
        ready, _ = ray.wait(list(ask.values()), num_returns=len(ask), timeout=timeout_s) if ask else ([], [])
        dead = set(lost)
        for rid, ref in ask.items():
            if ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    dead.add(rid)
        if dead:
            for rid in dead:
                try:
                    ray.kill(self.relays[rid], no_restart=True)  # frees its name at once, even on a lost node
                except Exception:
                    pass
            hit = {r.split("/", 1)[0] for r in dead}
            self._wire([c for c in clusters if c.name in hit and c.name not in self.suspended], engines,
                       engine_cluster, find=True, replace=dead)
        return sorted(dead)

    def place_with(self, near: Callable[[str], dict]) -> None:
        """``near(cluster)``: extra Ray options (a scheduling strategy) of the relays created from now on in
        that cluster (the coordinator keeps them off nodes that are gone)."""
        self._near = near

    def suspend(self, cluster: str) -> list[str]:
        """Take ``cluster`` out (no live node can host it): its relays are killed, and no sink, window,
        count or release reaches it until :meth:`resume`. Returns the relay ids it had."""
        self.suspended.add(cluster)
        self._drop_wiring(cluster)
        gone = sorted(rid for rid in self.relays if rid.split("/", 1)[0] == cluster)
        for rid in gone:
            try:
                ray.kill(self.relays.pop(rid), no_restart=True)
            except Exception:
                pass
        self.heads.pop(cluster, None)
        return gone

    def resume(self, cluster, engines: Mapping[str, Any], engine_cluster: Mapping[str, str]) -> None:
        """``cluster`` (a :class:`~dcr_ray.config.ClusterSpec`) can be hosted again: its relay tree is
        created anew, routed to ``engines``; it stays suspended until :meth:`install` takes it."""
        self._wire([cluster], engines, engine_cluster, find=False, placed=True)

    def _wire(self, clusters, engines, engine_cluster, *, find: bool, replace: set[str] = frozenset(),
              placed: bool | None = None) -> None:
        """Plan and create (or, with ``find``, find) each cluster's relays and route them, without waiting:
        the routing calls are kept for :meth:`settle` and :meth:`install` (a payload pushed to a relay that
        does not know its children yet would be forwarded to no one, so a tree serves only once every
        relay answered). A relay created in place of one that is gone (``placed``: by default whenever it
        finds relays) takes the placement :meth:`place_with` gives; the first build leaves placement to Ray."""
        placed = find if placed is None else placed
        Relay = _remote_relay()
        self._engine_cluster = dict(engine_cluster)
        for c in clusters:
            ids = [e for e in engines if engine_cluster[e] == c.name]
            tree = plan_tree(c.name, ids, c.fanout)
            made, created = {}, set()
            pending = self._wiring.get(c.name, ({}, [], "", set()))
            for node in tree.walk():
                head = node is tree
                name = f"dcr_relay:{node.relay_id}"
                if node.relay_id in pending[3]:  # created for this cluster before and still starting: reused
                    made[node.relay_id] = pending[0][node.relay_id]
                    created.add(node.relay_id)
                    continue
                if find and node.relay_id not in replace:
                    if node.relay_id in self.relays:
                        made[node.relay_id] = self.relays[node.relay_id]
                        continue
                    try:
                        made[node.relay_id] = ray.get_actor(name, namespace=self.config.namespace)
                        continue
                    except ValueError:
                        pass  # gone: create it again
                opts = actor_options("relay", name, resources=c.resources, detached=True,
                                     namespace=self.config.namespace, user=self.config.actor_options,
                                     **(self._near(c.name) if placed and self._near is not None else {}))
                cross = self.on_cross.get(c.name) if head else None
                made[node.relay_id] = create_named(  # called at once: the loop variables are current
                    lambda: Relay.options(**opts).remote(node.relay_id, c.name, head=head, on_cross=cross,
                                                         window_bytes=self.config.transport.catchup_window_bytes,
                                                         pull_timeout_s=self.config.commit.timeout_s),
                    name, wait_s=RELAY_NAME_RELEASE_S, namespace=self.config.namespace)
                created.add(node.relay_id)
            wired = []
            generation = self._next_generation()
            for node in tree.walk():
                kids = [("engine", engines[e], [e]) for e in node.engines]
                kids += [("relay", made[s.relay_id], s.all_engines()) for s in node.subrelays]
                wired.append(made[node.relay_id].set_children.remote(kids, generation))
            for rid in pending[3] - set(made):  # created for a tree that is planned otherwise now
                try:
                    ray.kill(pending[0][rid], no_restart=True)
                except Exception:
                    pass
            self._wiring[c.name] = (made, wired, tree.relay_id, created)

    def _next_generation(self) -> int:
        """A routing's generation: later than every routing this transport sent, and than a restarted
        coordinator's predecessor's (wall-clock nanoseconds, kept increasing within this process)."""
        self._generation = max(time.time_ns(), self._generation + 1)
        return self._generation

    def sink(self, targets: list[str] | None, required: list[str], *, every_cluster: bool = False) -> RelaySink:
        every = targets is None or every_cluster
        clusters = set(self.heads) if every else {self._engine_cluster[e] for e in targets}
        heads = [h for c, h in self.heads.items() if c in clusters]
        return RelaySink(heads, targets, max_inflight=self.config.transport.max_inflight_payloads,
                         timeout_s=self.config.commit.timeout_s)

    def release(self, transfer: str) -> None:
        for r in self.relays.values():
            r.release.remote(transfer)

    def keep(self, step: CommittedStep) -> None:
        heads = set(map(id, self.heads.values()))
        waits = [r.keep.remote(step) if id(r) in heads else r.release.remote(step.transfer)
                 for r in self.relays.values()]
        ray.get(waits, timeout=self.config.commit.timeout_s)  # a heal asked next finds the step

    def drop_windows(self) -> None:
        pass  # the head relays hold them: they go with the relays

    def window(self, cluster: str, version: int, version_id: str | None) -> list[CommittedStep] | None:
        head = self.heads.get(cluster)
        if head is None:
            return None
        return ray.get(head.window.remote(version, version_id), timeout=self.config.commit.timeout_s)

    def link_bytes(self, transfer: str, acks: Mapping[str, dict]) -> dict[str, int]:
        stats = ray.get([h.stats.remote() for h in self.heads.values()], timeout=self.config.commit.timeout_s)
        return {s["cluster"]: s["bytes_in"].get(transfer, 0) for s in stats}

    def actors(self) -> dict[str, Any]:
        """The relays in service, and those still starting (a pending tree's)."""
        out = {rid: h for made, _refs, _head, created in list(self._wiring.values()) for rid, h in made.items()
               if rid in created}
        return {**out, **dict(self.relays)}

    def stats(self) -> list[dict]:
        return ray.get([r.stats.remote() for r in self.relays.values()], timeout=self.config.commit.timeout_s)
