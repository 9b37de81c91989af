"""The driver-facing API: :func:`launch` a refit topology and get a :class:`Refit` handle.

::

    import ray, dcr_ray
    refit = dcr_ray.launch(
        owners=[trainer0, trainer1],                     # actors with dcr_ray.OwnerMixin
        clusters=[dcr_ray.ClusterSpec(name="us-east", engines=2),
                  dcr_ray.ClusterSpec(name="eu-west", engines=2)],
        engine=dcr_ray.HFEngine("/path/to/hf_checkpoint"),
    )
    ...                                                  # optimizer step on the trainers
    report = ray.get(refit.remote())                    # every engine now holds the new bits
    print(report)

``Refit`` is a thin public class over the private coordinator actor (named
:data:`~dcr_ray.options.COORDINATOR_NAME` in the topology's namespace, :attr:`RefitConfig.namespace
<dcr_ray.config.RefitConfig.namespace>`, :data:`~dcr_ray.options.NAMESPACE` by default), so
``Refit.get(namespace=...)`` finds it from any driver, and the Ray dashboard shows it with its owners,
relays and engines. Two topologies share one Ray cluster under two namespaces
(``RefitConfig(namespace="reward")``).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Callable, Mapping

import ray
import torch

from dcr_ray import progress
from dcr_ray.actors.coordinator.actor import CoordinatorActor
from dcr_ray.actors.fleet.inputs import write_inputs
from dcr_ray.actors.fleet.nodes import capacity
from dcr_ray.actors.fleet.placement import bundle
from dcr_ray.actors.owner.held import StandaloneOwner, check_owner
from dcr_ray.config import ClusterSpec, RefitConfig, validate
from dcr_ray.engines.base import EngineBackend
from dcr_ray.errors import ConfigError, RefitError, RefitTimeoutError
from dcr_ray.named_actors import (TOPOLOGY_PREFIXES, coordinator_exists, kill_named, named,
                                  remove_placement_groups)
from dcr_ray.options import COORDINATOR_NAME, NAMESPACE, OWNER_PREFIX
from dcr_ray.refit_call import (answer_refit, coordinator_gone, forget_topology, remember_topology,
                                topology_commit_dir, warm)
from dcr_ray.options import actor_options as ray_options  # launch's actor_options parameter shadows the name
from dcr_ray.relay.transport import Transport
from dcr_ray.report import RefitReport

log = logging.getLogger(__name__)


class Refit:
    """Handle of a running dcr_ray topology.

    ``refit.remote()`` starts a refit and returns an ObjectRef of its :class:`RefitReport` (it
    resolves only after the commit record is written; otherwise ``ray.get`` raises ``RefitError``).
    :meth:`run` is the blocking shortcut.
    """

    def __init__(self, actor, namespace: str = NAMESPACE, commit_dir: str | None = None):
        self._actor = actor
        self.namespace = namespace
        self._commit_dir = commit_dir

    @classmethod
    def get(cls, namespace: str = NAMESPACE) -> "Refit":
        """The topology launched earlier in this Ray cluster (by any driver) in ``namespace``.

        When no coordinator answers there: :class:`~dcr_ray.errors.CoordinatorGoneError` if a topology
        was launched there and not shut down (its coordinator died for good; the error names the version
        the commit record holds and the ``launch(..., resume=True)`` call that carries on), else
        :class:`~dcr_ray.errors.ConfigError`. Both are ``ValueError``\ s."""
        commit_dir = topology_commit_dir(namespace)
        try:
            actor = ray.get_actor(COORDINATOR_NAME, namespace=namespace)
        except ValueError:
            if commit_dir is not None:
                raise coordinator_gone(namespace, commit_dir) from None
            raise ConfigError(f"no dcr_ray topology runs in namespace {namespace!r} of this Ray cluster: start one "
                              f"with dcr_ray.launch(..., config=RefitConfig(namespace={namespace!r}))") from None
        return cls(actor, namespace, commit_dir)

    def remote(self) -> ray.ObjectRef:
        """Start a refit; returns the ObjectRef of its :class:`RefitReport` (``ray.get`` it).

        The call carries a fresh request id. If the coordinator's process dies during the refit, Ray
        restarts it and retries the call: a refit whose commit record was already written is answered
        from the record (with a warning), one that had not committed runs again on the resumed
        coordinator. Either way the answer is a report or a :class:`~dcr_ray.errors.RefitError`; a
        coordinator gone for good answers :class:`~dcr_ray.errors.CoordinatorGoneError`, naming the
        version its record holds and how to resume (:mod:`~dcr_ray.refit_call`).
        """
        return self._call(uuid.uuid4().hex)

    def _call(self, request: str) -> ray.ObjectRef:
        return answer_refit.remote(self.namespace, request, REFIT_CALL_RETRIES, self._commit_dir)

    @property
    def actor(self):
        """The coordinator actor handle."""
        return self._actor

    def run(self, timeout: float | None = None) -> RefitReport:
        """Refit now and wait for the report (with a progress bar on a terminal, see :mod:`dcr_ray.progress`).

        If the coordinator stays unavailable past Ray's retries of the call (it is restarting), the same
        request is sent again once it answers: answered from the record if it committed, run if not."""
        request = uuid.uuid4().hex
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in range(REFIT_CALL_RETRIES):
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                return progress.wait(self._call(request), self._actor, desc="dcr_ray refit", timeout=left)
            except ray.exceptions.ActorUnavailableError:
                time.sleep(_RESTART_POLL_S)  # restarting: the record still says whether the request committed
        return progress.wait(self._call(request), self._actor, desc="dcr_ray refit", timeout=timeout)

    def status(self, detail: bool = False) -> dict:
        """The committed version and record, required engines and the refit in flight (``phase``); with
        ``detail``, also each engine's version and state, relays per cluster and the last refits (what
        ``dcr-ray status`` prints). While the coordinator restarts, it waits for the resumed one."""
        return self._read("status", detail)

    def engines(self) -> dict:
        """Engine id -> engine actor handle."""
        return self._read("handles")["engines"]

    def owners(self) -> dict:
        return self._read("handles")["owners"]

    def relay_stats(self) -> list[dict]:
        return self._read("relay_stats")

    def _read(self, method: str, *args):
        """A call that only reads the coordinator's state. While Ray restarts the coordinator (it answers
        "temporarily unavailable") the call is made again, for up to :data:`_RESTART_WAIT_S`: reading twice
        changes nothing. Calls that change the topology are not repeated (the first may have run)."""
        deadline = time.monotonic() + _RESTART_WAIT_S
        while True:
            try:
                return ray.get(getattr(self._actor, method).remote(*args))
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(_RESTART_POLL_S)

    def rejoin(self, engine_id: str) -> dict:
        """Bring ``engine_id`` to the committed version now (by the deltas it missed, else from a peer, else
        densely from the owners: see :mod:`~dcr_ray.actors.recovery.healing`) and add it to the required set;
        re-created first if its actor died."""
        return ray.get(self._actor.rejoin.remote(engine_id))

    def drain(self, engine_id: str) -> dict:
        """Take ``engine_id`` out of the refits between two of them, with nothing scheduled (maintenance, a
        user's engine lent elsewhere for a while): it keeps serving the version it holds and misses every
        refit until :meth:`rejoin` brings it to the committed version (by the deltas it missed, where its
        cluster's window still holds them). Returns ``status()``; ``ConfigError`` for an engine that is not
        required now."""
        return ray.get(self._actor.drain.remote(engine_id))

    def invalidate(self, engine_id: str, why: str = "changed outside dcr_ray") -> dict:
        """Tell dcr_ray that ``engine_id``'s weights changed outside it (a vLLM sleep at level 2 discarded
        them, a reload from disk, a manual edit): no delta may build on them. The engine leaves the
        required set, holds no version, and heals now: it rejoins without frames if its served bits still
        have the committed digests, else from a peer, else densely from the owners. Returns ``status()``."""
        return ray.get(self._actor.invalidate.remote(engine_id, why))

    def wait_healed(self, timeout: float = 600.0, poll_s: float = 0.5) -> dict:
        """Wait until no engine is healing in the background (dead, evicted or joining engines heal while
        refits go on); returns the final ``status()``. Raises :class:`~dcr_ray.errors.RefitError` naming
        the engines whose healing failed (``rejoin`` retries one), and
        :class:`~dcr_ray.errors.RefitTimeoutError` past ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            failed = {e: r["error"] for e, r in st["healing"].items() if r["standing"] == "failed"}
            if failed:
                raise RefitError(f"healing failed for {sorted(failed)}: {failed}; Refit.rejoin(engine_id) retries")
            if not st["healing"]:
                return st
            if time.monotonic() > deadline:
                raise RefitTimeoutError(f"engines {sorted(st['healing'])} still heal after {timeout:.0f} s: "
                                        f"{st['healing']}")
            time.sleep(poll_s)

    def replace_owner(self, owner_id: str, handle) -> dict:
        """Attach ``handle`` in place of owner ``owner_id`` (e.g. one that died), without relaunching.

        It must cover what ``owner_id`` covered and hold the committed version's bits (checked by digest
        against an engine); otherwise ``ConfigError`` and nothing changes.
        """
        return ray.get(self._actor.replace_owner.remote(owner_id, handle))

    def shutdown(self, force: bool = False) -> None:
        """Kill the coordinator, engines and relays and remove their placement groups; also the owners
        ``launch(owner_tensors=...)`` made (owners given by the caller are left alone). Ray keeps an actor
        alive while any handle to it may be in use, and the handles of owners given to ``launch`` reached
        the detached coordinator: Ray keeps them alive for as long as this driver runs. A driver that
        launches again with new trainer actors should ``ray.kill`` the old ones.

        Engines and relays outlive the coordinator (they are detached), so this also works when the
        coordinator already died: it then finds them (and their placement groups) by name.
        ``force=True`` does not ask the coordinator first (it may be stuck in a long call): the
        topology's actors and placement groups are removed by name at once.
        """
        self._shutdown(force=force)

    def _shutdown(self, keep: set[str] = frozenset(), force: bool = False) -> None:
        """:meth:`shutdown`, sparing the engine and relay names in ``keep`` (those of another topology)."""
        ns = self.namespace
        try:
            if force:
                raise ray.exceptions.GetTimeoutError("shutdown(force=True)")
            ray.get(self._actor.teardown.remote(), timeout=_SHUTDOWN_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            kill_named(TOPOLOGY_PREFIXES, keep=keep, namespace=ns)
            remove_placement_groups(ns)
        kill_named((OWNER_PREFIX,), namespace=ns)  # the owners launch(owner_tensors=...) made (detached)
        ray.kill(self._actor, no_restart=True)
        forget_topology(ns)


def launch(
    *,
    clusters: list[ClusterSpec],
    engine: Callable[[], EngineBackend] | None = None,
    owners: Mapping[str, object] | list | None = None,
    owner_tensors: list[Mapping[str, torch.Tensor]] | None = None,
    config: RefitConfig | None = None,
    transport: Transport | None = None,
    resume: bool = False,
) -> Refit:
    """Start a topology: coordinator, engines per cluster, the transport; attach owners; bootstrap.

    Owners come either as ``owners`` (handles of trainer actors that hold a :class:`dcr_ray.Owner` or whose
    class mixes in :class:`dcr_ray.OwnerMixin`; a dict names them, a list names them ``owner0``, ...) or as
    ``owner_tensors`` (one ``{name: tensor}`` dict per standalone owner actor to create). ``engine`` builds
    one backend in each engine actor dcr_ray starts (:class:`~dcr_ray.engines.HFEngine`,
    :class:`~dcr_ray.engines.VllmEngine`); engines of other systems join through ``ClusterSpec(adopt=[...])``.
    ``transport`` replaces the one ``config.transport`` names (e.g. a wrapped one that emulates slow links in
    benchmarks).

    Every other setting has one home, ``config`` (:class:`~dcr_ray.config.RefitConfig`): the Ray namespace
    of the topology (``RefitConfig.namespace``: one topology per namespace; a second one, a reward model
    or another experiment, shares the Ray cluster under another namespace, and ``Refit.get(namespace=...)``
    reaches each), Ray actor options per kind of actor, the coordinator's resources among them
    (``RefitConfig.actor_options={"coordinator": {"resources": {...}}}``), and the bound on the whole
    launch (``CommitConfig.start_timeout_s``: placement, start-up, attach, dense bootstrap).

    Everything is checked before any actor is spawned: a bad set-up raises :class:`ConfigError` and
    leaves nothing behind; a launch that fails or runs past its bound removes everything it created and
    raises (:class:`~dcr_ray.errors.RefitTimeoutError` for the bound).

    ``resume=True`` carries on with a topology whose coordinator died for good (killed, or its node
    lost): give the same clusters, engine, owners and ``CommitConfig.dir``; the new coordinator reads
    the commit record, finds the live engines and relays by name, settles the open transition and
    continues at the committed version. (A coordinator that merely crashed is restarted by Ray and
    resumes by itself.)
    """
    config, owners = _checked(clusters, engine, owners, owner_tensors, config, resume)
    ns = config.namespace
    foreign = named(TOPOLOGY_PREFIXES, ns)  # a failed launch must not sweep another topology's actors
    if owner_tensors is not None:
        owners = _standalone_owners(owner_tensors, config)
    refit = _start_coordinator(config, clusters, engine, owners, transport)
    answers_ready = warm.remote(ns)  # a worker for refit.remote()'s calls, ready while the topology starts
    try:
        _wait_started(refit, resume, config.commit.start_timeout_s)
    except BaseException:
        _undo(refit, resume, foreign)
        raise
    remember_topology(ns, config.commit.dir)
    del answers_ready
    return refit


def _checked(clusters, engine, owners, owner_tensors, config, resume) -> tuple[RefitConfig, dict | None]:
    """Every check of a launch, before anything is spawned: ``(validated config, owners by id)``."""
    if not ray.is_initialized():
        raise ConfigError("call ray.init() first (dcr_ray runs in your Ray cluster)")
    if (owners is None) == (owner_tensors is None):
        raise ConfigError("give owners=[actor handles] or owner_tensors=[{name: tensor}, ...] (one of them)")
    if isinstance(owners, (list, tuple)):
        owners = {f"owner{i}": h for i, h in enumerate(owners)}
    if resume and (config is None or config.commit.dir is None or owner_tensors is not None):
        raise ConfigError("resume=True needs the running owners (owners=...) and the commit directory of the "
                          "topology to resume: RefitConfig(commit=CommitConfig(dir=...))")
    planned = owners if owners is not None else {f"owner{i}": StandaloneOwner for i in range(len(owner_tensors))}
    default_dir = config is None or config.commit.dir is None
    config = validate(config or RefitConfig(), clusters, planned, engine)
    seen: dict = {}
    for oid, h in (owners or {}).items():
        if h in seen.values():  # actor handles compare by actor
            other = next(o for o, x in seen.items() if x == h)
            raise ConfigError(f"owners {other!r} and {oid!r} are the same actor: give each rank's actor once")
        seen[oid] = h
    for oid, h in (owners or {}).items():
        check_owner(oid, h, config.commit.timeout_s)
    ns = config.namespace
    coordinator = config.actor_options.get("coordinator", {}).get("resources", {})
    _check_placeable(coordinator)
    _check_clusters(clusters)
    if default_dir:
        _check_commit_dir(config, coordinator)
    if coordinator_exists(ns):
        raise ConfigError(f"a dcr_ray coordinator ({COORDINATOR_NAME!r}) already runs in namespace {ns!r} of this "
                          f"Ray cluster; use dcr_ray.Refit.get(namespace={ns!r}) to reach it, or its shutdown() "
                          f"first, or launch this topology in another namespace (RefitConfig(namespace=...))")
    if owner_tensors is not None and named((OWNER_PREFIX,), ns):
        raise ConfigError(f"owner actors {sorted(named((OWNER_PREFIX,), ns))} of an earlier "
                          f"launch(owner_tensors=...) still run in namespace {ns!r} without a coordinator: kill "
                          f"them (ray.kill(ray.get_actor(name, namespace={ns!r}))) or resume that topology "
                          f"with launch(owners=..., resume=True)")
    return config, owners


def _standalone_owners(owner_tensors, config: RefitConfig) -> dict:
    """Owner actors holding ``owner_tensors``: detached and named, like engines and relays, so they outlive
    the driver's handles and a coordinator restart."""
    Owner = ray.remote(StandaloneOwner)
    return {f"owner{i}": Owner.options(**ray_options("owner", f"{OWNER_PREFIX}owner{i}", detached=True,
                                                       namespace=config.namespace,
                                                       user=config.actor_options)).remote(t)
            for i, t in enumerate(owner_tensors)}


def _start_coordinator(config: RefitConfig, clusters, engine, owners, transport) -> "Refit":
    """The coordinator actor, detached and restarted by Ray when its process dies (it resumes from the
    commit record). It is built from what ``write_inputs`` keeps beside the record, so a restart needs
    nothing from the object store."""
    write_inputs(config.commit.dir, config=config, clusters=clusters, backend_factory=engine, owners=owners,
                 transport=transport)
    Coordinator = ray.remote(CoordinatorActor)
    actor = Coordinator.options(**ray_options("coordinator", COORDINATOR_NAME, detached=True, max_restarts=-1,
                                                namespace=config.namespace, user=config.actor_options)).remote(
        config.commit.dir)
    log.info("starting %d engines in %d clusters, %d owners, transport=%s; dense bootstrap...",
             sum(c.started + len(c.adopt) for c in clusters), len(clusters), len(owners), config.transport.kind)
    return Refit(actor, config.namespace, config.commit.dir)


def _wait_started(refit: "Refit", resume: bool, limit: float) -> None:
    """Start (or resume) the topology, with a progress bar; :class:`RefitTimeoutError` past ``limit``."""
    actor = refit.actor
    try:
        progress.wait(actor.start.remote(resume), actor, desc="dcr_ray launch", timeout=limit)
    except ray.exceptions.GetTimeoutError:
        raise RefitTimeoutError(
            f"launch did not finish within {limit:.0f} s (placement, start-up and dense bootstrap; "
            f"{_where(actor)}); everything it created was removed. Check that the cluster can place the "
            f"coordinator, engines and relays (`ray status`), or raise CommitConfig.start_timeout_s for a "
            f"large model") from None


def _undo(refit: "Refit", resume: bool, foreign: set[str]) -> None:
    """A launch that failed leaves nothing behind (a resume leaves the topology as it was, without this
    coordinator). A start cut off by its bound may still create engines or relays until the coordinator
    is dead: their names are swept once more after it is (detached actors claim their names when created)."""
    if resume:
        ray.kill(refit.actor, no_restart=True)
        return
    ns = refit.namespace
    refit._shutdown(keep=foreign)
    deadline = time.monotonic() + _SWEEP_WAIT_S
    while coordinator_exists(ns) and time.monotonic() < deadline:
        time.sleep(0.1)
    kill_named(TOPOLOGY_PREFIXES, keep=foreign, namespace=ns)


def _where(actor) -> str:
    """Where a coordinator's start stands, for the error of a launch past its timeout: its phase, for how
    long, and the payloads each engine applied in it (``progress()``, which answers without the lock)."""
    try:
        p = ray.get(actor.progress.remote(), timeout=_WHERE_TIMEOUT_S)
    except Exception as e:  # a coordinator that cannot answer is itself the news
        return f"the coordinator did not say where it was: {type(e).__name__}"
    phase = p["phase"]
    if phase.get("phase") == "idle":  # start() has not reached its first step (the actor was still starting)
        return "the coordinator had not begun to start the topology"
    since = time.time() - phase["since"] if phase.get("since") else None
    where = f"the coordinator was in phase {phase.get('phase')!r}"
    if since is not None:
        where += f" for {since:.0f} s"
    if p.get("engines"):
        where += ", engines' applied payloads " + ", ".join(f"{e}: {n}" for e, n in sorted(p["engines"].items()))
    return where


#: How long a timed-out launch waits for its coordinator to say where it was.
_WHERE_TIMEOUT_S = 10.0
#: How often Ray re-sends a ``refit`` call to a coordinator restarted after its process died.
REFIT_CALL_RETRIES = 10
#: How long ``Refit.run`` and the reading calls wait before asking a restarting coordinator again.
_RESTART_POLL_S = 1.0
#: How long the reading calls (``status``, ``engines``, ``wait_healed``...) wait for a restarting coordinator.
_RESTART_WAIT_S = 120.0
#: How long shutdown waits for the coordinator to tear down before killing actors by name.
_SHUTDOWN_TIMEOUT_S = 120
#: How long a failed launch waits for its coordinator to be gone before the last sweep by name.
_SWEEP_WAIT_S = 10.0


def _check_clusters(clusters: list[ClusterSpec]) -> None:
    """Refuse, before anything is spawned, a cluster whose engines (or relays) no alive node can hold all of
    (Ray would hold the rest pending, and the launch would wait its whole bound)."""
    nodes = [n.get("Resources") or {} for n in ray.nodes() if n.get("Alive")]
    for c in clusters:
        asks = [(bundle(c), c.started, "engines")] if c.started else []
        asks.append((dict(c.resources), 1, "relays"))
        for needs, count, what in asks:
            room = capacity(nodes, needs)
            if room < count:
                have = sorted({k for r in nodes for k in r if not k.startswith("node:")})
                raise ConfigError(f"cluster {c.name!r}: the alive nodes hold {room} of its {count} {what} (each asks "
                                  f"{needs}; resources in this Ray cluster: {have}): start nodes with "
                                  f"ClusterSpec({c.name}).resources (e.g. `ray start --resources=...`), or lower "
                                  f"engines, gpus_per_engine or cpus_per_engine")


def _check_commit_dir(config: RefitConfig, coordinator: dict) -> None:
    """A commit directory left to its default lives on this machine's disk: refused on a multi-node Ray cluster
    unless the coordinator is pinned to this node (a coordinator placed or restarted elsewhere could not
    read its record)."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) <= 1:
        return
    here = ray.get_runtime_context().get_node_id()
    able = [n["NodeID"] for n in nodes
            if coordinator and all((n.get("Resources") or {}).get(k, 0) >= v for k, v in coordinator.items())]
    if able == [here]:
        return
    raise ConfigError(f"CommitConfig.dir defaults to a temporary directory on this machine ({config.commit.dir}), "
                      f"but this Ray cluster has {len(nodes)} nodes: a coordinator placed or restarted on another "
                      f"node could not read its commit record. Give CommitConfig(dir=...) a directory every node "
                      f"mounts, or pin the coordinator to this node with a resource only it offers "
                      f"(RefitConfig(actor_options={{'coordinator': {{'resources': {{...}}}}}}))")


def _check_placeable(resources: dict | None) -> None:
    """Refuse, before anything is spawned, coordinator resources that no alive node offers (the actor
    would wait for placement forever)."""
    if not resources:
        return
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if not any(all(r.get(k, 0) >= v for k, v in resources.items()) for r in nodes):
        have = sorted({k for r in nodes for k in r if not k.startswith("node:")})
        raise ConfigError(f"no alive node offers the coordinator's resources {resources} (RefitConfig.actor_options"
                          f"['coordinator']['resources']; resources in this cluster: {have}); give resources a "
                          f"node has, or start a node with them")
