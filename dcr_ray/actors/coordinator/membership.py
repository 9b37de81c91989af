"""Membership: which engines take part in the refits, and how one that left comes back.

An engine is *required* (it holds the committed version settled and takes part in the next refit),
*evicted* (it did not answer a stage within the timeout: alive but hung; it leaves the required set
and the refits go on without it), or heals in the background (*queued*, then the steps of its heal:
:mod:`~dcr_ray.actors.recovery.healing`). The decisions this part makes (each a move of
:class:`~dcr_ray.actors.fleet.standings.Standings`, whose table refuses any other)::

    required --no answer within a stage's timeout--> evicted        (:meth:`Membership.answers`)
    required --died / failed to activate---------> queued           (:meth:`Membership.heal_later`)
    evicted  --answers, had flushed the committed transfer--> required   (activated: no bits move)
    evicted  --answers otherwise / died meanwhile--> queued          (:meth:`Membership.readmit`)
    any      --Refit.rejoin / Refit.invalidate----> queued, healed now   (:meth:`rejoin`, :meth:`invalidate`)
    required --its dense bootstrap failed---------> queued           (:meth:`bootstrap_dense`)
    written by an abandoned refit, no rollback --> joining (dense bootstrap), else out (:meth:`restore`)

Each evicted engine's pending readmission probe belongs to this part.
"""

from __future__ import annotations

import logging

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from dcr_ray.actors.fleet.calls import ActorsDied, NoAnswerError, gather
from dcr_ray.actors.fleet.standings import Standing
from dcr_ray.actors.fleet.state import CoordinatorState
from dcr_ray.actors.recovery.bootstrap import Bootstrap
from dcr_ray.actors.recovery.healing import Healing
from dcr_ray.errors import ConfigError, RefitError
from dcr_ray.failpoints import failpoint
from dcr_ray.report import RefitReport

log = logging.getLogger("dcr_ray")

#: How long a refit waits for a hung engine's readmission probe (a pending probe is kept for the next).
READMIT_PROBE_S = 0.0


