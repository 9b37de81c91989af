"""Which nodes are alive now, where each actor runs, and which clusters the live nodes can host.

Ray marks a node dead when its health checks miss (about 15 s with Ray's defaults). Until then a call to
an actor on a node that vanished does not fail: it waits. A refit that waited on Ray to notice would
spend those seconds with the surviving engines paused, and a relay or engine re-created in the meantime
may be placed on the dead node and wait with it. So the coordinator keeps its own view, from two
facts, each paid for only when it can change something:

- **Ray's node table**: a node Ray marked dead is dead. The table is read again when Ray publishes a
  change of it (GCS's node channel, one long poll held by a thread of this process: :class:`TableChanges`),
  and at each sweep of the coordinator (before every attempt); between those, the last read stands. Where
  the subscription cannot be opened (another Ray release), the table is read at most every
  :data:`TABLE_POLL_S` instead.
- **A suspect node's raylet answers**: a call waited on for :data:`SUSPECT_AFTER_S` makes the node of its
  actor a suspect, and only suspects are probed: a TCP connection to the raylet's port, refused at once
  by a host whose raylet died, unanswered from a host that is gone (:data:`PROBE_TIMEOUT_S`). A busy but
  alive node still accepts it (the kernel does). Probes run in a pool and are never waited on: a node
  whose probe failed is lost from the next question on. Each suspect is probed at most every
  :data:`PROBE_EVERY_S`.

- **The nodes an attempt will call are probed once, at its sweep**, and the sweep waits for those
  answers (:meth:`NodeWatch.confirm`: at most :data:`PROBE_TIMEOUT_S` for up to :data:`PROBE_THREADS`
  nodes at once; a node already taken for lost is not asked again): what is gone leaves the refit before
  anyone is called, and an owner's loss fails it at once.

The cost per refit at 100 nodes is therefore, per attempt, one table read and one probe per node it
calls (its sweep), the table reads Ray's changes cause (none in a quiet refit), and a probe per
:data:`PROBE_EVERY_S` of each node whose actors a stage waits on longer than :data:`SUSPECT_AFTER_S`
(``python -m benchmarks.tools.nodewatch_cost`` simulates it).
Probing every raylet at every poll cost ~400 connections a second at 100 nodes, and each unreachable
host up to a second of the poll.

A node fails if either says so. Its actors are *lost*: the coordinator takes them out of the refit in
one pass (:mod:`~dcr_ray.actors.recovery.outages`) instead of finding them one stage timeout at a time. A
node that is alive but unreachable (a partition) is taken for lost: that costs work (its engines heal and
rejoin, re-created elsewhere with a new incarnation that fences the old one), never bits, since an engine
outside the required set is neither written by a commit nor counted in one.

Where each actor runs is asked of the actor once (``__ray_call__``, any actor answers it) when the
coordinator first holds its handle; an actor whose node is not known yet is never reported lost here
(its calls fail or time out as before).
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping

import ray

log = logging.getLogger("dcr_ray")

#: How long a raylet probe waits for a TCP connection before the node counts as gone.
PROBE_TIMEOUT_S = 1.0
#: Probes in flight at once (a sweep's probes of k unreachable hosts take about k / this many seconds).
PROBE_THREADS = 32
#: A node becomes a suspect (its raylet is probed) once a call to one of its actors was waited on this long.
SUSPECT_AFTER_S = 1.0
#: A suspect node is probed at most this often.
PROBE_EVERY_S = 1.0
#: Without a subscription to Ray's node changes, the table is read at most this often.
TABLE_POLL_S = 1.0
#: A node whose raylet did not answer is probed again this often (a node wrongly suspected comes back).
RECHECK_S = 10.0
#: A question about an actor this long after the last one starts its wait afresh (a new call).
_ASKED_GAP_S = 0.6


def _node_id(_actor) -> str:
    """(Run in any actor.) The id of the node it runs on."""
    return ray.get_runtime_context().get_node_id()


def _answers(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=PROBE_TIMEOUT_S).close()
        return True
    except OSError:
        return False


def ray_table() -> list[dict]:
    """Ray's node table: ``{"NodeID", "Alive", "Resources", "NodeManagerAddress", "NodeManagerPort"}`` each."""
    return ray.nodes()


def capacity(nodes: Iterable[Mapping[str, float]], needs: Mapping[str, float]) -> int | float:
    """How many actors that each ask ``needs`` the nodes (their total resources) can hold together."""
    asks = {r: a for r, a in needs.items() if a > 0}
    if not asks:
        return math.inf
    return sum(min(int(have.get(r, 0.0) / a + 1e-9) for r, a in asks.items()) for have in nodes)


