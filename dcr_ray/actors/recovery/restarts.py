"""Recovery: a coordinator that restarts, a retried call, dead relays and a dead owner.

* **Resume** (:meth:`Recovery.resume`): a new incarnation (Ray restarting the actor, or
  ``launch(..., resume=True)``) fences every older one (the record's epoch), finds the live actors by
  name, settles the open transition (owners promote a pending set the record committed and drop any
  other; engines activate the transfer the record committed and roll back any other) and carries on at
  the committed version; engines behind it heal in the background (:mod:`~dcr_ray.actors.recovery.healing`).
* **Answers about a commit**: a retried ``refit`` call whose record is durable is answered from the
  history or the record (:meth:`Recovery.answered`); a step after the record that failed is a warning
  of the committed report, never a rollback (:meth:`Recovery.committed_anyway`).
* **Relays** that died are re-created before the next attempt (:meth:`Recovery.repair`).
* **Owners**: their specs and replaced handles persist beside the commit record (a restarted
  coordinator re-runs its constructor with the owners given at launch); a replacement must cover what
  the dead owner covered and hold the committed bits (:meth:`Recovery.replace_owner`).

A part of :class:`~dcr_ray.actors.coordinator.actor.CoordinatorActor`; it owns the owners' specs and reaches
the shared state through :class:`~dcr_ray.actors.fleet.state.CoordinatorState`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict

import ray

from dcr_ray.actors.fleet.calls import gather, get_all
from dcr_ray.actors.fleet.commit import CommitRecord
from dcr_ray.actors.fleet.state import CoordinatorState
from dcr_ray.actors.owner.endpoint import owner_endpoint
from dcr_ray.actors.recovery.healing import Healing
from dcr_ray.actors.recovery.outages import Outages
from dcr_ray.errors import ConfigError
from dcr_ray.failpoints import failpoint
from dcr_ray.report import RefitReport

log = logging.getLogger("dcr_ray")

#: Owner handles replaced since launch, beside the commit record (read back on resume).
OWNERS_FILE = "owners.pkl"


class Recovery:
    """Resume, answers about a commit, relay repair and owner replacement (see the module doc)."""

    def __init__(self, state: CoordinatorState, healer: Healing, outages: Outages):
        self._shared = state
        self._healer = healer
        self._outages = outages
        self._owner_specs: dict[str, dict] = {}  # owner id -> what it covers (checked on replacement)

    def attached(self, specs: dict[str, dict]) -> None:
        """The owners attached at launch cover ``specs``: kept, and persisted with their handles."""
        self._owner_specs = dict(specs)
        self._save_owners()

    def resume(self) -> None:
        """Carry on from the durable record with the actors that are still alive (see the module doc)."""
        s = self._shared
        cfg, t = s.config, s.config.commit.timeout_s
        rec = s.commits.read()
        if rec is None:
            raise ConfigError(f"nothing to resume: no commit record in {cfg.commit.dir}")
        s.epoch = rec.epoch + 1  # fence every older incarnation before touching anything
        s.commits.compare_and_set(rec.version, CommitRecord(**{**asdict(rec), "epoch": s.epoch, "time": 0.0}))
        s.version = rec.version
        # clusters no live node can host wait for capacity at once: nothing of this resume waits for them
        failpoint("coordinator.resume")
        fresh, out = s.topology.reconnect(s.backend_factory, cfg)
        self._outages.waiting_for(out)
        self._load_owners()
        specs, dead_owners, errors = gather({o: h.attach(o, cfg) for o, h in s.owners.items()}, t,
                                            "attach")
        if errors:
            raise next(iter(errors.values()))
        if dead_owners:  # the next refit fails cleanly until Refit.replace_owner; engines keep serving
            log.warning("dcr_ray: owner(s) %s are dead at resume; replace them with Refit.replace_owner", dead_owners)
        self._owner_specs = {**self._owner_specs, **specs}
        # owners: promote a pending set the record committed, drop any other
        live = {o: h for o, h in s.owners.items() if o not in dead_owners}
        for o, st in get_all({o: h.state() for o, h in live.items()}, t, "owner state").items():
            h = s.owners[o]
            if st["version"] < rec.version and st["pending"] == rec.version:
                ray.get(h.promote(rec.version), timeout=t)
            elif st["pending"] is not None:
                ray.get(h.discard(), timeout=t)
        failpoint("coordinator.resume.owners")
        # engines: activate the transfer the record committed where it names them and they flushed it; roll
        # back any other open transfer. An engine that did not answer heals (it has a standing either way).
        waiting = [e for e in s.engines if s.topology.engine_cluster[e] in out]
        states, dead, unsure = gather({e: s.engines[e].state.remote() for e in s.engines
                                       if e not in fresh and e not in waiting}, t, "engine state", s.lost("engine"))
        s.topology.adopt_epochs(states)
        behind = [e for e in fresh if e not in waiting] + list(dead) + sorted(unsure)
        for e, st in states.items():
            failpoint("coordinator.resume.engine")
            try:
                if self._settle(e, st, rec, t) == rec.version:
                    s.standings.require([e])
                    continue
            except Exception as err:  # its bits are in doubt: it heals (a peer's copy checks them)
                log.warning("dcr_ray: engine %s could not be settled at resume: %r", e, err)
            behind.append(e)
        if behind:  # from a peer of their cluster where one holds the version, in the background
            self._healer.schedule(sorted(behind), "behind the commit record at resume", respawn=False)
        if dead:  # re-created by the healing worker, off this resume's path
            self._healer.schedule(sorted(dead), "dead at resume", respawn=True)
        if waiting:
            self._healer.schedule(waiting, "its cluster is waiting for capacity", respawn=True)
        log.info("dcr_ray: coordinator epoch %d resumed at version %d (%d engines heal in the background, %d "
                 "wait for capacity)", s.epoch, s.version, len(behind) + len(dead), len(waiting))

    def _settle(self, e: str, st: dict, rec: CommitRecord, t: float) -> int | None:
        """Settle engine ``e``'s open transfer (``st``: its state) against the record ``rec``: activated
        only if the record names it as a member and it flushed the record's transfer (an engine evicted
        mid-stream holds part of it), else rolled back (or left dirty). Returns the version it holds."""
        h = self._shared.engines[e]
        if st["transfer"] is not None:
            commits = (st["transfer"] == rec.transfer and st["target"] == rec.version and st.get("flushed")
                       and e in rec.members)
            if commits:
                return ray.get(h.activate.remote(rec.version, rec.transfer, epoch=st.get("epoch")), timeout=t)
            ray.get(h.abort.remote(st["transfer"], True), timeout=t)
        return ray.get(h.get_version.remote(), timeout=t)

    # -- answers about a commit ---------------------------------------------------------------------
    def answered(self, request: str | None) -> RefitReport | None:
        """The report of ``request`` if it already committed (a retried call), else None."""
        s = self._shared
        if not request:
            return None
        for r in reversed(s.history):
            if r.get("request") == request:
                return RefitReport(**{k: v for k, v in r.items() if k in RefitReport.__slots__})
        with s.lock:
            rec = s.commits.read()
        if rec is None or rec.request != request:
            return None
        return RefitReport.of_record(rec, f"the coordinator restarted after committing version {rec.version}; "
                                            f"this answer comes from the commit record (its per-stage seconds, "
                                            f"bytes and change counts were lost)")

    def committed_anyway(self, transfer: str, attempt: int, err: BaseException) -> RefitReport:
        """The report of a refit whose record is durable although a step after it raised ``err``: the
        version stays committed (never rolled back), the failure is a warning."""
        s = self._shared
        log.warning("dcr_ray: version %d is committed; a step after the record failed: %r", s.version, err)
        warning = f"version {s.version} is committed, but a step after the commit record failed: {err!r}"
        return RefitReport(version=s.version, transfer=transfer, attempts=attempt + 1, warnings=[warning],
                           engine_versions={e: s.version for e in sorted(s.required)})

    def _owners_path(self) -> str:
        return os.path.join(self._shared.config.commit.dir, OWNERS_FILE)

    def _save_owners(self) -> None:
        """Persist the owner handles and their specs (replacements must survive a coordinator restart,
        which re-runs the constructor with the owners given at launch)."""
        s = self._shared
        tmp = self._owners_path() + ".tmp"
        with open(tmp, "wb") as f:
            f.write(ray.cloudpickle.dumps({"owners": dict(s.owners), "specs": self._owner_specs}))
        os.replace(tmp, self._owners_path())

    def _load_owners(self) -> None:
        s = self._shared
        try:
            with open(self._owners_path(), "rb") as f:
                saved = ray.cloudpickle.loads(f.read())
        except FileNotFoundError:
            return
        s.topology.owners.update(saved["owners"])
        self._owner_specs = dict(saved["specs"])

    def repair(self) -> None:
        """Before the next attempt: re-create transport actors that died (a relay death is not an owner's)."""
        s = self._shared
        topo = s.topology
        try:
            dead = s.transport.repair(list(topo.clusters.values()), topo.engines, topo.engine_cluster)
            topo.wire(s.config.commit.timeout_s)
        except Exception as e:  # repair is best effort: the next attempt reports what still fails
            log.warning("dcr_ray: transport repair failed: %r", e)
            return
        if dead:
            log.warning("dcr_ray: relay(s) %s died; their cluster trees were re-planned", dead)

    def replace_owner(self, owner_id: str, handle) -> None:
        """Put ``handle`` in place of owner ``owner_id`` (one that died) at the committed version.

        The replacement must cover exactly what ``owner_id`` covered and hold the committed bits: its
        digests of every canonical box it covers must equal a required engine's. Otherwise nothing
        changes and ``ConfigError`` says what differs.
        """
        s = self._shared
        handle = owner_endpoint(handle)  # a mixin actor, or one that holds a dcr_ray.Owner
        with s.lock:
            if owner_id not in s.owners:
                raise ConfigError(f"unknown owner {owner_id!r}; known: {sorted(s.owners)}")
            t = s.config.commit.timeout_s
            specs = ray.get(handle.attach(owner_id, s.config, version=s.version), timeout=t)
            if specs != self._owner_specs[owner_id]:
                differ = sorted(set(specs) ^ set(self._owner_specs[owner_id]))[:5] or "same names, other boxes"
                raise ConfigError(f"the replacement for {owner_id} covers other tensors or boxes than it did: "
                                  f"{differ}")
            mine = ray.get(handle.digests(), timeout=t)
            theirs, why = None, "no required engine"
            for e in sorted(s.required):
                try:
                    theirs = ray.get(s.engines[e].box_digests.remote(list(mine)), timeout=t)
                    break
                except Exception as err:  # adopted engines cannot read back; try the next one
                    why = f"{e}: {err}"
            if theirs is None:
                raise ConfigError(f"no engine could digest the committed version to check the replacement ({why})")
            bad = sorted(k[0] for k in mine if mine[k] != theirs["digests"][k])
            if bad:
                raise ConfigError(f"the replacement for {owner_id} does not hold committed version {s.version}: "
                                  f"{len(bad)} boxes differ, e.g. {bad[:3]} (restore it from the committed "
                                  f"checkpoint first)")
            s.topology.owners[owner_id] = handle
            self._save_owners()
            log.info("dcr_ray: owner %s replaced at version %d", owner_id, s.version)