class Membership:
    """The standings' transitions that need a decision (see the module doc)."""

    def __init__(self, state: CoordinatorState, bootstrap: Bootstrap, healer: Healing):
        self._shared = state
        self._bootstrap = bootstrap
        self._healer = healer
        self._probes: dict[str, ray.ObjectRef] = {}  # evicted engine -> its pending readmission probe

    def evicted(self) -> list[str]:
        """Engines that did not answer a stage in time and have not answered since."""
        return self._shared.standings.with_standing(Standing.EVICTED)

    def answers(self, calls: dict, stage: str, broken=None) -> dict:
        """Results of one engine stage. A dead engine raises :class:`ActorsDied`; an engine that is alive
        but does not answer within the stage timeout is *evicted* (it leaves the required set, and rejoins
        once it answers again, see :meth:`readmit`) while the others go on; any other error fails the attempt."""
        s = self._shared
        out, dead, errors = gather(calls, s.config.commit.timeout_s, stage, s.lost("engine"), broken)
        if dead:
            raise ActorsDied(dead)
        hung = sorted(e for e, err in errors.items() if isinstance(err, NoAnswerError))
        other = [err for e, err in errors.items() if e not in hung]
        if other:
            raise other[0]
        if hung and len(hung) == len(calls):
            raise errors[hung[0]]  # nobody answered: a stalled stage, not one hung engine
        if hung:
            s.standings.evict(hung)
            log.warning("dcr_ray: engine(s) %s did not answer '%s' within %.0f s: evicted until they answer again",
                        hung, stage, s.config.commit.timeout_s)
        return out

    def heal_later(self, dead, reason: str) -> list[str]:
        """Re-create the engines in ``dead`` and heal them in the background; the report's warnings."""
        self._healer.schedule(sorted(dead), reason, respawn=True)
        return [f"engine {e} died; it is re-created and heals in the background {self._heal_source(e, dead)} "
                f"(Refit.status()['healing'])" for e in sorted(dead)]

    def _heal_source(self, engine: str, dead) -> str:
        """Where a re-created ``engine`` will take the committed version from, as the report says it
        (:mod:`~dcr_ray.actors.recovery.healing`'s order: its cluster, another cluster, the owners)."""
        s = self._shared
        cluster = s.topology.engine_cluster.get(engine)
        holders = [e for e in s.required if e not in set(dead)]
        if any(s.topology.engine_cluster.get(e) == cluster for e in holders):
            return "from a peer of its cluster"
        if holders:
            return (f"from a peer of another cluster: its whole cluster {cluster!r} was lost, so the first of its "
                    f"engines copies across the cluster link once and the others copy from that one")
        return "densely from the owners: no engine holds the committed version any more"

    def not_activated(self, errors, target: int) -> list[str]:
        """Engines that are alive but failed to activate committed ``target`` leave the required set and
        heal in the background; the report's warnings."""
        self._healer.schedule(sorted(errors), f"did not activate v{target}", respawn=False)
        return [f"engine(s) {sorted(errors)} did not activate v{target} and left the required set; "
                f"they heal in the background (Refit.status()['healing'])"]

    def after_commit(self, report: RefitReport, dropped: list[str], rejoined: list[str]) -> RefitReport:
        """Heal and readmit after a commit; their failures become warnings of the committed report."""
        report.dropped_engines = dropped
        try:
            report.warnings += self.heal_later(dropped, "died")
            report.warnings += [f"engine {e} heals again after a failed heal" for e in self._healer.retry_failed()]
            report.warnings += rejoined
            self.readmit(report.warnings)
        except Exception as e:
            report.warnings.append(f"healing after the commit failed: {e!r}")
        report.warnings += [f"engine {e} did not answer and is evicted; it rejoins when it answers"
                            for e in self.evicted()]
        return report

    def readmit(self, warnings: list[str]) -> None:
        """Engines evicted as hung that answer again rejoin: activated if they took the whole transfer
        the record committed (they hung in its flush), else healed in the background (:mod:`healing`);
        one that died meanwhile is re-created and healed."""
        s = self._shared
        for e in self.evicted():
            # a probe answers once the engine's lock is free; one still pending is kept for the next refit,
            # so a hung engine costs a refit nothing
            if e not in self._probes:
                self._probes[e] = s.engines[e].state.remote()
            probe = self._probes[e]
            if not ray.wait([probe], timeout=READMIT_PROBE_S)[0]:
                continue  # still hung
            try:
                st = ray.get(probe)
            except RayActorError:  # it died while evicted (no prepare reaches it): re-created, healed
                self._probes.pop(e, None)
                warnings += self.heal_later([e], "died while evicted")
                continue
            except Exception:
                self._probes.pop(e, None)
                continue
            self._probes.pop(e, None)
            try:
                failpoint("coordinator.readmit")
                rec = s.commits.read()
                t = s.config.commit.timeout_s
                if (rec is not None and st.get("flushed") and st["transfer"] == rec.transfer
                        and st["target"] == rec.version == s.version):
                    ray.get(s.engines[e].activate.remote(rec.version, rec.transfer, epoch=s.incarnation(e)), timeout=t)
                    s.standings.require([e])
                    how = ("rejoined at version {v} (it had applied the committed transfer: activated, no dense "
                           "bootstrap)")
                else:
                    if st["transfer"] is not None:  # close what it holds open (rolled back off the refit's clock, by
                        # the healing thread, before it catches up; until then it is out of the required set)
                        ray.get(s.engines[e].abort.remote(st["transfer"], False), timeout=t)
                    self._healer.schedule([e], "answered again after it was evicted", respawn=False)
                    how = ("heals to version {v} in the background, by the deltas it missed (its cluster's catch-up "
                           "window) or from a peer of its cluster")
                warnings.append(f"engine {e} answers again and " + how.format(v=s.version))
            except Exception as err:
                log.warning("dcr_ray: readmitting engine %s failed: %r", e, err)

    def rejoin(self, engine_id: str) -> None:
        """``Refit.rejoin``: bring an engine (new, dead, or fallen out of the required set) back at the
        committed version, now: by the deltas it missed, from a peer, else densely from the owners."""
        s = self._shared
        self.known(engine_id)
        t = s.config.commit.timeout_s
        with s.lock:
            s.standings.heal([engine_id])
            try:
                st = ray.get(s.engines[engine_id].state.remote(), timeout=t)
                dead = False
            except (RayActorError, GetTimeoutError):
                dead = True  # its actor died (or hangs): a new one takes its place
            if not dead and st["transfer"] is not None:  # close what it holds open before it takes a copy
                ray.get(s.engines[engine_id].abort.remote(st["transfer"], True), timeout=t)
        self._healer.heal_now(engine_id, "rejoin", respawn=dead)

    def invalidate(self, engine_id: str, why: str) -> None:
        """``Refit.invalidate``: ``engine_id``'s weights changed outside dcr_ray; it leaves the required
        set, holds no version, and heals now (by digest when its bits are still the committed ones, else
        from a peer, else densely from the owners: :mod:`~dcr_ray.actors.recovery.healing`)."""
        s = self._shared
        self.known(engine_id)
        with s.lock:  # between refits
            s.standings.heal([engine_id])
            ray.get(s.engines[engine_id].invalidate.remote(str(why)), timeout=s.config.commit.timeout_s)
        self._healer.heal_now(engine_id, f"invalidated: {why}", respawn=False)

    def drain(self, engine_id: str) -> None:
        """``Refit.drain``: ``engine_id`` leaves the required set between refits, nothing scheduled: it keeps
        the version it holds, serves it, and misses every refit until ``Refit.rejoin`` brings it back (by
        the deltas it missed where the window still holds them)."""
        s = self._shared
        self.known(engine_id)
        with s.lock:  # between refits
            if engine_id not in s.required:
                standing = getattr(s.standings.of(engine_id), "value", "no standing")
                raise ConfigError(f"engine {engine_id!r} is not in the required set ({standing}): nothing to drain")
            s.standings.out([engine_id])

    def bootstrap_dense(self, ids: list[str]) -> int:
        """``CoordinatorActor.bootstrap_dense`` (call with the coordinator's lock held): a dense bootstrap of
        required engines ``ids`` (anything else is refused before a write); returns the frames sent. A failed
        one leaves its engines holding no version: required, they would fail every refit, so they leave the
        required set and heal (from a peer, the window or the owners), and a ``RefitError`` says so."""
        s = self._shared
        for e in ids:  # checked before anything is written
            self.known(e)
            standing = s.standings.of(e)
            if standing not in (None, Standing.REQUIRED):  # healing, waiting, failed, out, evicted, joining
                raise ConfigError(f"engine {e!r} is {standing.value!r}, not required: a dense bootstrap repairs "
                                  f"required engines only; Refit.rejoin({e!r}) brings it back (re-created if "
                                  f"its actor died)")
        try:
            return self._bootstrap.dense(ids)
        except Exception as err:
            self._healer.schedule(ids, f"a dense bootstrap failed: {type(err).__name__}", respawn=False)
            raise RefitError(f"the dense bootstrap of {ids} failed ({type(err).__name__}: {str(err)[:300]}); "
                             f"they hold no version, left the required set and heal in the background "
                             f"(Refit.wait_healed() waits for them)") from err

    def restore(self, dirty: list[str], owners: bool = True) -> str:
        """Dense re-bootstrap of engines an abandoned refit wrote into; a note for the error message.
        Without ``owners`` (one of them is lost) nobody can send the committed bits: they leave at once."""
        if not dirty:
            return ""
        s = self._shared
        try:
            if not owners:
                raise RefitError("an owner is lost")
            self._bootstrap.dense(dirty, timeout_s=s.config.commit.timeout_s)  # under the lock: one stage at most
            log.warning("dcr_ray: re-bootstrapped %s to version %d after an abandoned refit", dirty, s.version)
            return f"; {dirty} were re-bootstrapped densely to it"
        except Exception as e:  # e.g. an owner died: these engines leave until Refit.rejoin
            s.standings.out(dirty)
            log.warning("dcr_ray: could not re-bootstrap %s (%s); they left the required set", dirty, e)
            return (f"; {dirty} hold partially written weights and could not be re-bootstrapped ({e}), so "
                    f"they left the required set: Refit.rejoin(engine_id) restores each")

    def known(self, engine_id: str) -> None:
        """``ConfigError`` unless ``engine_id`` is an engine of this topology."""
        if engine_id not in self._shared.engines:
            raise ConfigError(f"unknown engine {engine_id!r}; known: {sorted(self._shared.engines)}")
