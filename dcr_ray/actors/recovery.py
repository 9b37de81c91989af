"""Recovery of the coordinator's topology: resuming from the commit record, answering a refit whose record
is durable (a retried call, a step after the record that failed), re-planning around dead
relays, readmitting evicted engines, replacing a dead owner (dead engines heal in
:mod:`~dcr_ray.actors.healing`).

A mixin of :class:`~dcr_ray.actors.coordinator.CoordinatorActor` (it uses the coordinator's topology,
commit log, ``_bootstrap`` and lock); kept apart so the refit state machine reads on its own.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from dcr_ray.actors.calls import ActorsDied, NoAnswerError, gather, get_all
from dcr_ray.actors.commit import CommitRecord
from dcr_ray.errors import ConfigError
from dcr_ray.report import RefitReport

log = logging.getLogger("dcr_ray")

#: How long a refit waits for a hung engine's readmission probe (a pending probe is kept for the next).
READMIT_PROBE_S = 0.0
#: Owner handles replaced since launch, beside the commit record (read back on resume).
OWNERS_FILE = "owners.pkl"


class Recovery:
    """Resume, repair, heal, replace_owner and joining adopted engines by digest, for the coordinator."""

    def _resume(self) -> None:
        """Carry on from the durable record with the actors that are still alive (see the module doc)."""
        cfg, t = self.config, self.config.commit.timeout_s
        rec = self.commits.read()
        if rec is None:
            raise ConfigError(f"nothing to resume: no commit record in {cfg.commit.dir}")
        self.epoch = rec.epoch + 1  # fence every older incarnation before touching anything
        self.commits.compare_and_set(rec.version, CommitRecord(**{**asdict(rec), "epoch": self.epoch, "time": 0.0}))
        self.version = rec.version
        fresh = self.topology.reconnect(self.backend_factory, cfg)
        self._load_owners()
        specs, dead_owners, errors = gather({o: h.dcr_attach.remote(o, cfg) for o, h in self.owners.items()}, t,
                                            "attach")
        if errors:
            raise next(iter(errors.values()))
        if dead_owners:  # the next refit fails cleanly until Refit.replace_owner; engines keep serving
            log.warning("dcr_ray: owner(s) %s are dead at resume; replace them with Refit.replace_owner", dead_owners)
        self._owner_specs = {**self._owner_specs, **specs}
        # owners: promote a pending set the record committed, drop any other
        live = {o: h for o, h in self.owners.items() if o not in dead_owners}
        for o, st in get_all({o: h.dcr_state.remote() for o, h in live.items()}, t, "owner state").items():
            h = self.owners[o]
            if st["version"] < rec.version and st["pending"] == rec.version:
                ray.get(h.dcr_promote.remote(rec.version), timeout=t)
            elif st["pending"] is not None:
                ray.get(h.dcr_discard.remote(), timeout=t)
        # engines: activate the transfer the record committed, roll back any other
        states, dead, _ = gather({e: self.engines[e].state.remote() for e in self.engines if e not in fresh},
                                 t, "engine state")
        behind = list(fresh) + list(dead)
        for e, st in states.items():
            if st["transfer"] is not None and st["transfer"] == rec.transfer and st["target"] == rec.version:
                ray.get(self.engines[e].activate.remote(rec.version, rec.transfer), timeout=t)
            elif st["transfer"] is not None:
                ray.get(self.engines[e].abort.remote(st["transfer"], True), timeout=t)
            if ray.get(self.engines[e].get_version.remote(), timeout=t) == rec.version:
                self.required.add(e)
            else:
                behind.append(e)
        for e in dead:
            self.topology.respawn(e, cfg)
        if behind:  # from a peer of their cluster where one holds the version, in the background
            self.healer.schedule(sorted(behind), "behind the commit record at resume", respawn=False)
        log.info("dcr_ray: coordinator epoch %d resumed at version %d (%d engines heal in the background)",
                 self.epoch, self.version, len(behind))

    # -- answers about a commit ---------------------------------------------------------------------
    def _answered(self, request: str | None) -> RefitReport | None:
        """The report of ``request`` if it already committed (a retried call), else None."""
        if not request:
            return None
        for r in reversed(self.history):
            if r.get("request") == request:
                return RefitReport(**{k: v for k, v in r.items() if k in RefitReport.__slots__})
        with self._lock:
            rec = self.commits.read()
        if rec is None or rec.request != request:
            return None
        return RefitReport(version=rec.version, transfer=rec.transfer, attempts=1, engine_versions={},
                           warnings=[f"the coordinator restarted after committing version {rec.version}; "
                                     f"this answer comes from the commit record (per-stage figures were lost)"])

    def _after_commit(self, report: RefitReport, dropped: list[str], rejoined: list[str]) -> RefitReport:
        """Heal and readmit after a commit; their failures become warnings of the committed report."""
        report.dropped_engines = dropped
        try:
            report.warnings += self._heal_later(dropped, "died")
            report.warnings += [f"engine {e} heals again after a failed heal" for e in self.healer.retry_failed()]
            report.warnings += rejoined
            self._readmit(report.warnings)
        except Exception as e:
            report.warnings.append(f"healing after the commit failed: {e!r}")
        report.warnings += [f"engine {e} did not answer and is evicted; it rejoins when it answers"
                            for e in sorted(self.evicted)]
        return report

    def _heal_later(self, dead: list[str], reason: str) -> list[str]:
        """Re-create the engines in ``dead`` and heal them in the background; the report's warnings."""
        self.healer.schedule(sorted(dead), reason, respawn=True)
        return [f"engine {e} died; it is re-created and heals in the background from a peer of its cluster "
                f"(Refit.status()['healing'])" for e in sorted(dead)]

    def _committed_anyway(self, transfer: str, attempt: int, err: BaseException) -> RefitReport:
        """The report of a refit whose record is durable although a step after it raised ``err``: the
        version stays committed (never rolled back), the failure is a warning."""
        log.warning("dcr_ray: version %d is committed; a step after the record failed: %r", self.version, err)
        warning = f"version {self.version} is committed, but a step after the commit record failed: {err!r}"
        return RefitReport(version=self.version, transfer=transfer, attempts=attempt + 1, warnings=[warning],
                           engine_versions={e: self.version for e in sorted(self.required)})

    def _owners_path(self) -> str:
        return os.path.join(self.config.commit.dir, OWNERS_FILE)

    def _save_owners(self) -> None:
        """Persist the owner handles and their specs (replacements must survive a coordinator restart,
        which re-runs the constructor with the owners given at launch)."""
        tmp = self._owners_path() + ".tmp"
        with open(tmp, "wb") as f:
            f.write(ray.cloudpickle.dumps({"owners": dict(self.owners), "specs": self._owner_specs}))
        os.replace(tmp, self._owners_path())

    def _load_owners(self) -> None:
        try:
            with open(self._owners_path(), "rb") as f:
                saved = ray.cloudpickle.loads(f.read())
        except FileNotFoundError:
            return
        self.topology.owners.update(saved["owners"])
        self._owner_specs = dict(saved["specs"])

    def _repair(self) -> None:
        """Before the next attempt: re-create transport actors that died (a relay death is not an owner's)."""
        topo = self.topology
        try:
            dead = self.transport.repair(list(topo.clusters.values()), topo.engines, topo.engine_cluster)
        except Exception as e:  # repair is best effort: the next attempt reports what still fails
            log.warning("dcr_ray: transport repair failed: %r", e)
            return
        if dead:
            log.warning("dcr_ray: relay(s) %s died; their cluster trees were re-planned", dead)

    def _readmit(self, warnings: list[str]) -> None:
        """Engines evicted as hung that answer again rejoin: activated if they took the whole transfer
        the record committed (they hung in its flush), else healed in the background (:mod:`healing`);
        one that died meanwhile is re-created and healed."""
        for e in sorted(self.evicted):
            # a probe answers once the engine's lock is free; one still pending is kept for the next refit,
            # so a hung engine costs a refit nothing
            if e not in self._probes:
                self._probes[e] = self.engines[e].state.remote()
            probe = self._probes[e]
            if not ray.wait([probe], timeout=READMIT_PROBE_S)[0]:
                continue  # still hung
            try:
                st = ray.get(probe)
            except RayActorError:  # it died while evicted (no prepare reaches it): re-created, healed
                self._probes.pop(e, None)
                self.evicted.discard(e)
                warnings += self._heal_later([e], "died while evicted")
                continue
            except Exception:
                self._probes.pop(e, None)
                continue
            self._probes.pop(e, None)
            try:
                rec = self.commits.read()
                t = self.config.commit.timeout_s
                if (rec is not None and st.get("flushed") and st["transfer"] == rec.transfer
                        and st["target"] == rec.version == self.version):
                    ray.get(self.engines[e].activate.remote(rec.version, rec.transfer), timeout=t)
                    self.required.add(e)
                    how = "rejoined at version {v} (it had applied the committed transfer: activated, no dense bootstrap)"
                else:
                    if st["transfer"] is not None:  # close what it holds open (rolled back off the refit's clock, by
                        # the healing thread, before it catches up; until then it is out of the required set)
                        ray.get(self.engines[e].abort.remote(st["transfer"], False), timeout=t)
                    self.healer.schedule([e], "answered again after it was evicted", respawn=False)
                    how = ("heals to version {v} in the background, by the deltas it missed (its cluster's catch-up "
                           "window) or from a peer of its cluster")
                self.evicted.discard(e)
                warnings.append(f"engine {e} answers again and " + how.format(v=self.version))
            except Exception as err:
                log.warning("dcr_ray: readmitting engine %s failed: %r", e, err)

    def invalidate(self, engine_id: str, why: str) -> dict:
        """``Refit.invalidate``: ``engine_id``'s weights changed outside dcr_ray; it leaves the required
        set, holds no version, and heals now (by digest when its bits are still the committed ones, else
        from a peer, else densely from the owners: :mod:`~dcr_ray.actors.healing`)."""
        if engine_id not in self.engines:
            raise ConfigError(f"unknown engine {engine_id!r}; known: {sorted(self.engines)}")
        with self._lock:  # between refits
            self.required.discard(engine_id)
            self.evicted.discard(engine_id)
            ray.get(self.engines[engine_id].invalidate.remote(str(why)), timeout=self.config.commit.timeout_s)
        self.healer.heal_now(engine_id, f"invalidated: {why}", respawn=False)
        return self.status()

    def replace_owner(self, owner_id: str, handle) -> dict:
        """Put ``handle`` in place of owner ``owner_id`` (one that died) at the committed version.

        The replacement must cover exactly what ``owner_id`` covered and hold the committed bits: its
        digests of every canonical box it covers must equal a required engine's. Otherwise nothing
        changes and ``ConfigError`` says what differs.
        """
        with self._lock:
            if owner_id not in self.owners:
                raise ConfigError(f"unknown owner {owner_id!r}; known: {sorted(self.owners)}")
            t = self.config.commit.timeout_s
            specs = ray.get(handle.dcr_attach.remote(owner_id, self.config, version=self.version), timeout=t)
            if specs != self._owner_specs[owner_id]:
                raise ConfigError(f"the replacement for {owner_id} covers other tensors or boxes than it did: "
                                  f"{sorted(set(specs) ^ set(self._owner_specs[owner_id]))[:5] or 'same names, other boxes'}")
            mine = ray.get(handle.dcr_digests.remote(), timeout=t)
            theirs, why = None, "no required engine"
            for e in sorted(self.required):
                try:
                    theirs = ray.get(self.engines[e].box_digests.remote(list(mine)), timeout=t)
                    break
                except Exception as err:  # adopted engines cannot read back; try the next one
                    why = f"{e}: {err}"
            if theirs is None:
                raise ConfigError(f"no engine could digest the committed version to check the replacement ({why})")
            bad = sorted(k[0] for k in mine if mine[k] != theirs["digests"][k])
            if bad:
                raise ConfigError(f"the replacement for {owner_id} does not hold committed version {self.version}: "
                                  f"{len(bad)} boxes differ, e.g. {bad[:3]} (restore it from the committed "
                                  f"checkpoint first)")
            self.topology.owners[owner_id] = handle
            self._save_owners()
            log.info("dcr_ray: owner %s replaced at version %d", owner_id, self.version)
            return self.status()

    def _join_by_digest(self, engine_ids: list[str]) -> list[str]:
        """Adopted engines among ``engine_ids`` whose served tensors have the owners' committed box
        digests join the required set without dense frames; returns the engines still to bootstrap.
        Any failure of the check leaves every engine to the dense bootstrap."""
        adopted = [e for e in engine_ids if self.topology.is_adopted(e)]
        if not adopted:
            return engine_ids
        t = self.config.commit.timeout_s
        try:
            digests: dict = {}
            for d in get_all({o: h.dcr_digests.remote() for o, h in self.owners.items()}, t,
                             "bootstrap digests").values():
                digests.update(d)
            joined = get_all({e: self.engines[e].join_by_digest.remote(self.version, digests, self._last_transfer())
                              for e in adopted},
                             t, "bootstrap digest check")
        except Exception as e:
            log.warning("dcr_ray: digest check of adopted engines %s failed (%r); bootstrapping densely", adopted, e)
            return engine_ids
        ok = sorted(e for e, j in joined.items() if j)
        self.required |= set(ok)
        if ok:
            log.info("dcr_ray: %s already serve version %d (digests match): joined without a dense bootstrap",
                     ok, self.version)
        return [e for e in engine_ids if e not in ok]

    def _engines_answer(self, calls: dict, stage: str) -> dict:
        """Results of one engine stage. A dead engine raises :class:`ActorsDied`; an engine that is alive
        but does not answer within the stage timeout is *evicted* (it leaves the required set, and rejoins
        once it answers again, see ``_readmit``) while the others go on; any other error fails the attempt."""
        out, dead, errors = gather(calls, self.config.commit.timeout_s, stage)
        if dead:
            raise ActorsDied(dead)
        hung = sorted(e for e, err in errors.items() if isinstance(err, NoAnswerError))
        other = [err for e, err in errors.items() if e not in hung]
        if other:
            raise other[0]
        if hung and len(hung) == len(calls):
            raise errors[hung[0]]  # nobody answered: a stalled stage, not one hung engine
        if hung:
            self.required -= set(hung)
            self.evicted |= set(hung)
            log.warning("dcr_ray: engine(s) %s did not answer '%s' within %.0f s: evicted until they answer again",
                        hung, stage, self.config.commit.timeout_s)
        return out

    def _discard_pending(self) -> None:
        """Owners drop their pending changed sets (their baselines stay the committed bits)."""
        refs = [h.dcr_discard.remote() for h in self.owners.values()]
        try:
            ray.get(refs, timeout=self.config.commit.timeout_s)
        except (RayActorError, GetTimeoutError):
            pass  # a dead owner has nothing pending; a hung one fails the next refit's stream

    def _restore(self, dirty: list[str]) -> str:
        """Dense re-bootstrap of engines an abandoned refit wrote into; a note for the error message."""
        if not dirty:
            return ""
        try:
            self._bootstrap(dirty)
            log.warning("dcr_ray: re-bootstrapped %s to version %d after an abandoned refit", dirty, self.version)
            return f"; {dirty} were re-bootstrapped densely to it"
        except Exception as e:  # e.g. an owner died: these engines leave until Refit.rejoin
            self.required -= set(dirty)
            log.warning("dcr_ray: could not re-bootstrap %s (%s); they left the required set", dirty, e)
            return (f"; {dirty} hold partially written weights and could not be re-bootstrapped ({e}), so "
                    f"they left the required set: Refit.rejoin(engine_id) restores each")