def _done(value) -> Future:
    """A finished future holding ``value`` (a probe answered in the caller's wait)."""
    f: Future = Future()
    f.set_result(value)
    return f


class TableChanges:
    """Counts the changes of Ray's node table as GCS publishes them (``seq``), from one long poll held by a
    daemon thread; ``seq`` is None when the subscription could not be opened (the caller then polls)."""

    def __init__(self) -> None:
        self.seq: int | None = 0
        self._closed = threading.Event()
        try:
            from ray._private.gcs_pubsub import GcsAioNodeInfoSubscriber

            address = ray.get_runtime_context().gcs_address
        except Exception:  # another Ray release, or not connected: read the table on a timer instead
            self.seq = None
            return
        self._thread = threading.Thread(target=self._run, args=(GcsAioNodeInfoSubscriber, address),
                                        name="dcr-node-changes", daemon=True)
        self._thread.start()

    def _run(self, subscriber_cls, address: str) -> None:
        async def follow() -> None:
            sub = subscriber_cls(address=address)
            await sub.subscribe()
            while not self._closed.is_set():
                if await sub.poll(batch_size=1024):  # a long poll: answered when Ray publishes a change
                    self.seq += 1

        try:
            asyncio.run(follow())
        except Exception as e:  # the subscription broke: fall back to reading the table on a timer
            log.warning("dcr_ray: following Ray's node changes failed (%r); the node table is read every %.1f s",
                        e, TABLE_POLL_S)
            self.seq = None

    def close(self) -> None:
        self._closed.set()


