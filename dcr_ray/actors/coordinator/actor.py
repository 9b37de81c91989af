"""The commit coordinator: the named actor that drives every refit (the state machine, nothing else).

It holds a :class:`~dcr_ray.actors.fleet.topology.Topology` (engines, owners, the transport) and the durable
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
(:mod:`~dcr_ray.actors.recovery.healing`), so the fleet returns to its configured size without the owners; an
owner that died fails the refit cleanly (engines roll back in place) until ``replace_owner``.

The coordinator itself is restartable: engines, relays and owners do not share its fate, and a new
incarnation (Ray restarting the actor, or ``launch(..., resume=True)``) resumes from the durable record
(:meth:`~dcr_ray.actors.recovery.restarts.Recovery.resume`): it fences older incarnations, finds the live actors
by name, settles the open transition (roll forward when the record holds its target, else roll back)
and carries on at the committed version.

The actor is composed of parts, each handed in its constructor exactly what it uses: the shared state
(:class:`~dcr_ray.actors.fleet.state.CoordinatorState`: config, topology, record, lock, committed
version, required set, history, phase), the dense bootstrap (:mod:`~dcr_ray.actors.recovery.bootstrap`), healing
(:mod:`~dcr_ray.actors.recovery.healing`), membership (:mod:`~dcr_ray.actors.coordinator.membership`: eviction,
readmission, rejoin, invalidate), recovery (:mod:`~dcr_ray.actors.recovery.restarts`) and inspection
(:mod:`~dcr_ray.actors.coordinator.inspection`). The actor's own methods are the refit state machine and the
Ray-facing calls, which delegate.
"""

from __future__ import annotations

import logging
import time
import uuid

from ray.exceptions import GetTimeoutError, RayActorError

from dcr_ray import metrics
from dcr_ray.actors.coordinator.coding import choose_coding
from dcr_ray.actors.coordinator.cpu_clock import CpuClock
from dcr_ray.actors.coordinator.inspection import Inspection
from dcr_ray.actors.coordinator.membership import Membership
from dcr_ray.actors.coordinator.startup import Startup
from dcr_ray.actors.fleet.calls import ActorsDied, NoAnswerError, gather, get_all
from dcr_ray.actors.fleet.commit import CommitLog, CommitRecord
from dcr_ray.actors.fleet.inputs import is_restart, read_inputs
from dcr_ray.actors.fleet.state import CoordinatorState
from dcr_ray.actors.fleet.topology import Topology
from dcr_ray.actors.recovery.bootstrap import Bootstrap
from dcr_ray.actors.recovery.healing import Healing
from dcr_ray.actors.recovery.outages import Outages
from dcr_ray.actors.recovery.restarts import Recovery
from dcr_ray.config import RefitConfig
from dcr_ray.errors import BaselineError, CommitConflictError, ConfigError, DcrError, OwnerLostError, RefitError
from dcr_ray.failpoints import failpoint, remote as failpoints_remote
from dcr_ray.relay.transport import make_transport
from dcr_ray.relay.window import CommittedStep
from dcr_ray.report import RefitReport

log = logging.getLogger("dcr_ray")


class _Abandoned(Exception):
    """No attempt of a refit committed: ``last`` is why, after ``attempts`` attempts; ``owners_lost``: an
    owner (and its committed bits) is gone, so no engine can be restored from the owners."""

    def __init__(self, last: Exception | None, attempts: int, owners_lost: bool):
        super().__init__(repr(last))
        self.last, self.attempts, self.owners_lost = last, attempts, owners_lost


