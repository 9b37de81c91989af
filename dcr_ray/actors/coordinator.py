"""The commit coordinator: the named actor that drives every refit (the state machine, nothing else).

It holds a :class:`~dcr_ray.actors.topology.Topology` (engines, owners, the transport) and the durable
commit record, and decides: which engines are required, which attempt runs, when to retry, commit or
give up.

One refit (version v -> v+1), attempt ``a`` (``a = 0`` sends mixed XOR/OVERWRITE frames, every retry
sends OVERWRITE frames of the same pending changed set, which repairs any partial XOR)::

    prepare   every required engine confirms it holds v and opens (transfer, a)
    stream    every owner diffs, keeps the changed set pending, and streams frames to the transport
              (relay heads or object storage) while still diffing; returns its payload keys
    flush     every required engine ACKs having applied *all* payload keys (then flushes its backend)
    commit    compare-and-set of the durable record v -> v+1 (members = the engines that ACKed)
    promote   owners fold pending into their baselines; engines activate v+1; relays drop copies

Any failure before the record is durable (an actor's error, a timeout, a commit record that cannot
be written) leaves the committed state as it was and starts the next attempt; an engine whose actor
died leaves the required set. After ``max_attempts`` the owners discard their pending sets, engines
that an abandoned attempt wrote into roll back in place (or, where they cannot, are re-bootstrapped
densely or leave the required set), and ``refit`` raises ``RefitError``. Every wait has a timeout
(``CommitConfig.timeout_s``).

Failures of single actors are repaired, not fatal: a failed attempt first re-creates relays that died
(the cluster's tree is re-planned) before the next attempt; engines that died during a refit are
re-created after it commits and heal in the background from a peer of their cluster
(:mod:`~dcr_ray.actors.healing`), so the fleet returns to its configured size without the owners; an
owner that died fails the refit cleanly (engines roll back in place) until ``replace_owner``.

The coordinator itself is restartable: engines, relays and owners do not share its fate, and a new
incarnation (Ray restarting the actor, or ``launch(..., resume=True)``) resumes from the durable record
(:meth:`CoordinatorActor._resume`): it fences older incarnations, finds the live actors by name,
settles the open transition (roll forward when the record holds its target, else roll back) and
carries on at the committed version.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from dcr_ray import metrics
from dcr_ray.actors.calls import ActorsDied, gather, get_all
from dcr_ray.actors.coding_choice import choose_coding
from dcr_ray.actors.commit import CommitLog, CommitRecord
from dcr_ray.actors.coverage import check_coverage
from dcr_ray.actors.cpu_clock import CpuClock
from dcr_ray.actors.owner import BOOTSTRAP_BASE
from dcr_ray.actors.healing import Healing
from dcr_ray.actors.inspection import Inspection
from dcr_ray.actors.recovery import Recovery
from dcr_ray.actors.topology import Topology
from dcr_ray.codec.bits import dtype_of, itemsize
from dcr_ray.config import ClusterSpec, RefitConfig
from dcr_ray.errors import BaselineError, CommitConflictError, ConfigError, DcrError, RefitError
from dcr_ray.relay.transport import Transport, make_transport
from dcr_ray.relay.window import CommittedStep
from dcr_ray.report import RefitReport

log = logging.getLogger("dcr_ray")


class CoordinatorActor(Recovery, Inspection):
    def __init__(self, config: RefitConfig, clusters: list[ClusterSpec], backend_factory,
                 owners: dict[str, object], transport: Transport | None = None):
        self.config = config
        self.topology = Topology(clusters, owners, transport or make_transport(config))
        self.backend_factory = backend_factory
        self.required: set[str] = set()
        self.commits = CommitLog(config.commit.dir)
        self.version = 0
        self._lock = threading.Lock()
        self._started = False
        self.history: list[dict] = []
        self.epoch = 0
        self._owner_specs: dict[str, dict] = {}
        self.evicted: set[str] = set()  # engines that stopped answering (hung); readmitted when they answer
        self._probes: dict[str, ray.ObjectRef] = {}  # evicted engine -> its pending readmission probe
        self.phase = {"phase": "idle", "transfer": None, "attempt": None, "target": None, "since": time.time()}
        self._model_bytes = 0  # canonical bytes of one engine's tensors (known after attach)
        self._progress_total: int | None = None  # bytes the phase in flight delivers, when known
        self._resume_error: Exception | None = None
        self.healer = Healing(self)  # engines outside the required set, healed in the background
        if ray.get_runtime_context().was_current_actor_reconstructed:
            try:
                self.start(resume=True)  # Ray restarted this actor: carry on from the record
            except Exception as e:  # kept for refit() to report; raising here would restart us in a loop
                self._resume_error = e
                log.error("dcr_ray: the restarted coordinator could not resume: %r", e)

    def __repr__(self) -> str:  # shown by Ray (dashboard, logs, errors)
        try:
            return (f"CoordinatorActor(v{self.version}, epoch {self.epoch}, {self.phase['phase']}, "
                    f"{len(self.required)}/{len(self.topology.engines)} engines required)")
        except AttributeError:  # not constructed yet
            return "CoordinatorActor(starting)"

    @property
    def engines(self) -> dict[str, object]:
        return self.topology.engines

    @property
    def owners(self) -> dict[str, object]:
        return self.topology.owners

    @property
    def transport(self) -> Transport:
        return self.topology.transport

    # -- start-up ---------------------------------------------------------------------------------
    def start(self, resume: bool = False) -> dict:
        """Create engines and the transport, attach owners, write record v0, bootstrap every engine; with
        ``resume``, carry on from the commit record of an earlier coordinator instead."""
        try:
            return self._start(resume)
        finally:
            self._phase("idle")

    def _start(self, resume: bool) -> dict:
        with self._lock:
            if self._started:
                return self.status()
            if resume:
                self._resume()
                self._started = True
                return self.status()
            cfg = self.config
            rec = self.commits.read()
            if rec is not None and rec.version != 0:  # checked before anything is spawned
                raise ConfigError(
                    f"the commit record in {cfg.commit.dir} already holds version {rec.version}; owners start "
                    f"at version 0: use a fresh CommitConfig.dir, or launch(..., resume=True) to carry on "
                    f"with the running topology"
                )
            self._phase("start engines")
            self.topology.start(self.backend_factory, cfg)
            t = cfg.commit.start_timeout_s
            self._phase("attach")
            specs = get_all({o: h.dcr_attach.remote(o, cfg) for o, h in self.owners.items()}, t, "attach")
            engine_specs = self.topology.engine_specs(t)
            check_coverage(specs, engine_specs)
            self._model_bytes = sum(math.prod(shape) * itemsize(dtype_of(dt)) for dt, shape in engine_specs.values())
            self._owner_specs = specs
            self._save_owners()  # a restarted coordinator checks replacements against these specs
            if rec is None:
                self.commits.compare_and_set(None, CommitRecord(version=0, transfer="attach", baseline="",
                                                                members=sorted(self.engines)))
            self.version = 0
            self._bootstrap(list(self.engines))
            self._started = True
            return self.status()

    def _bootstrap(self, engine_ids: list[str]) -> int:
        """Dense refit of ``engine_ids`` to the committed version (joining engines); adopted engines that
        show by digest that they already serve it join as they are (:meth:`_join_by_digest`). Returns the
        payload bytes the owners sent."""
        engine_ids = self._join_by_digest(engine_ids)
        if not engine_ids:
            return 0
        t = self.config.commit.start_timeout_s
        transfer = f"boot{self.version}-{uuid.uuid4().hex[:8]}"
        self._phase("bootstrap", transfer, 0, self.version)
        self._progress_total = self._model_bytes * len(engine_ids) if self._model_bytes else None
        try:
            get_all({e: self.engines[e].prepare.remote(transfer, 0, BOOTSTRAP_BASE, self.version)
                       for e in engine_ids}, t, "bootstrap prepare")
            sink = self.transport.sink(engine_ids, sorted(self.required))
            sums = get_all({o: h.dcr_bootstrap.remote(transfer, sink) for o, h in self.owners.items()}, t,
                             "bootstrap stream")
            keys = [k for s in sums.values() for k in s["payloads"]]
            get_all({e: self.engines[e].flush.remote(transfer, 0, keys, t) for e in engine_ids}, t,
                      "bootstrap flush")
            get_all({e: self.engines[e].activate.remote(self.version, transfer, self._last_transfer())
                     for e in engine_ids}, t,
                      "bootstrap activate")
        except BaseException:
            # engines a failed bootstrap wrote into hold no version until a later bootstrap succeeds
            for e in engine_ids:
                self.engines[e].abort.remote(transfer, True)
            self.transport.release(transfer)
            raise
        self.transport.release(transfer)
        self._progress_total = None
        self.required |= set(engine_ids)
        log.info("dcr_ray: bootstrapped %d engines densely at version %d", len(engine_ids), self.version)
        return sum(s["wire_bytes"] for s in sums.values())

    # -- one refit ----------------------------------------------------------------------------------
    def refit(self, request: str | None = None) -> RefitReport:
        """Move the owners' current tensors to every required engine as version v+1 and commit.

        ``request`` names the call (``Refit.remote()`` sends a fresh id): Ray retries the call on a
        coordinator restarted after the record was written, and the retry is answered from the record
        (:meth:`_answered`) instead of refitting a second time.
        """
        t_call = time.perf_counter()  # report.seconds["total"] counts the wait for a refit or heal in flight
        try:
            return self._answered(request) or self._refit(request or "", t_call)
        finally:
            self._phase("idle")

    def _phase(self, phase: str, transfer: str | None = None, attempt: int | None = None,
               target: int | None = None) -> None:
        """Record where the refit in flight is (``status()`` reports it while the refit runs)."""
        self.phase = {"phase": phase, "transfer": transfer, "attempt": attempt, "target": target,
                      "since": time.time()}

    def _refit(self, request: str, t_call: float) -> RefitReport:
        with self._lock:
            if not self._started:
                if self._resume_error is not None:
                    raise RefitError(f"the restarted coordinator could not resume from the commit record: "
                                     f"{self._resume_error!r}; relaunch with launch(..., resume=True)")
                raise RefitError("the coordinator was not started; use dcr_ray.launch(...)")
            t_start = t_call
            base, target = self.version, self.version + 1
            transfer = f"v{target}-{uuid.uuid4().hex[:8]}"
            last: Exception | None = None
            dropped: list[str] = []
            rejoined: list[str] = []
            self._readmit(rejoined)  # hung engines that answer again take part in this refit
            for attempt in range(self.config.commit.max_attempts):
                if not self.required:
                    last = RefitError("no required engine is alive")
                    break
                try:
                    report = self._attempt(transfer, attempt, base, target, t_start, request)
                    return self._after_commit(report, dropped, rejoined)
                except ActorsDied as d:
                    if self.version == target:
                        return self._committed_anyway(transfer, attempt, d)
                    gone = [x for x in d.ids if x in self.engines]
                    if len(gone) < len(d.ids):  # an owner died: its data is gone, cannot continue
                        last = RefitError(f"owner actor(s) died: {[x for x in d.ids if x not in gone]}")
                        break
                    self.required -= set(gone)
                    dropped += gone
                    last = RefitError(f"engines died: {gone}")
                    log.warning("dcr_ray: %s died; retrying without them", gone)
                except Exception as e:  # every exception is a failed attempt until the record is durable
                    if self.version == target:
                        return self._committed_anyway(transfer, attempt, e)
                    last = e if isinstance(e, DcrError) else RefitError(f"{type(e).__name__}: {e}")
                    log.warning("dcr_ray: attempt %d of %s failed: %r", attempt, transfer, e)
                    if isinstance(e, (BaselineError, ConfigError, CommitConflictError)):
                        break  # an owner's committed state, the setup or the record's owner: retrying cannot help
                metrics.record("refit_retries")
                self._abort(transfer)
                self._repair()
            dirty = self._abort(transfer, final=True)
            self._discard_pending()
            restored = self._restore(dirty)
            raise RefitError(
                f"refit to version {target} failed after {attempt + 1} attempt(s); the "
                f"committed version stays {base}{restored}. Last error: {type(last).__name__}: {last}"
            ) from last

    def _abort(self, transfer: str, final: bool = False) -> list[str]:
        """Close ``transfer`` on the required engines; with ``final``, the engines left dirty.

        Waits for every engine: engines serve calls concurrently, so an abort still in flight could
        otherwise close the next attempt that a later ``prepare`` just opened.
        """
        calls = {e: self.engines[e].abort.remote(transfer, final) for e in self.required}
        try:
            self.transport.release(transfer)
        except Exception as e:  # payload copies outlive the attempt; the engines must still be closed
            log.warning("dcr_ray: releasing the payloads of %s failed: %r", transfer, e)
        dirty = []
        for e, ref in calls.items():
            try:
                if ray.get(ref, timeout=self.config.commit.timeout_s)["dirty"]:
                    dirty.append(e)
            except (RayActorError, GetTimeoutError):
                pass  # a dead or hung engine is dropped by the next refit's prepare
            except Exception as err:  # its abort failed: what it holds is unknown, so it is restored densely
                log.warning("dcr_ray: engine %s could not abort %s: %r", e, transfer, err)
                if final:
                    dirty.append(e)
        return sorted(dirty)

    def _attempt(self, transfer: str, attempt: int, base: int, target: int, t_start: float,
                 request: str = "") -> RefitReport:
        t = self.config.commit.timeout_s
        req = sorted(self.required)
        base_id = self._last_transfer()  # frames are bound to the committed content, not only its number
        choice = choose_coding(self.config.codec, self.history, {self.topology.engine_cluster[e] for e in req})
        t0, clock = time.perf_counter(), CpuClock.start(self.topology, req)
        self._phase("prepare", transfer, attempt, target)
        self._engines_answer({e: self.engines[e].prepare.remote(transfer, attempt, base, target, base_id)
                              for e in req}, "prepare")
        t1 = time.perf_counter()
        # engines outside the required set (healing, evicted) get nothing; their clusters' windows keep it
        sink = self.transport.sink(req, req, every_cluster=True)
        self._phase("stream", transfer, attempt, target)
        sums = get_all({o: h.dcr_stream.remote(transfer, attempt, base, target, sink, base_id=base_id,
                                                coding=choice.coding) for o, h in self.owners.items()}, t, "stream")
        keys = [k for s in sums.values() for k in s["payloads"]]
        self._phase("flush", transfer, attempt, target)
        acks = self._engines_answer({e: self.engines[e].flush.remote(transfer, attempt, keys, t) for e in req},
                                    "flush")
        req = sorted(acks)  # without engines evicted as hung
        t2 = time.perf_counter()
        self._phase("commit", transfer, attempt, target)
        self.commits.compare_and_set(base, CommitRecord(version=target, transfer=transfer, epoch=self.epoch,
                                                        baseline=base_id, members=req, request=request))
        t_rec = time.perf_counter()
        # Committed: v+1 is durable. From here on roll forward (never retry, never abort): a failure
        # now takes the failing actor out of service and is reported, the version stays v+1.
        self.version = target
        warnings = []
        self._phase("promote", transfer, attempt, target)
        _, dead, errors = gather({o: h.dcr_promote.remote(target) for o, h in self.owners.items()},
                                       t, "promote")
        if dead or errors:
            bad = sorted({*dead, *errors})
            why = "; ".join(f"{o}: {e}" for o, e in errors.items()) or "actor died"
            warnings.append(f"owner(s) {bad} did not promote their baseline to v{target} ({why}); their "
                            f"next stream is refused until the topology is relaunched")
        t_pro = time.perf_counter()
        self._phase("activate", transfer, attempt, target)
        versions, dead, errors = gather(
            {e: self.engines[e].activate.remote(target, transfer) for e in req}, t, "activate")
        if dead or errors:
            self.required -= {*dead, *errors}
            warnings += self._heal_later(dead, "died")
            if errors:
                warnings.append(f"engine(s) {sorted(errors)} did not activate v{target} and left the required set; "
                                f"they heal in the background (Refit.status()['healing'])")
                self.healer.schedule(sorted(errors), f"did not activate v{target}", respawn=False)
        for w in warnings:
            log.warning("dcr_ray: %s", w)
        t_act = time.perf_counter()
        try:
            link = self.transport.link_bytes(transfer, acks)
        except (RayActorError, GetTimeoutError) as e:  # statistics only: the refit is committed
            link = {}
            warnings.append(f"link byte counts unavailable: {type(e).__name__}")
        self.healer.keep(CommittedStep(transfer=transfer, attempt=attempt, base=base, target=target,
                                       base_id=base_id, keys=[tuple(k) for k in keys]))
        report = RefitReport.from_stages(
            version=target, transfer=transfer, attempts=attempt + 1, sums=sums, acks=acks, link_bytes=link,
            engine_versions=versions, warnings=warnings, coding=choice,
            marks={"start": t_start, "prepare": t0, "stream": t1, "flushed": t2, "record": t_rec,
                   "promoted": t_pro, "activated": t_act, "end": time.perf_counter()}, cpu_seconds=clock.stop())
        self.history.append({**report.to_dict(), "request": request})
        metrics.record("refit_seconds", report.seconds["total"])
        metrics.record("refit_wire", report.wire_bytes)
        metrics.record("refit_changed", report.changed)
        metrics.record("version", target)
        metrics.record("required_engines", len(self.required))
        for cluster, nbytes in link.items():
            metrics.record("link_bytes", nbytes, tags={"cluster": cluster})
        return report

    def _last_transfer(self) -> str:
        rec = self.commits.read()
        return rec.transfer if rec else ""

    # -- membership & inspection ------------------------------------------------------------------
    def rejoin(self, engine_id: str) -> dict:
        """Bring an engine (new, dead, or fallen out of the required set) back at the committed version,
        now: from a peer of its cluster, else densely from the owners (see :mod:`~dcr_ray.actors.healing`)."""
        if engine_id not in self.engines:
            raise ConfigError(f"unknown engine {engine_id!r}; known: {sorted(self.engines)}")
        t = self.config.commit.timeout_s
        with self._lock:
            self.required.discard(engine_id)
            self.evicted.discard(engine_id)
            try:
                st = ray.get(self.engines[engine_id].state.remote(), timeout=t)
                dead = False
            except (RayActorError, GetTimeoutError):
                dead = True  # its actor died (or hangs): a new one takes its place
            if not dead and st["transfer"] is not None:  # close what it holds open before it takes a copy
                ray.get(self.engines[engine_id].abort.remote(st["transfer"], True), timeout=t)
        self.healer.heal_now(engine_id, "rejoin", respawn=dead)
        return self.status()

    def teardown(self) -> None:
        """Kill the engines and relays and remove the placement groups (``Refit.shutdown``)."""
        self.topology.teardown()

    def handles(self) -> dict:
        """Actor handles: ``{"engines": {id: h}, "owners": {id: h}, "relays": {id: h}}``."""
        return self.topology.handles()

    def relay_stats(self) -> list[dict]:
        return self.transport.stats()

    def reports(self) -> list[dict]:
        return list(self.history)
