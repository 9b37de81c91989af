"""Relay actors: carry each payload across a cluster boundary once, then fan it out inside.

A cluster's *head* relay receives ``push(key, [ref], targets)`` from every owner. The ref arrives
nested in a list, so Ray does not resolve it for us; the head pulls the bytes once (the only
crossing of that cluster's boundary, counted in ``stats()`` and reported to ``on_cross`` when one is
given), and ``ray.put``s them again: the copy is now owned by, and located at, the head's node.
It forwards *that* ref, so engines in the cluster pull from the head's node (or from each other),
never from the owner across the boundary. The copy also outlives the owner actor, so a late engine
or a retry inside the same attempt does not cross again. Copies are released when the coordinator
ends the transfer (``release``); after a commit (``keep``) a head keeps the committed attempt's copies
in the cluster's catch-up window (:mod:`dcr_ray.relay.window`), so an engine that missed versions
takes their deltas from here (``window``) instead of a dense copy.

Inside a cluster, a relay forwards to at most ``fanout`` children: engines (``deliver(ref)``, a
top-level ref Ray resolves before the engine runs) or sub-relays (``forward(key, [ref], targets)``,
nested: sub-relays route refs they never read). ``targets`` (engine ids) restricts delivery, e.g. a
dense bootstrap of one joining engine.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import ray

from dcr_ray import metrics
from dcr_ray.errors import RefitTimeoutError
from dcr_ray.failpoints import failpoint
from dcr_ray.heap import return_free_heap
from dcr_ray.start_clock import StartClock
from dcr_ray.relay.window import CatchUpWindow, CommittedStep


class RelayActor:
    """One relay of a cluster's tree. ``on_cross(nbytes)`` (heads only, optional) observes, and may
    delay, each boundary crossing: benchmarks pass a link emulator (:mod:`dcr_ray.testing.links`). A head's
    pull of a payload waits at most ``pull_timeout_s`` (the stage timeout): past it the push fails, and with
    it the owner's send, instead of holding a relay thread for good."""

    def __init__(self, relay_id: str, cluster: str, *, head: bool, on_cross=None, window_bytes: int = 0,
                 pull_timeout_s: float | None = None):
        self._clock = StartClock()  # worker start and imports
        self.relay_id = relay_id
        self.cluster = cluster
        self.head = head
        self.on_cross = on_cross
        self.pull_timeout_s = pull_timeout_s
        self.children: list[tuple[str, object, frozenset]] = []
        self._held: dict[str, dict] = defaultdict(dict)  # transfer -> payload key -> (ref, bytes)
        self._window = CatchUpWindow(window_bytes if head else 0)
        self._lock = threading.Lock()
        self._bytes_in: dict[str, int] = defaultdict(int)
        self._payloads_in: dict[str, set] = defaultdict(set)
        self._seen: set[tuple] = set()
        self._routing = -1  # the generation of the routing in force

    def __repr__(self) -> str:  # shown by Ray (dashboard, logs, errors)
        return f"RelayActor({self.relay_id}, cluster={self.cluster}, {'head' if self.head else 'inner'})"

    def crossing(self):
        """The observer of this relay's boundary crossings (``on_cross``: an emulated link in
        benchmarks), or None."""
        return self.on_cross

    def set_children(self, children: list[tuple[str, object, list[str]]], generation: int = 0) -> bool:
        """``[(kind, handle, engine ids below it)]`` with kind ``"engine"`` or ``"relay"``. ``generation``
        orders the routings the coordinator sends: a relay answers calls concurrently, so a routing sent
        before a later one (an engine re-created twice in a row) may run after it, and is then ignored:
        children are never routed back to an engine's dead incarnation. Returns whether it took it."""
        failpoint("relay.wire")
        with self._lock:
            if generation < self._routing:
                return False
            self._routing = generation
            self.children = [(k, h, frozenset(ids)) for k, h, ids in children]
        return True

    def push(self, key: tuple, refs: list, targets: list[str] | None = None) -> int:
        """Head relay: pull a payload across the boundary once, re-own it here, fan it out."""
        failpoint("relay.push")
        transfer = key[0]
        with self._lock:
            dup = key in self._seen
            self._seen.add(key)
        if dup:  # a repeated push (retried call): the payload already crossed and was forwarded
            return 0
        try:
            data = ray.get(refs[0], timeout=self.pull_timeout_s)
        except ray.exceptions.GetTimeoutError:
            with self._lock:  # not crossed: a retried push may try again
                self._seen.discard(key)
            raise RefitTimeoutError(f"relay {self.relay_id}: payload {key} could not be pulled across the "
                                    f"boundary of cluster {self.cluster} within {self.pull_timeout_s:.0f} s "
                                    f"(CommitConfig.timeout_s)") from None
        if self.on_cross is not None:
            self.on_cross(len(data))
        failpoint("relay.pulled")
        own = ray.put(data)
        with self._lock:
            self._held[transfer][tuple(key)] = (own, len(data))
            self._bytes_in[transfer] += len(data)
            self._payloads_in[transfer].add(key)
        metrics.record("relay_bytes", len(data), tags={"cluster": self.cluster, "relay": self.relay_id})
        self._forward(key, own, targets)
        return len(data)

    def forward(self, key: tuple, refs: list, targets: list[str] | None = None) -> None:
        """Sub-relay: route a ref inside the cluster without reading it."""
        failpoint("relay.subforward")
        with self._lock:
            self._held[key[0]][tuple(key)] = (refs[0], 0)
        self._forward(key, refs[0], targets)

    def _forward(self, key: tuple, ref, targets) -> None:
        want = None if targets is None else set(targets)
        for kind, handle, ids in self.children:
            if want is not None and not (ids & want):
                continue
            failpoint("relay.forward")
            if kind == "engine":
                handle.deliver.remote(ref)
            else:
                handle.forward.remote(key, [ref], targets)

    def release(self, transfer: str) -> None:
        """Drop this relay's copies of ``transfer``'s payloads."""
        failpoint("relay.release")
        with self._lock:
            self._held.pop(transfer, None)
            self._seen = {k for k in self._seen if k[0] != transfer}
        return_free_heap()

    def keep(self, step: CommittedStep) -> bool:
        """After ``step.transfer`` committed: a head keeps the copies of the committed attempt in its
        catch-up window when it holds every one of ``step.keys`` (its cluster took part); everything else
        of the transfer is released. Returns whether the step is in the window."""
        failpoint("relay.keep")
        with self._lock:
            held = self._held.pop(step.transfer, {})
            self._seen = {k for k in self._seen if k[0] != step.transfer}
            keys = sorted(tuple(k) for k in step.keys)
            if not self.head or self._window.max_bytes <= 0 or any(k not in held for k in keys):
                kept = None
            else:
                kept = CommittedStep(transfer=step.transfer, attempt=step.attempt, base=step.base,
                                     target=step.target, base_id=step.base_id, keys=keys,
                                     payloads=[held[k][0] for k in keys], nbytes=sum(held[k][1] for k in keys))
            added = kept is not None and self._window.add(kept)
        return_free_heap()
        return added

    def window(self, version: int, version_id: str | None) -> list[CommittedStep] | None:
        """The kept steps from content ``(version, version_id)`` to the newest commit (their payloads are
        refs owned by this head, on its node), or None when the window does not reach back to it."""
        with self._lock:
            return self._window.since(version, version_id)

    def stats(self) -> dict:
        """Bytes and payloads that entered this relay (heads: crossed the cluster boundary)."""
        with self._lock:
            return {"relay": self.relay_id, "cluster": self.cluster, "head": self.head,
                    "bytes_in": dict(self._bytes_in),
                    "payloads_in": {t: len(s) for t, s in self._payloads_in.items()},
                    "window": [st.header() for st in self._window.steps], "start": self._clock.report()}