class CoordinatorActor:
    """The refit state machine (see the module docstring). Built from the commit directory alone: its
    inputs are read from there (:mod:`~dcr_ray.actors.fleet.inputs`), so a restart by Ray needs
    nothing from the object store."""

    def __init__(self, commit_dir: str):
        failpoints_remote.started()  # a plan left for this incarnation (failure drills only)
        inputs = read_inputs(commit_dir)
        config = inputs.config
        s = self._shared = CoordinatorState(config=config, commits=CommitLog(config.commit.dir),
                                       topology=Topology(inputs.clusters, inputs.owners,
                                                         inputs.transport or make_transport(config)),
                                       backend_factory=inputs.backend_factory)
        self._boot = Bootstrap(s)
        self._outages = Outages(s)  # lost nodes and lost capacity, swept before each attempt
        # engines outside the required set, healed in the background
        self._healer = Healing(s, self._boot, self._outages)
        self._members = Membership(s, self._boot, self._healer)
        self._recovery = Recovery(s, self._healer, self._outages)
        self._inspection = Inspection(s, self._healer, self._outages)
        self._startup = Startup(s, self._boot, self._recovery)
        if is_restart(commit_dir, inputs.launch_id):
            self._startup.restarted()  # Ray restarted this actor: carry on from the record

    def __repr__(self) -> str:  # shown by Ray (dashboard, logs, errors)
        try:
            s = self._shared
            return (f"CoordinatorActor(v{s.version}, epoch {s.epoch}, {s.phase['phase']}, "
                    f"{len(s.required)}/{len(s.engines)} engines required)")
        except AttributeError:  # not constructed yet
            return "CoordinatorActor(starting)"

    # The settings, the engines and the required set, for code run inside this actor (``__ray_call__``).
    @property
    def config(self) -> RefitConfig:
        return self._shared.config

    @config.setter
    def config(self, config: RefitConfig) -> None:  # every part reads the shared state's at its next use
        self._shared.config = config

    @property
    def engines(self) -> dict[str, object]:
        return self._shared.engines

    @property
    def required(self) -> set[str]:
        return self._shared.required

    # -- start-up ---------------------------------------------------------------------------------
    def start(self, resume: bool = False) -> dict:
        """Create engines and the transport, attach owners, write record v0, bootstrap every engine; with
        ``resume``, carry on from the commit record of an earlier coordinator instead."""
        try:
            self._startup.start(resume)
            return self.status()
        finally:
            self._shared.set_phase("idle")

    def bootstrap_dense(self, engine_ids: list[str] | None = None) -> int:
        """A dense bootstrap of ``engine_ids`` (default: every engine) to the committed version, between
        refits, through the path a joining engine takes: the owners send every element (the dense
        reference ``dcr-ray bench refit`` measures, or an operator's repair of engines whose bits are in
        doubt); returns the frames sent. See
        :meth:`~dcr_ray.actors.coordinator.membership.Membership.bootstrap_dense`."""
        s = self._shared
        with s.lock:
            self._startup.require_started()
            return self._members.bootstrap_dense(sorted(engine_ids if engine_ids is not None else s.engines))

    # -- one refit ----------------------------------------------------------------------------------
    def refit(self, request: str | None = None) -> RefitReport:
        """Move the owners' current tensors to every required engine as version v+1 and commit.

        ``request`` names the call (``Refit.remote()`` sends a fresh id): Ray retries the call on a
        coordinator restarted after the record was written, and the retry is answered from the record
        (:meth:`~dcr_ray.actors.recovery.restarts.Recovery.answered`) instead of refitting a second time.
        """
        t_call = time.perf_counter()  # report.seconds["total"] counts the wait for a refit or heal in flight
        try:
            return self._recovery.answered(request) or self._refit(request or "", t_call)
        except DcrError:
            raise
        except Exception as err:  # a failure no step turned into a DcrError: the final abort has run
            raise RefitError(f"the refit failed: {type(err).__name__}: {str(err)[:400]}; the committed version is "
                             f"{self._shared.version} (Refit.status() shows it); Refit.run() tries again") from err
        finally:
            self._shared.set_phase("idle")

    def _refit(self, request: str, t_call: float) -> RefitReport:
        s = self._shared
        with s.lock:
            self._startup.require_started()
            failpoint("coordinator.refit")
            base, target = s.version, s.version + 1
            transfer = f"v{target}-{uuid.uuid4().hex[:8]}"
            notes: list[str] = []  # the report's warnings about who joined or left before the commit
            self._sweep(notes)  # lost nodes and lost capacity leave before anyone is called (nothing written yet)
            self._members.readmit(notes)  # hung engines that answer again take part in this refit
            left = set(s.engines) - set(s.required)  # not in this refit from the start
            try:
                return self._attempts(transfer, base, target, t_call, request, notes)
            except _Abandoned as a:
                last, attempts, owners_lost = a.last, a.attempts, a.owners_lost
            except Exception as e:  # anything that escaped the attempts (a dead actor, a setting): the same end
                if s.version == target:
                    return self._recovery.committed_anyway(transfer, 0, e)
                last, attempts, owners_lost = (e if isinstance(e, DcrError) else RefitError(f"{type(e).__name__}: {e}"),
                                               None, False)
                log.warning("dcr_ray: refit to version %d failed outside its attempts: %r", target, e)
            # every engine this refit may have written into is closed: the required ones, and those that left
            # it on the way (lost, waiting for capacity, evicted) where they still answer
            dirty = self._abort(transfer, final=True, also=sorted(set(s.engines) - set(s.required) - left))
            self._discard_pending()
            failpoint("coordinator.restore")
            restored = self._members.restore(dirty, owners=not owners_lost)
            tries = f" after {attempts} attempt(s)" if attempts else ""
            raise RefitError(
                f"refit to version {target} failed{tries}; the committed version stays {base}{restored}. "
                f"Last error: {type(last).__name__}: {last}"
            ) from last

    def _attempts(self, transfer: str, base: int, target: int, t_start: float, request: str,
                  notes: list[str]) -> RefitReport:
        """The attempts of one refit; the committed report, or :class:`_Abandoned` when none commits."""
        s = self._shared
        last: Exception | None = None
        dropped: list[str] = []
        for attempt in range(s.config.commit.max_attempts):
            if not s.required:
                raise _Abandoned(RefitError("no required engine is alive"), attempt, False)
            try:
                report = self._attempt(transfer, attempt, base, target, t_start, request)
                return self._members.after_commit(report, dropped, notes)
            except ActorsDied as d:
                if s.version == target:
                    return self._recovery.committed_anyway(transfer, attempt, d)
                gone = [x for x in d.ids if x in s.engines]
                if len(gone) < len(d.ids):  # an owner died: its data is gone, cannot continue
                    raise _Abandoned(OwnerLostError(
                        f"owner actor(s) {sorted(x for x in d.ids if x not in gone)} died, and their committed bits "
                        f"with them: replace each with Refit.replace_owner(owner_id, handle), an actor that holds "
                        f"the committed version's bits"), attempt + 1, True) from None
                s.standings.heal(gone)  # re-created and healed after the commit (after_commit)
                dropped += gone
                last = RefitError(f"engines died: {gone}")
                log.warning("dcr_ray: %s died; retrying without them", gone)
            except Exception as e:  # every exception is a failed attempt until the record is durable
                if s.version == target:
                    return self._recovery.committed_anyway(transfer, attempt, e)
                last = e if isinstance(e, DcrError) else RefitError(f"{type(e).__name__}: {e}")
                log.warning("dcr_ray: attempt %d of %s failed: %r", attempt, transfer, e)
                if isinstance(e, (BaselineError, ConfigError, CommitConflictError)):
                    # an owner's committed state, the setup or the record's owner: retrying cannot help
                    raise _Abandoned(last, attempt + 1, False) from None
            metrics.record("refit_retries")
            try:  # whatever a lost node took goes in one pass, before anyone is called again
                self._sweep(notes)
            except OwnerLostError as e:  # an owner's node is gone: nothing to retry with
                raise _Abandoned(e, attempt + 1, True) from None
            except Exception as e:  # the sweep is repair, not a verdict: the next attempt finds what is still wrong
                log.warning("dcr_ray: the sweep after attempt %d of %s failed: %r", attempt, transfer, e)
            self._abort(transfer)
            failpoint("coordinator.repair")
            self._recovery.repair()
        raise _Abandoned(last, s.config.commit.max_attempts, False)

    def _sweep(self, notes: list[str]) -> None:
        """Lost nodes and lost capacity, in one pass (:meth:`~dcr_ray.actors.recovery.outages.Outages.sweep`): the
        engines that left heal in the background (re-created on a live node, or once their cluster can be
        hosted again); ``notes`` gets the report's warnings. Raises ``OwnerLostError`` if an owner's node is gone."""
        failpoint("coordinator.sweep")
        found = self._outages.sweep()
        if found.out_engines:
            self._healer.schedule(found.out_engines, "its cluster is waiting for capacity", respawn=True)
        if found.lost_engines:
            self._healer.schedule(found.lost_engines, "its node is gone", respawn=True)
        notes += [w for w in found.warnings(self._outages.waiting) if w not in notes]

    def _abort(self, transfer: str, final: bool = False, also: list[str] = ()) -> list[str]:
        """Close ``transfer`` on the required engines (and on ``also``: engines that left the refit on the
        way, which may hold its writes); with ``final``, the required engines left dirty.

        Waits for every engine (but not for one whose node is gone), at most the stage timeout: engines
        serve calls concurrently, so an abort still in flight could otherwise close the next attempt that
        a later ``prepare`` just opened.
        """
        failpoint("coordinator.abort")
        s = self._shared
        calls = {e: s.engines[e].abort.remote(transfer, final) for e in {*s.required, *also}}
        try:
            s.transport.release(transfer)
        except Exception as e:  # payload copies outlive the attempt; the engines must still be closed
            log.warning("dcr_ray: releasing the payloads of %s failed: %r", transfer, e)
        out, _dead, errors = gather(calls, s.config.commit.timeout_s, "abort", s.lost("engine"))
        dirty = [e for e, r in out.items() if r["dirty"] and e in s.required]
        for e, err in errors.items():
            if e not in s.required:
                continue  # it heals: its heal finds what it holds
            if isinstance(err, NoAnswerError):
                continue  # a hung engine is dropped by the next refit's prepare
            log.warning("dcr_ray: engine %s could not abort %s: %r", e, transfer, err)
            if final:  # its abort failed: what it holds is unknown, so it is restored densely
                dirty.append(e)
        return sorted(dirty)

    def _attempt(self, transfer: str, attempt: int, base: int, target: int, t_start: float,
                 request: str = "") -> RefitReport:
        s = self._shared
        t = s.config.commit.timeout_s
        req = sorted(s.required)
        base_id = s.last_transfer()  # frames are bound to the committed content, not only its number
        choice = choose_coding(s.config.codec, s.history, {s.topology.engine_cluster[e] for e in req})
        t0, clock = time.perf_counter(), CpuClock.start(s.topology, req)
        s.set_phase("prepare", transfer, attempt, target)
        failpoint("coordinator.prepare.before")
        self._members.answers({e: s.engines[e].prepare.remote(transfer, attempt, base, target, base_id,
                                                              epoch=s.incarnation(e)) for e in req}, "prepare")
        failpoint("coordinator.prepare.after")
        t1 = time.perf_counter()
        # engines outside the required set (healing, evicted) get nothing; their clusters' windows keep it
        sink = s.transport.sink(req, req, every_cluster=True)
        s.set_phase("stream", transfer, attempt, target)
        failpoint("coordinator.stream.before")
        sums = get_all({o: h.stream(transfer, attempt, base, target, sink, base_id=base_id,
                                                coding=choice.coding) for o, h in s.owners.items()}, t, "stream",
                       s.lost("owner"), s.relays_lost)
        failpoint("coordinator.stream.after")
        # the owners read the trainer's tensors no more from here: its next optimizer step may run
        t_released = t1 + max((x.get("released_s", 0.0) for x in sums.values()), default=0.0)
        keys = [k for x in sums.values() for k in x["payloads"]]
        s.set_phase("flush", transfer, attempt, target)
        failpoint("coordinator.flush.before")
        acks = self._members.answers({e: s.engines[e].flush.remote(transfer, attempt, keys, t, epoch=s.incarnation(e))
                                      for e in req}, "flush", s.relays_lost)
        failpoint("coordinator.flush.after")
        req = sorted(acks)  # without engines evicted as hung
        t2 = time.perf_counter()
        s.set_phase("commit", transfer, attempt, target)
        failpoint("coordinator.record.before")
        s.commits.compare_and_set(base, CommitRecord(version=target, transfer=transfer, epoch=s.epoch,
                                                     baseline=base_id, members=req, request=request))
        failpoint("coordinator.record.after")
        t_rec = time.perf_counter()
        # Committed: v+1 is durable. From here on roll forward (never retry, never abort): a failure
        # now takes the failing actor out of service and is reported, the version stays v+1.
        s.version = target
        warnings = list(s.commits.warnings)
        s.set_phase("promote", transfer, attempt, target)
        failpoint("coordinator.promote")
        promoting = {o: h.promote(target) for o, h in s.owners.items()}
        # the engines serve v+1 from now, beside the owners' promote: their pause ends at the record
        activating = {e: s.engines[e].activate.remote(target, transfer, epoch=s.incarnation(e)) for e in req}
        _, dead, errors = gather(promoting, t, "promote", s.lost("owner"))
        if dead or errors:
            bad = sorted({*dead, *errors})
            why = "; ".join(f"{o}: {e}" for o, e in errors.items()) or "actor died"
            warnings.append(f"owner(s) {bad} did not promote their baseline to v{target} ({why}); their next "
                            f"stream is refused until each is replaced by one that holds v{target}'s bits: "
                            f"Refit.replace_owner(owner_id, handle) (or relaunch the topology)")
        t_pro = time.perf_counter()
        s.set_phase("activate", transfer, attempt, target)
        failpoint("coordinator.activate.before")
        versions, dead, errors = gather(activating, t, "activate", s.lost("engine"))
        failpoint("coordinator.activate.after")
        if dead:
            warnings += self._members.heal_later(dead, "died")
        if errors:
            warnings += self._members.not_activated(errors, target)
        for w in warnings:
            log.warning("dcr_ray: %s", w)
        t_act = time.perf_counter()
        try:
            link = s.transport.link_bytes(transfer, acks)
        except (RayActorError, GetTimeoutError) as e:  # statistics only: the refit is committed
            link = {}
            warnings.append(f"link byte counts unavailable: {type(e).__name__}")
        failpoint("coordinator.keep")
        self._healer.keep(CommittedStep(transfer=transfer, attempt=attempt, base=base, target=target,
                                        base_id=base_id, keys=[tuple(k) for k in keys]))
        report = RefitReport.from_stages(
            version=target, transfer=transfer, attempts=attempt + 1, sums=sums, acks=acks, link_bytes=link,
            engine_versions=versions, warnings=warnings, coding=choice,
            marks={"start": t_start, "prepare": t0, "stream": t1, "released": t_released, "flushed": t2,
                   "record": t_rec, "promoted": t_pro, "activated": t_act, "end": time.perf_counter()}, cpu_seconds=clock.stop())
        s.history.append({**report.to_dict(), "request": request})
        metrics.record("refit_seconds", report.seconds["total"])
        metrics.record("refit_wire", report.wire_bytes)
        metrics.record("refit_changed", report.changed)
        metrics.record("version", target)
        metrics.record("required_engines", len(s.required))
        for cluster, nbytes in link.items():
            metrics.record("link_bytes", nbytes, tags={"cluster": cluster})
        return report

    def _discard_pending(self) -> None:
        """Owners drop their pending changed sets (their baselines stay the committed bits). A dead owner,
        or one whose node is gone, has nothing pending; a hung one fails the next refit's stream."""
        failpoint("coordinator.discard")
        s = self._shared
        gather({o: h.discard() for o, h in s.owners.items()}, s.config.commit.timeout_s, "discard",
               s.lost("owner"))

    # -- membership, recovery and inspection (each delegated to its part) -----------------------------
    def rejoin(self, engine_id: str) -> dict:
        """Bring an engine (new, dead, or fallen out of the required set) back at the committed version,
        now: by the deltas it missed, from a peer, else densely from the owners
        (:meth:`~dcr_ray.actors.coordinator.membership.Membership.rejoin`)."""
        self._members.rejoin(engine_id)
        return self.status()

    def drain(self, engine_id: str) -> dict:
        """``Refit.drain``: ``engine_id`` stays at its version and misses refits until it rejoins
        (:meth:`~dcr_ray.actors.coordinator.membership.Membership.drain`)."""
        self._members.drain(engine_id)
        return self.status()

    def invalidate(self, engine_id: str, why: str) -> dict:
        """``Refit.invalidate``: ``engine_id``'s weights changed outside dcr_ray; it holds no version and
        heals now (:meth:`~dcr_ray.actors.coordinator.membership.Membership.invalidate`)."""
        self._members.invalidate(engine_id, why)
        return self.status()

    def replace_owner(self, owner_id: str, handle) -> dict:
        """Put ``handle`` in place of owner ``owner_id`` (one that died) at the committed version, if it
        covers the same boxes and holds the committed bits
        (:meth:`~dcr_ray.actors.recovery.restarts.Recovery.replace_owner`); else ``ConfigError``, nothing changed."""
        self._recovery.replace_owner(owner_id, handle)
        return self.status()

    def status(self, detail: bool = False) -> dict:
        """Lock-free: :meth:`~dcr_ray.actors.coordinator.inspection.Inspection.status`."""
        return self._inspection.status(detail)

    def progress(self) -> dict:
        """Lock-free: :meth:`~dcr_ray.actors.coordinator.inspection.Inspection.progress`."""
        return self._inspection.progress()

    def teardown(self) -> None:
        """Kill the engines and relays and remove the placement groups (``Refit.shutdown``)."""
        self._shared.topology.teardown()

    def handles(self) -> dict:
        """Actor handles: ``{"engines": {id: h}, "owners": {id: h}, "relays": {id: h}}``."""
        return self._shared.topology.handles()

    def relay_stats(self) -> list[dict]:
        return self._shared.transport.stats()

    def reports(self) -> list[dict]:
        return list(self._shared.history)
