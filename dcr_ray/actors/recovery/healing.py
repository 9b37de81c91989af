"""Healing, off the trainer's clock: engines outside the required set get the committed version in
the background, inside their cluster where they can, and join when they hold it.

``refit.remote()`` answers at commit. An engine that died (re-created here), one evicted as hung that
answers again, or one that asks to rejoin is *healing*: it has its own standing in ``status()["healing"]``
while the refits go on without it. Where its bits come from, in order of preference:

1. **The deltas it missed**, when it holds an older committed version (evicted as hung, then answering
   again): its cluster keeps the committed payloads of the last versions (the catch-up window,
   :mod:`~dcr_ray.relay.window`), and it replays them (:mod:`~dcr_ray.actors.engine.catchup`), every
   frame validated before any write. The bytes are the missed deltas, already inside the cluster;
   where they outweigh the model (large learning rates, many versions), the peer's dense copy is
   taken instead.
2. **A peer of its cluster** (:mod:`~dcr_ray.actors.engine.peer_copy`): a required engine that holds the
   committed version settled hands its canonical tensors over through the Ray object store; the copy
   stays inside the cluster and is checked tensor by tensor against the peer's digests before the
   healing engine holds the version. No byte crosses the cluster link; the owners do no work.
3. **A peer of another cluster**, when the whole cluster was lost: the copy crosses a cluster link
   once, as the owners' dense send would, but the trainer's owners do no work and the refits do not
   wait for it; the cluster's other healing engines then copy from that one.
4. **The owners**, only when no engine anywhere can hand the version over (a single cluster lost
   whole, or a healing adopted engine, whose bits are not addressable): a dense bootstrap through the
   transport, once per cluster.

An engine whose cluster has no room for it on a live node (its region is gone, or the nodes that
joined hold fewer of its engines than it has) *waits for capacity*: it is not re-created (Ray would hold
it pending, and a wait for it would sit on someone's path), its row says ``waiting for capacity`` and
since when, and the worker looks again every :data:`CAPACITY_POLL_S`; once a node with room joins, the
cluster's relays are created anew (:meth:`~dcr_ray.actors.recovery.outages.Outages.begin_regain`) and the
engine heals as above, from a peer of another cluster first.

**The coordinator's lock guards decisions, not transfers.** A heal takes it only to read the committed
version and the peers, to take what the transport created into service, and to join: never across a
copy, a snapshot, a catch-up, an actor's creation or start (those run without it, each bounded and
watching for a lost node). A healing engine joins the required set under the lock, and only if the
version it took is still the committed one; if a refit committed meanwhile, its next round starts from
what it took (the deltas since, from its cluster's window): a bounded number of rounds, then it stays
out, says why, and is queued again after the next commit. The owners' dense send, the last resort when
no engine anywhere holds the version, still runs under the lock (the owners must not promote while they
send). A part of :class:`~dcr_ray.actors.coordinator.actor.CoordinatorActor` with its own state (the
healing table and one worker thread); it is handed the coordinator's shared state
(:class:`~dcr_ray.actors.fleet.state.CoordinatorState`: lock, topology, record, required set) and
the dense bootstrap (:class:`~dcr_ray.actors.recovery.bootstrap.Bootstrap`), its last resort.
"""

from __future__ import annotations

import logging
import threading
import time

import ray
from ray.exceptions import RayActorError

from dcr_ray import metrics
from dcr_ray.actors.fleet.standings import Standing
from dcr_ray.actors.fleet.state import CoordinatorState
from dcr_ray.actors.recovery import sources, waits
from dcr_ray.actors.recovery.bootstrap import Bootstrap
from dcr_ray.actors.recovery.outages import Outages
from dcr_ray.errors import RefitError
from dcr_ray.failpoints import failpoint

log = logging.getLogger("dcr_ray")

#: Failed rounds (its peers kept failing, it kept dying) after which a heal gives up, until the next commit.
MAX_ROUNDS = 5
#: Rounds refits overtook a heal may take (each replays the steps committed meanwhile: usually it lands).
STALE_ROUNDS = 20
HEALED_KEPT = 20  #: completed heals ``status()`` lists
#: What a heal's record adds up over its rounds (bytes each source moved; ``steps``: versions replayed).
TOOK = ("owner_bytes", "copy_bytes", "cross_bytes", "delta_bytes", "steps", "lock_seconds", "lock_longest_seconds")
#: Pause before another round when a peer was busy (inside a transfer) or a copy went stale.
RETRY_PAUSE_S = 0.5
#: How often engines waiting for capacity, and a re-created engine still starting, are looked at again.
CAPACITY_POLL_S = 1.0


