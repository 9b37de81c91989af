"""Starting a topology: :func:`launch` checks every setting before any actor is spawned, starts the
coordinator (which starts the engines and the transport, attaches the owners and bootstraps every engine),
waits for it within ``CommitConfig.start_timeout_s``, and removes everything it created when that fails. It
returns the :class:`~dcr_ray.api.Refit` handle; ``launch(..., resume=True)`` carries on with a topology whose
coordinator died for good.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Mapping

import ray
import torch

from dcr_ray import progress
from dcr_ray.actors.coordinator.actor import CoordinatorActor
from dcr_ray.actors.fleet.inputs import write_inputs
from dcr_ray.actors.fleet.nodes import capacity
from dcr_ray.actors.fleet.placement import bundle
from dcr_ray.actors.owner.held import StandaloneOwner, check_owner
from dcr_ray.api import Refit
from dcr_ray.config import ClusterSpec, RefitConfig, validate
from dcr_ray.engines.base import EngineBackend
from dcr_ray.errors import ConfigError, RefitTimeoutError
from dcr_ray.named_actors import TOPOLOGY_PREFIXES, coordinator_exists, kill_named, named
from dcr_ray.options import COORDINATOR_NAME, OWNER_PREFIX
from dcr_ray.options import actor_options as ray_options  # launch's actor_options parameter shadows the name
from dcr_ray.refit_call import remember_topology, warm
from dcr_ray.relay.transport import Transport

log = logging.getLogger(__name__)


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
