"""The commit coordinator: the named actor that drives every refit and owns the topology.

One refit (version v -> v+1), attempt ``a`` (``a = 0`` sends mixed XOR/OVERWRITE frames, every retry
sends OVERWRITE frames of the same pending changed set, which repairs any partial XOR)::

    prepare   every required engine confirms it holds v and opens (transfer, a)
    stream    every owner diffs, keeps the changed set pending, and streams frames to the transport
              (relay heads or object storage) while still diffing; returns its payload keys
    flush     every required engine ACKs having applied *all* payload keys (then flushes its backend)
    commit    compare-and-set of the durable record v -> v+1 (members = the engines that ACKed)
    promote   owners fold pending into their baselines; engines activate v+1; relays drop copies

Any failure before the record is written leaves the committed state as it was and starts the next
attempt; an engine whose actor died leaves the required set (it rejoins later by dense bootstrap);
after ``max_attempts`` the owners discard their pending sets, engines that an abandoned attempt wrote
into in place are re-bootstrapped densely to the committed version (or leave the required set when
that fails too), and ``refit`` raises ``RefitError``.
Every wait has a timeout (``stage_timeout_s``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from dcr_ray import metrics
from dcr_ray.actors.commit import CommitLog, CommitRecord
from dcr_ray.actors.engine import EngineActor
from dcr_ray.actors.owner import BOOTSTRAP_BASE
from dcr_ray.config import ClusterSpec, RefitConfig
from dcr_ray.errors import BaselineError, ConfigError, DcrError, RefitError, RefitTimeoutError
from dcr_ray.options import actor_options
from dcr_ray.relay.relay import RelayActor
from dcr_ray.relay.sinks import attempt_prefix, storage_fs
from dcr_ray.relay.tree import plan_tree
from dcr_ray.report import RefitReport

log = logging.getLogger("dcr_ray")


class _Dead(Exception):
    def __init__(self, ids):
        self.ids = ids


class CoordinatorActor:
    def __init__(self, config: RefitConfig, clusters: list[ClusterSpec], backend_factory,
                 owners: dict[str, object]):
        names = [c.name for c in clusters]
        if len(set(names)) != len(names) or not clusters:
            raise ConfigError(f"cluster names must be unique and at least one given, got {names}")
        if not owners:
            raise ConfigError("at least one owner is needed")
        self.config = config
        self.clusters = {c.name: c for c in clusters}
        self.backend_factory = backend_factory
        self.owners = dict(owners)
        self.engines: dict[str, object] = {}
        self.engine_cluster: dict[str, str] = {}
        self.required: set[str] = set()
        self.heads: dict[str, object] = {}
        self.relays: dict[str, object] = {}
        self.commits = CommitLog(config.commit_dir)
        self.version = 0
        self._lock = threading.Lock()
        self._started = False
        self.history: list[dict] = []

    # -- start-up ---------------------------------------------------------------------------------
    def start(self) -> dict:
        """Create engines and relays, attach owners, write record v0, bootstrap every engine."""
        with self._lock:
            if self._started:
                return self.status()
            cfg = self.config
            Engine = ray.remote(EngineActor)
            Relay = ray.remote(RelayActor)
            for c in self.clusters.values():
                ids = [f"{c.name}/e{i}" for i in range(c.engines)]
                for eid in ids:
                    self.engines[eid] = Engine.options(
                        **actor_options("engine", f"dcr_engine:{eid}", resources=c.resources)
                    ).remote(eid, c.name, self.backend_factory, cfg, link_mbps=c.link_mbps,
                             link_latency_s=c.link_latency_s)
                    self.engine_cluster[eid] = c.name
                tree = plan_tree(c.name, ids, c.fanout)
                made = {}
                for node in tree.walk():
                    head = node is tree
                    made[node.relay_id] = Relay.options(
                        **actor_options("relay", f"dcr_relay:{node.relay_id}", resources=c.resources)
                    ).remote(node.relay_id, c.name, head=head,
                             link_mbps=c.link_mbps if head else None,
                             link_latency_s=c.link_latency_s if head else 0.0)
                for node in tree.walk():
                    kids = [("engine", self.engines[e], [e]) for e in node.engines]
                    kids += [("relay", made[s.relay_id], s.all_engines()) for s in node.subrelays]
                    made[node.relay_id].set_children.remote(kids)
                self.relays.update(made)
                self.heads[c.name] = made[tree.relay_id]
            t = cfg.stage_timeout_s
            specs = self._get({o: h.dcr_attach.remote(o, cfg) for o, h in self.owners.items()}, t, "attach")
            self._check_coverage(specs)
            rec = self.commits.read()
            if rec is None:
                self.commits.compare_and_set(None, CommitRecord(version=0, transfer="attach", baseline="",
                                                                members=sorted(self.engines)))
            elif rec.version != 0:
                raise ConfigError(
                    f"commit_dir {cfg.commit_dir} already holds version {rec.version}; owners start "
                    f"at version 0: use a fresh commit_dir"
                )
            self.version = 0
            self._bootstrap(list(self.engines))
            self._started = True
            return self.status()

    def _check_coverage(self, owner_specs: dict[str, dict]) -> None:
        union: dict[str, tuple] = {}
        for o, specs in owner_specs.items():
            for n, s in specs.items():
                if n in union:
                    raise ConfigError(f"tensor {n!r} has two owners ({o} and another): each canonical "
                                      f"element needs exactly one owner (see dcr_ray.owned_names)")
                union[n] = (s[0], tuple(s[1]))
        eng_specs = ray.get(next(iter(self.engines.values())).call_backend.remote("tensor_specs"),
                            timeout=self.config.stage_timeout_s)
        eng = {n: (s[0], tuple(s[1])) for n, s in eng_specs.items()}
        missing = sorted(set(eng) - set(union))
        extra = sorted(set(union) - set(eng))
        bad = sorted(n for n in set(eng) & set(union) if eng[n] != union[n])
        if missing or extra or bad:
            raise ConfigError(
                "owners and engines disagree on the canonical tensors: "
                f"no owner for {missing[:5]}{'...' if len(missing) > 5 else ''}; "
                f"unknown to engines {extra[:5]}; dtype/shape differ for "
                f"{[(n, union[n], eng[n]) for n in bad[:3]]}"
            )

    def _sink(self, targets: list[str] | None) -> dict:
        if self.config.transport == "relay":
            heads = [self.heads[c] for c in self.clusters
                     if targets is None or any(self.engine_cluster[e] == c for e in targets)]
            return {"kind": "relay", "heads": heads, "targets": targets}
        engines = [self.engines[e] for e in (targets or sorted(self.required))]
        return {"kind": "object_store", "url": self.config.storage_url, "engines": engines, "targets": targets}

    def _bootstrap(self, engine_ids: list[str]) -> None:
        """Dense refit of ``engine_ids`` to the committed version (joining engines)."""
        t = self.config.stage_timeout_s
        transfer = f"boot{self.version}-{uuid.uuid4().hex[:8]}"
        try:
            self._get({e: self.engines[e].prepare.remote(transfer, 0, BOOTSTRAP_BASE, self.version)
                       for e in engine_ids}, t, "bootstrap prepare")
            sink = self._sink(engine_ids)
            sums = self._get({o: h.dcr_bootstrap.remote(transfer, sink) for o, h in self.owners.items()}, t,
                             "bootstrap stream")
            keys = [k for s in sums.values() for k in s["payloads"]]
            self._get({e: self.engines[e].flush.remote(transfer, 0, keys, t) for e in engine_ids}, t,
                      "bootstrap flush")
            self._get({e: self.engines[e].activate.remote(self.version, transfer) for e in engine_ids}, t,
                      "bootstrap activate")
        except BaseException:
            # engines a failed bootstrap wrote into hold no version until a later bootstrap succeeds
            for e in engine_ids:
                self.engines[e].abort.remote(transfer, True)
            self._release(transfer)
            raise
        self._release(transfer)
        self.required |= set(engine_ids)
        log.info("dcr_ray: bootstrapped %d engines densely at version %d", len(engine_ids), self.version)

    # -- helpers ----------------------------------------------------------------------------------
    def _gather(self, calls: dict, timeout: float, stage: str) -> tuple[dict, list, dict]:
        """``(results, dead ids, {id: error})`` of ``{id: ref}``, all waited for within ``timeout``."""
        deadline = time.monotonic() + timeout
        out, dead, errors = {}, [], {}
        for k, ref in calls.items():
            try:
                out[k] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except RayActorError:
                dead.append(k)
            except GetTimeoutError:
                errors[k] = RefitTimeoutError(f"stage '{stage}': {k} did not answer within {timeout:.0f} s")
            except DcrError as e:
                errors[k] = e
            except ray.exceptions.RayTaskError as e:
                cause = e.as_instanceof_cause()
                errors[k] = cause if isinstance(cause, DcrError) else RefitError(f"{stage}: {k}: {e}")
        return out, dead, errors

    def _get(self, calls: dict, timeout: float, stage: str) -> dict:
        """Results of ``{id: ref}``; dead actors raise :class:`_Dead`, others the first error."""
        out, dead, errors = self._gather(calls, timeout, stage)
        if dead:
            raise _Dead(dead)
        if errors:
            raise next(iter(errors.values()))
        return out

    def _release(self, transfer: str) -> None:
        for r in self.relays.values():
            r.release.remote(transfer)
        if self.config.transport == "object_store":
            fs, root = storage_fs(self.config.storage_url, self.config.storage_options)
            try:
                fs.rm(f"{root}/{transfer}", recursive=True)
            except FileNotFoundError:
                pass

    # -- one refit ----------------------------------------------------------------------------------
    def refit(self) -> RefitReport:
        """Move the owners' current tensors to every required engine as version v+1 and commit."""
        with self._lock:
            if not self._started:
                raise RefitError("the coordinator was not started; use dcr_ray.launch(...)")
            t_start = time.perf_counter()
            base, target = self.version, self.version + 1
            transfer = f"v{target}-{uuid.uuid4().hex[:8]}"
            last: Exception | None = None
            dropped: list[str] = []
            for attempt in range(self.config.max_attempts):
                if not self.required:
                    last = RefitError("no required engine is alive")
                    break
                try:
                    report = self._attempt(transfer, attempt, base, target, t_start)
                    report.dropped_engines = dropped
                    return report
                except _Dead as d:
                    gone = [x for x in d.ids if x in self.engines]
                    if len(gone) < len(d.ids):  # an owner died: its data is gone, cannot continue
                        last = RefitError(f"owner actor(s) died: {[x for x in d.ids if x not in gone]}")
                        break
                    self.required -= set(gone)
                    dropped += gone
                    last = RefitError(f"engines died: {gone}")
                    log.warning("dcr_ray: %s died; retrying without them", gone)
                except DcrError as e:
                    last = e
                    log.warning("dcr_ray: attempt %d of %s failed: %s", attempt, transfer, e)
                    if isinstance(e, (BaselineError, ConfigError)):
                        break  # an owner's committed state or the setup is wrong: retrying cannot help
                metrics.record("refit_retries")
                self._abort(transfer)
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
        self._release(transfer)
        dirty = []
        for e, ref in calls.items():
            try:
                if ray.get(ref, timeout=self.config.stage_timeout_s)["dirty"]:
                    dirty.append(e)
            except (RayActorError, GetTimeoutError):
                pass  # a dead or hung engine is dropped by the next refit's prepare
        return sorted(dirty)

    def _discard_pending(self) -> None:
        """Owners drop their pending changed sets (their baselines stay the committed bits)."""
        refs = [h.dcr_discard.remote() for h in self.owners.values()]
        try:
            ray.get(refs, timeout=self.config.stage_timeout_s)
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

    def _attempt(self, transfer: str, attempt: int, base: int, target: int, t_start: float) -> RefitReport:
        t = self.config.stage_timeout_s
        req = sorted(self.required)
        t0 = time.perf_counter()
        self._get({e: self.engines[e].prepare.remote(transfer, attempt, base, target) for e in req}, t,
                  "prepare")
        t1 = time.perf_counter()
        sink = self._sink(None)
        sums = self._get({o: h.dcr_stream.remote(transfer, attempt, base, target, sink)
                          for o, h in self.owners.items()}, t, "stream")
        keys = [k for s in sums.values() for k in s["payloads"]]
        acks = self._get({e: self.engines[e].flush.remote(transfer, attempt, keys, t) for e in req}, t,
                         "flush")
        t2 = time.perf_counter()
        self.commits.compare_and_set(base, CommitRecord(version=target, transfer=transfer,
                                                        baseline=self._last_transfer(), members=req))
        t_rec = time.perf_counter()
        # Committed: v+1 is durable. From here on roll forward (never retry, never abort): a failure
        # now takes the failing actor out of service and is reported, the version stays v+1.
        self.version = target
        warnings = []
        _, dead, errors = self._gather({o: h.dcr_promote.remote(target) for o, h in self.owners.items()},
                                       t, "promote")
        if dead or errors:
            bad = sorted({*dead, *errors})
            why = "; ".join(f"{o}: {e}" for o, e in errors.items()) or "actor died"
            warnings.append(f"owner(s) {bad} did not promote their baseline to v{target} ({why}); their "
                            f"next stream is refused until the topology is relaunched")
        t_pro = time.perf_counter()
        versions, dead, errors = self._gather(
            {e: self.engines[e].activate.remote(target, transfer) for e in req}, t, "activate")
        if dead or errors:
            bad = sorted({*dead, *errors})
            self.required -= set(bad)
            warnings.append(f"engine(s) {bad} did not activate v{target} and left the required set; "
                            f"Refit.rejoin(engine_id) restores each")
        for w in warnings:
            log.warning("dcr_ray: %s", w)
        t_act = time.perf_counter()
        try:
            link = self._link_bytes(transfer, acks)
        except (RayActorError, GetTimeoutError) as e:  # statistics only: the refit is committed
            link = {}
            warnings.append(f"link byte counts unavailable: {type(e).__name__}")
        self._release(transfer)
        t3 = time.perf_counter()
        construct = max(s["construct_s"] for s in sums.values())
        stream = t2 - t1
        report = RefitReport(
            version=target, transfer=transfer, attempts=attempt + 1,
            seconds={"prepare": t1 - t0, "construct": construct, "stream": stream,
                     "transport": max(0.0, stream - max(0.0, construct - max(s["send_wait_s"] for s in sums.values()))),
                     "apply": max(a["apply_s"] for a in acks.values()), "commit": t3 - t2,
                     "commit_record": t_rec - t2, "promote": t_pro - t_rec, "activate": t_act - t_pro,
                     "total": t3 - t_start},
            payloads=len(keys), wire_bytes=sum(s["wire_bytes"] for s in sums.values()), link_bytes=link,
            changed=sum(s["changed"] for s in sums.values()), numel=sum(s["numel"] for s in sums.values()),
            engine_versions=versions, mode=next(iter(sums.values()))["mode"], warnings=warnings,
        )
        self.history.append(report.to_dict())
        metrics.record("refit_seconds", report.seconds["total"])
        metrics.record("refit_wire", report.wire_bytes)
        metrics.record("refit_changed", report.changed)
        metrics.record("version", target)
        return report

    def _last_transfer(self) -> str:
        rec = self.commits.read()
        return rec.transfer if rec else ""

    def _link_bytes(self, transfer: str, acks: dict) -> dict:
        if self.config.transport == "relay":
            stats = ray.get([self.heads[c].stats.remote() for c in self.clusters], timeout=self.config.stage_timeout_s)
            return {s["cluster"]: s["bytes_in"].get(transfer, 0) for s in stats}
        out = {c: 0 for c in self.clusters}
        for a in acks.values():
            out[a["cluster"]] += a["bytes"]
        return out

    # -- membership & inspection ------------------------------------------------------------------
    def rejoin(self, engine_id: str) -> dict:
        """Bring an engine (new or fallen out of the required set) back by dense bootstrap."""
        with self._lock:
            if engine_id not in self.engines:
                raise ConfigError(f"unknown engine {engine_id!r}; known: {sorted(self.engines)}")
            self._bootstrap([engine_id])
            return self.status()

    def status(self) -> dict:
        return {"version": self.version, "required": sorted(self.required), "engines": sorted(self.engines),
                "owners": sorted(self.owners), "clusters": list(self.clusters),
                "transport": self.config.transport, "commit_record": self.commits.read().__repr__()}

    def handles(self) -> dict:
        """Actor handles: ``{"engines": {id: h}, "owners": {id: h}, "relays": {id: h}}``."""
        return {"engines": dict(self.engines), "owners": dict(self.owners), "relays": dict(self.relays)}

    def relay_stats(self) -> list[dict]:
        return ray.get([r.stats.remote() for r in self.relays.values()], timeout=self.config.stage_timeout_s)

    def reports(self) -> list[dict]:
        return list(self.history)