class NoCapacity(Exception):
    """No live node can host the engine's cluster: it waits (see the module doc)."""


class _TimedLock:
    """A lock whose every hold reports its seconds to ``add`` (used one hold at a time)."""

    def __init__(self, lock, add):
        self.lock, self.add, self._t = lock, add, 0.0

    def __enter__(self):
        self.lock.acquire()
        self._t = time.perf_counter()

    def __exit__(self, *exc):
        try:
            self.add(time.perf_counter() - self._t)
        finally:
            self.lock.release()


def _record(e: str, reason: str | None, respawn: bool) -> dict:
    """A healing engine's row: why it heals, and what it took so far (``sources`` in order); its
    ``standing`` in ``status()`` is its standing (:mod:`~dcr_ray.actors.fleet.standings`)."""
    return {"engine": e, "reason": reason, "respawn": respawn, "source": None,
            "since": time.time(), "waiting_since": None, "rounds": 0, "error": None, "sources": [],
            "start_seconds": None, "created_at": None, **dict.fromkeys(TOOK, 0)}


def _standing_name(standing: Standing | None) -> str:
    return standing.value if standing is not None else "unknown"


class Healing:
    """The coordinator's healing table and worker: :meth:`schedule`, :meth:`heal_now`, :meth:`status`."""

    def __init__(self, state: CoordinatorState, bootstrap: Bootstrap, outages: Outages):
        self._shared = state
        self._bootstrap = bootstrap
        self._outages = outages
        self._table: dict[str, dict] = {}  # engine id -> its healing record (what status() shows)
        self._guard = threading.Lock()  # guards the table and the worker's start
        self._creating = threading.Lock()  # one re-creation at a time (the worker, Refit.rejoin)
        self._worker: threading.Thread | None = None
        self.healed: list[dict] = []  # the last HEALED_KEPT completed heals, oldest first
        metrics.record("healing_engines", 0)

    # -- what the coordinator calls ----------------------------------------------------------------
    def schedule(self, engine_ids, reason: str, *, respawn: bool) -> None:
        """Heal ``engine_ids`` in the background (re-created first with ``respawn``: their actors died);
        they stand ``queued`` until the worker takes them (an engine already healing keeps its place)."""
        standings = self._shared.standings
        with self._guard:
            for e in engine_ids:
                rec = self._table.get(e)
                if rec is not None and standings.of(e) is not Standing.FAILED:
                    rec["respawn"] = rec["respawn"] or respawn
                    continue
                standings.heal([e])
                self._table[e] = _record(e, reason, respawn)
            metrics.record("healing_engines", len(self._table))
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._run, name="dcr-healing", daemon=True)
                self._worker.start()

    def keep(self, step) -> None:
        """After a commit: the transport keeps ``step``'s payloads in its clusters' catch-up windows (and
        releases the rest of the transfer). Statistics-like: a failure here is logged, never fails the
        committed refit (the engines it would have served heal from a peer instead)."""
        s = self._shared
        try:
            s.transport.keep(step)
        except Exception as err:
            log.warning("dcr_ray: keeping %s in the catch-up window failed: %r", step.transfer, err)
            try:
                s.transport.release(step.transfer)
            except Exception as err2:
                log.warning("dcr_ray: releasing the payloads of %s failed: %r", step.transfer, err2)

    def heal_now(self, engine_id: str, reason: str, *, respawn: bool) -> dict:
        """Heal one engine in the caller's thread (``Refit.rejoin``); raises what made it fail."""
        with self._guard:
            self._shared.standings.heal([engine_id])
            self._table[engine_id] = _record(engine_id, reason, respawn)
        try:
            return self._heal(engine_id)
        except NoCapacity as err:
            self.schedule([], "waiting for capacity", respawn=False)  # the worker watches for capacity
            raise RefitError(f"engine {engine_id}: no live node can host cluster {err}; it waits for capacity and "
                             f"heals when a node with the cluster's resources joins (Refit.status()['healing'])"
                             ) from None

    def status(self) -> dict:
        """``{"healing": {engine id: {"standing", "reason", "source", "since", "rounds", "error", ...}},
        "healed": [...]}``: every engine healing now or whose healing failed (``standing``: one
        of :data:`~dcr_ray.actors.fleet.standings.HEALING` or ``joining``; ``failed``: ``Refit.rejoin`` retries
        it), and the last completed heals. ``sources`` lists where each round's
        bits came from (a peer's id, ``window`` or ``owners``; a later round starts from what an earlier
        one landed when a refit committed meanwhile), ``source`` the last one (``held``: none was
        needed); ``owner_bytes``: what the owners sent for it; ``copy_bytes``: what peers handed over
        (``cross_bytes``: the part a peer of another cluster handed over, across a cluster link);
        ``delta_bytes`` / ``steps``: the missed deltas replayed from the catch-up window;
        ``lock_seconds``: how long it held the coordinator's lock in all (refits wait only for that),
        ``lock_longest_seconds``: its longest single hold."""
        standings = self._shared.standings
        with self._guard:
            return {"healing": {e: {"standing": _standing_name(standings.of(e)),
                                    **{k: v for k, v in r.items() if k not in ("respawn", "created_at")}}
                                for e, r in self._table.items()},
                    "healed": list(self.healed)}

    # -- the work ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._guard:
                todo = sorted(e for e in self._table if self._shared.standings.of(e) is Standing.QUEUED)
                waiting = sorted(e for e in self._table if self._shared.standings.of(e) is Standing.WAITING)
                if not todo and not waiting:
                    self._worker = None
                    return
            try:
                for e in self._shared.topology.placeable(waiting):  # capacity came back: heal it now
                    self._set(e, Standing.QUEUED)
                    todo.append(e)
                self._recreate([e for e in todo if self._table[e]["respawn"]])
            except Exception as err:  # the worker outlives any one failure: each engine's heal tries again
                log.warning("dcr_ray: re-creating engines %s failed: %r", todo, err)
            for e in todo:
                try:
                    self._heal(e)
                except NoCapacity:
                    pass  # it waits: looked at again below
                except Exception as err:  # recorded; queued again after the next commit (or Refit.rejoin)
                    log.warning("dcr_ray: healing engine %s failed: %r", e, err)
            if not todo:
                time.sleep(CAPACITY_POLL_S)

    def _set(self, e: str, standing: Standing | None = None, **kw) -> None:
        """``e`` moves to ``standing`` (its phase), and its row takes ``kw``."""
        with self._guard:
            if standing is not None:
                self._shared.standings.move([e], standing)
            self._table[e].update(kw)

    def _heal(self, e: str) -> dict:
        t0 = time.perf_counter()
        try:
            self._start(e)
            out = self._rounds(e)
        except NoCapacity:
            with self._guard:
                if self._shared.standings.of(e) is not Standing.WAITING:
                    self._shared.standings.move([e], Standing.WAITING)
                    self._table[e].update(waiting_since=time.time(), respawn=True)
            raise
        except Exception as err:
            self._set(e, Standing.FAILED, error=f"{type(err).__name__}: {err}")
            raise
        secs = time.perf_counter() - t0
        with self._guard:
            rec = self._table.pop(e, None) or _record(e, None, False)
            out = {**out, "source": (rec["sources"] or ["held"])[-1], "sources": rec["sources"],
                   **{k: rec[k] for k in TOOK}, "reason": rec["reason"], "seconds": secs, "at": time.time(),
                   "start_seconds": rec["start_seconds"]}
            self.healed = [*self.healed, out][-HEALED_KEPT:]
            metrics.record("healing_engines", len(self._table))
        metrics.record("heal_seconds", secs)
        log.info("dcr_ray: engine %s healed to version %d from %s in %.1f s", e, out["version"],
                 " then ".join(out["sources"]) or "what it held", secs)
        return out

    def _holding(self, engines: list[str], lock) -> "_TimedLock":
        """``lock`` (the coordinator's) for the heal of ``engines``: each hold's seconds add to each one's
        ``lock_seconds`` (how long its heal kept refits waiting, whatever else loads the machine)."""
        def add(seconds: float) -> None:
            with self._guard:
                for e in engines:
                    if e in self._table:
                        self._table[e]["lock_seconds"] += seconds
                        self._table[e]["lock_longest_seconds"] = max(self._table[e]["lock_longest_seconds"], seconds)
        return _TimedLock(lock, add)

    def _took(self, e: str, source: str, **nbytes: int) -> None:
        """Record that ``e`` took bits from ``source`` (``owner_bytes``, ``copy_bytes``, ``delta_bytes``,
        ``steps``), whether or not that round's version is still the committed one when it lands."""
        with self._guard:
            rec = self._table[e]
            rec["sources"] = [*rec["sources"], source]
            for k, n in nbytes.items():
                rec[k] += n

    def _recreate(self, engine_ids: list[str]) -> None:
        """Re-create the engines in ``engine_ids`` the live nodes have room for, all at once (a lost node's
        engines start side by side, not one heal after another); the others wait for capacity in their
        heal. Each then heals in turn (:meth:`_start` waits for it to answer). Under the coordinator's lock
        only the creation calls and the decision; the new relays' start is waited for without it."""
        s = self._shared
        topo = s.topology
        ready = s.topology.placeable(engine_ids)
        for e in ready:
            self._set(e, Standing.RECREATING)
            topo.retire(e, s.config)  # its name is released before the lock is taken
        clusters = sorted({topo.engine_cluster[e] for e in ready})
        waiting = self._outages.waiting
        hosted = [c for c in clusters if c not in waiting or self._outages.can_host(c)]
        made = [e for e in ready if topo.engine_cluster[e] in hosted]
        # created and routed without the coordinator's lock (each creation is a round trip to Ray's GCS): no
        # refit calls these engines, nor a waiting cluster; relays serve once install() took them, under it
        with self._creating:
            for e in made:  # first: a regained cluster's new relays are routed to the new engines
                failpoint("coordinator.heal.recreate")
                topo.respawn(e, s.config)
            regaining = [c for c in hosted if c in waiting and self._outages.begin_regain(c, hostable=True)]
        if not made:
            return
        topo.transport.settle(s.config.commit.timeout_s)  # the new relays start
        with self._holding(made, s.lock):
            failed = topo.transport.install()
            for c in regaining:
                self._outages.end_regain(c, failed)
            topo.locate()
        for e in made:
            if topo.engine_cluster[e] in failed:  # its relays did not start: it waits, and tries again
                self._set(e, respawn=True)
            else:
                self._set(e, Standing.STARTING, respawn=False, created_at=time.perf_counter())

    def _start(self, e: str) -> None:
        """Re-create ``e`` if its actor died (now or while it starts), and wait until its backend loaded
        (the model is built): no lock is held and nothing is copied meanwhile. Raises :class:`NoCapacity`
        when the live nodes have no room for it (before it is re-created, or while it waits to start)."""
        s = self._shared
        cluster = s.topology.engine_cluster[e]
        for _ in range(MAX_ROUNDS):
            if self._table[e]["respawn"]:
                if not s.topology.placeable([e]):
                    raise NoCapacity(cluster)
                self._recreate([e])
                if self._table[e]["respawn"]:  # its cluster lost its capacity meanwhile
                    raise NoCapacity(cluster)
            self._set(e, Standing.STARTING)
            try:
                try:
                    waits.started(s, e, cluster)
                except waits.Unplaceable:  # killed: it waits for capacity
                    self._set(e, respawn=True)
                    raise NoCapacity(cluster) from None
                created = self._table[e].get("created_at")
                if created is not None:  # re-created to ready to heal: its process, imports and backend
                    self._set(e, start_seconds=time.perf_counter() - created, created_at=None)
                return
            except RayActorError:
                self._set(e, respawn=True)
        raise RuntimeError(f"engine {e} died {MAX_ROUNDS} times while it was re-created")

    def retry_failed(self) -> list[str]:
        """Queue again every engine whose healing failed (the coordinator calls it after each commit);
        returns their ids."""
        with self._guard:
            failed = sorted(e for e in self._table if self._shared.standings.of(e) is Standing.FAILED)
            for e in failed:
                self._shared.standings.heal([e])
                self._table[e].update(error=None, rounds=0)
        if failed:
            self.schedule([], "retry", respawn=False)  # starts the worker for them
        return failed

    def _rounds(self, e: str) -> dict:
        """Copies (or catch-ups) until one is still the committed version when it lands. The copies run
        beside the refits, never under the coordinator's lock; a round that lands on a version a refit
        replaced meanwhile is followed by one from there."""
        last: Exception | None = None
        failed = stale = 0
        while failed < MAX_ROUNDS and stale < STALE_ROUNDS:
            self._set(e, rounds=failed + stale + 1)
            if self._table[e]["respawn"]:  # it died in an earlier round: a new incarnation first
                self._start(e)
            out = self._round(e)
            if isinstance(out, dict):
                return out
            if out is None:  # a refit committed meanwhile: the next round replays the steps since
                stale += 1
                continue
            last, failed = out, failed + 1
            time.sleep(RETRY_PAUSE_S)  # a failure, not a stale copy: let the cluster settle first
        raise RuntimeError(f"engine {e} did not catch up with the committed version in {failed + stale} rounds "
                           f"({stale} overtaken by refits; last error: {last!r}); it heals again after the next "
                           f"commit, or Refit.rejoin({e!r})")

    def _round(self, e: str):
        """One round: the result dict once ``e`` joined, None when what it took is no longer the committed
        version, or the error that failed it. The lock is taken to read the committed version and to join,
        and for the owners' dense send (the last resort); every remote call without it is bounded by the
        stage timeout (a copy's wait watches both engines' nodes)."""
        failpoint("coordinator.heal.round")
        s = self._shared
        t = s.config.commit.timeout_s
        try:
            held, now = sources.held(s, e, t)
        except RayActorError as err:  # the healing engine died: re-created in the next round
            self._set(e, respawn=True)
            return err
        except Exception as err:  # e.g. it hangs: another round
            return err
        with self._holding([e], s.lock):
            version, version_id = s.version, s.last_transfer()
            if held == (version, version_id):  # it missed nothing (or took it in an earlier round)
                return self._join(e, version, now)
            peer = sources.peer_for(s, e)
        steps = sources.window_steps(s, e, held, (version, version_id))  # asks the head relay: no lock
        peer = peer if not steps or sources.dense_is_smaller(s, e, steps) else None
        if steps and peer is not None and not sources.same_cluster(s, e, peer):
            peer = None  # deltas inside the cluster beat a dense copy across the link
        steps = None if peer is not None else steps
        if not steps and (peer is None or s.topology.is_adopted(e)):  # no delta, no peer can hand it over
            try:  # (or it cannot take a copy: an adopted engine's bits are not addressable)
                return self._from_owners(e)
            except Exception as err:  # an owner that stalled past the stage timeout, a lost node: another round
                return err
        snap = None
        if not steps:  # the peer hands over only the committed version read above, settled (else it refuses)
            try:
                snap = ray.get(s.engines[peer].snapshot.remote(version, version_id, epoch=s.incarnation(peer)),
                               timeout=t)
            except Exception as err:  # the peer died, is inside a refit, or moved on: another round
                return err
        try:
            if steps:
                self._set(e, Standing.CATCHING_UP, source="window")
                got = waits.landed(s, e, None, s.engines[e].catch_up.remote(steps, t, epoch=s.incarnation(e)))
                self._took(e, "window", delta_bytes=got["bytes"], steps=got["steps"])
            else:
                self._set(e, Standing.COPYING, source=peer)
                waits.landed(s, e, peer, s.engines[e].heal_from.remote(snap, s.config.commit.start_timeout_s,
                                                                       epoch=s.incarnation(e)))
                cross = 0 if sources.same_cluster(s, e, peer) else snap["bytes"]
                self._took(e, peer, copy_bytes=snap["bytes"], cross_bytes=cross)
            took = ray.get(s.engines[e].state.remote(), timeout=t)
        except RayActorError as err:  # the healing engine died: re-created for the next round
            self._set(e, respawn=True)
            return err
        except Exception as err:  # e.g. a step that did not fit, a lost node
            return err
        with self._holding([e], s.lock):
            if (s.version, s.last_transfer()) != (version, version_id) or took.get("version") != version:
                return None  # a refit committed while it copied: the next round starts from there
            return self._join(e, version, took)

    def _from_owners(self, e: str):
        """The last resort: the owners send the committed version densely (under the coordinator's lock)."""
        s = self._shared
        with self._holding([e], s.lock):
            self._set(e, Standing.JOINING, source="owners")
            version = s.version
            # joins the required set (an adopted engine by digest if it can); the lock is held one stage at most
            sent = self._bootstrap.dense([e], timeout_s=s.config.commit.timeout_s)
        self._took(e, "owners" if sent else "digest", owner_bytes=sent)
        return {"engine": e, "version": version}

    def _join(self, e: str, version: int, state: dict):
        """``e`` holds the committed ``version``: it joins the required set (under the coordinator's lock),
        if the incarnation that answered (``state``, asked before the lock was taken) is the one the
        coordinator holds: an older one, replaced meanwhile, is fenced off (None: another round)."""
        failpoint("coordinator.heal.join")
        s = self._shared
        if state.get("epoch") != s.incarnation(e):
            return None
        s.standings.require([e])
        metrics.record("required_engines", len(s.required))
        return {"engine": e, "version": version}