class NodeWatch:
    """The live nodes (Ray's table, and the raylets of suspect nodes) and the node of every actor it
    located. ``table``, ``probe`` and ``changes`` default to Ray's node table, a TCP probe and
    :class:`TableChanges`; a simulation passes its own (``dcr-ray bench nodewatch``)."""

    def __init__(self, table: Callable[[], list[dict]] | None = None,
                 probe: Callable[[tuple[str, int]], bool] | None = None, changes=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._table_fn = table or ray_table
        self._probe_fn = probe or _answers
        self._changes = changes
        self._clock = clock
        self._where: dict[str, Any] = {}  # actor key -> its node id, or the pending ref that will say it
        self._ids: dict[str, Any] = {}  # actor key -> the Ray actor id it was located for
        self._live: dict[str, dict[str, float]] = {}  # node id -> total resources
        self._address: dict[str, tuple[str, int]] = {}  # node id -> its raylet's address
        self._seen_seq: int | None = None
        self._at = float("-inf")
        self._asked: dict[str, tuple[float, float]] = {}  # actor key -> (first asked, last asked) of one wait
        self._probes: dict[str, tuple[float, Future]] = {}  # node id -> (when probed, the probe's answer)
        self._failed: set[str] = set()  # nodes whose raylet did not answer (lost until the table drops them)
        self._pool = ThreadPoolExecutor(max_workers=PROBE_THREADS, thread_name_prefix="dcr-node-probe")
        self.reads = 0  #: node-table reads so far
        self.probes = 0  #: raylet probes so far

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
            self._asked.pop(key, None)

    def forget(self, key: str) -> None:
        with self._lock:
            self._where.pop(key, None)
            self._ids.pop(key, None)
            self._asked.pop(key, None)

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
        """Node id -> total resources of every node Ray has not marked dead and whose raylet did not fail a
        probe. The table is read again with ``fresh``, when Ray published a change of it, or (without a
        subscription) when the last read is older than :data:`TABLE_POLL_S`."""
        if self._changes is None:
            self._changes = TableChanges()
        seq = self._changes.seq
        with self._lock:
            stale = fresh or (seq != self._seen_seq if seq is not None
                              else self._clock() - self._at >= TABLE_POLL_S)
        if stale:
            self._read(seq)
        self._collect_probes()
        with self._lock:
            return {n: r for n, r in self._live.items() if n not in self._failed}

    def _read(self, seq: int | None) -> None:
        table = [n for n in self._table_fn() if n.get("Alive")]
        live = {n["NodeID"]: dict(n.get("Resources") or {}) for n in table}
        with self._lock:
            self.reads += 1
            newly = set(self._live) - set(live)
            self._live, self._at, self._seen_seq = live, self._clock(), seq
            self._address = {n["NodeID"]: (n["NodeManagerAddress"], int(n["NodeManagerPort"])) for n in table}
            self._failed &= set(live)
        for n in sorted(newly):
            log.warning("dcr_ray: node %s is gone (Ray's node table)", n[:12])

    def _collect_probes(self) -> None:
        """Take the answers of finished probes: a node whose raylet did not answer is lost, one that answers
        again is alive (it was only unreachable: its actors were fenced off meanwhile); the nodes taken for
        lost are probed again every :data:`RECHECK_S`."""
        now = self._clock()
        with self._lock:
            done = {n: f.result() for n, (_, f) in self._probes.items() if f.done()}
            newly = sorted(n for n, ok in done.items() if not ok and n in self._live and n not in self._failed)
            back = sorted(n for n, ok in done.items() if ok and n in self._failed)
            self._failed = (self._failed | set(newly)) - set(back)
            recheck = [n for n in self._failed if now - self._probes[n][0] >= RECHECK_S]
        for n in newly:
            log.warning("dcr_ray: node %s is gone (its raylet does not answer)", n[:12])
        for n in back:
            log.warning("dcr_ray: node %s answers again", n[:12])
        if recheck:
            self._suspect(recheck, again=True)

    def _suspect(self, nodes: Iterable[str], again: bool = False) -> None:
        """Probe each of ``nodes`` whose last probe is older than :data:`PROBE_EVERY_S` (never waited on);
        nodes taken for lost only with ``again``."""
        now = self._clock()
        with self._lock:
            for n in nodes:
                last = self._probes.get(n)
                if ((n in self._failed and not again) or n not in self._address
                        or (last and (not last[1].done() or now - last[0] < PROBE_EVERY_S))):
                    continue
                self.probes += 1
                self._probes[n] = (now, self._pool.submit(self._probe_fn, self._address[n]))

    def now(self) -> float:
        """This watch's clock (a wait passes its start to :meth:`lost` as ``since``)."""
        return self._clock()

    def lost(self, keys: Iterable[str], since: float | None = None) -> list[str]:
        """Those of ``keys`` whose actor runs on a node that is not alive (known nodes only). Asked again and
        again while calls to them are outstanding (:func:`~dcr_ray.actors.fleet.calls.gather`): once the wait
        began (``since``, on :meth:`now`'s clock) :data:`SUSPECT_AFTER_S` ago, their nodes are probed. Without
        ``since``, a key asked about again and again without a pause of :data:`_ASKED_GAP_S` counts as one
        wait."""
        keys = list(keys)
        nodes = {k: self.node_of(k) for k in keys}
        if not any(nodes.values()):
            return []
        now = self._clock()
        with self._lock:
            if since is None:
                for k in keys:
                    first, last = self._asked.get(k, (now, now))
                    self._asked[k] = (first if now - last < _ASKED_GAP_S else now, now)
                began = {k: self._asked[k][0] for k in keys}
            else:
                began = dict.fromkeys(keys, since)
            suspects = {nodes[k] for k in keys if nodes[k] and now - began[k] >= SUSPECT_AFTER_S}
        if suspects:
            self._suspect(suspects)
        live = self.live()
        return [k for k in keys if nodes[k] is not None and nodes[k] not in live]

    def confirm(self, keys: Iterable[str] | None = None) -> None:
        """Probe the nodes of ``keys`` (None: every node of the table) now and wait for the answers (in
        parallel, each at most :data:`PROBE_TIMEOUT_S`): the sweep asks it of the nodes its attempt will call,
        a resumed coordinator of every node before it decides which clusters can be hosted."""
        if keys is None:
            self.live(fresh=True)
            with self._lock:
                nodes = set(self._live)
        else:
            nodes = {self.node_of(k) for k in keys} - {None}
        with self._lock:
            todo = {n: self._address[n] for n in nodes if n in self._address and n not in self._failed}
            self.probes += len(todo)
        answers = dict(zip(todo, self._pool.map(self._probe_fn, todo.values()))) if todo else {}
        newly = sorted(n for n, ok in answers.items() if not ok)
        with self._lock:
            now = self._clock()
            for n in answers:
                self._probes[n] = (now, _done(answers[n]))
            self._failed |= set(newly)
        for n in newly:
            log.warning("dcr_ray: node %s is gone (its raylet does not answer)", n[:12])

    def can_host(self, resources: Mapping[str, float]) -> bool:
        """Whether a live node offers every one of ``resources`` (at least the amount asked): where none
        does, an actor that asks for them cannot be placed until a node that does joins."""
        return bool(self.hosts(resources))

    def room(self, resources: Mapping[str, float], placed: int) -> int | float:
        """How many more actors asking ``resources`` the live nodes can hold beside ``placed`` such actors
        that already run on them (their total resources, not what is free now)."""
        return capacity(self.live().values(), resources) - placed

    def hosts(self, resources: Mapping[str, float]) -> list[str]:
        """The live nodes that offer every one of ``resources``."""
        return sorted(n for n, have in self.live().items()
                      if all(have.get(r, 0.0) >= amount for r, amount in resources.items()))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        if self._changes is not None:
            self._changes.close()
