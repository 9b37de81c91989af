"""Names and Ray options of every dcr_ray actor, built in one place.

The actors of one topology live in one Ray namespace (:attr:`~dcr_ray.config.RefitConfig.namespace`,
:data:`NAMESPACE` by default); the coordinator is the named actor :data:`COORDINATOR_NAME` in it
(``ray.get_actor(COORDINATOR_NAME, namespace=...)`` finds it, and the Ray dashboard lists it with its
owners, relays and engines under these names). Two topologies (a policy and a reward model, two
experiments) share one Ray cluster under two namespaces. Actors ask for no CPU by default: a refit is
mostly waiting and memory traffic, and on small machines whole CPUs per actor would leave them pending.
"""

from __future__ import annotations

NAMESPACE = "dcr_ray"
COORDINATOR_NAME = "dcr_coordinator"
#: Name prefix of the owner actors ``launch(owner_tensors=...)`` makes (detached: they outlive the driver).
OWNER_PREFIX = "dcr_owner:"
#: Concurrency of actors that serve calls while a long call (a refit, a flush wait) is running.
COORDINATOR_CONCURRENCY = 8
ENGINE_CONCURRENCY = 8
RELAY_CONCURRENCY = 16
OWNER_CONCURRENCY = 4


#: The kinds of actor a topology runs; ``RefitConfig(actor_options={kind: {...}})`` adds Ray options per kind.
ACTOR_KINDS = ("coordinator", "owner", "relay", "engine")
#: Ray actor options a user may add (``runtime_env``, ``num_cpus``, ``resources``, ...); dcr_ray sets the
#: rest itself, and each of those is refused with the reason (and the setting to use instead).
RESERVED_OPTIONS = {
    "name": "dcr_ray names every actor so that a restarted coordinator finds it again",
    "namespace": "give RefitConfig.namespace",
    "lifetime": "dcr_ray's actors are detached so that they outlive the driver and a coordinator restart",
    "get_if_exists": "a second topology under the same names is refused, not joined",
    "max_concurrency": "the refit protocol needs actors that answer while a long call runs",
    "concurrency_groups": "the refit protocol needs actors that answer while a long call runs",
    "max_restarts": "dcr_ray re-creates engines and relays itself, and Ray restarts the coordinator",
    "placement_group": "give ClusterSpec.placement",
    "placement_group_bundle_index": "give ClusterSpec.placement",
    "placement_group_capture_child_tasks": "give ClusterSpec.placement",
}
#: Options of engines that their cluster sets (they also size its placement bundles).
_ENGINE_FROM_CLUSTER = {"num_cpus": "ClusterSpec.cpus_per_engine", "num_gpus": "ClusterSpec.gpus_per_engine",
                        "scheduling_strategy": "ClusterSpec.placement / ClusterSpec.resources"}


def check_user_options(user) -> dict[str, dict]:
    """``RefitConfig(actor_options=...)`` checked and copied: ``{kind: {ray option: value}}`` with ``kind`` one of
    :data:`ACTOR_KINDS`. Raises :class:`~dcr_ray.errors.ConfigError` naming the fix, before anything starts."""
    from dcr_ray.errors import ConfigError

    if user is None:
        return {}
    if not isinstance(user, dict) or not all(k in ACTOR_KINDS and isinstance(v, dict) for k, v in user.items()):
        raise ConfigError(f"actor_options must map actor kinds {list(ACTOR_KINDS)} to Ray actor options, e.g. "
                          f"{{'engine': {{'runtime_env': {{'env_vars': {{...}}}}}}}}; got {user!r}")
    out = {}
    for kind, opts in user.items():
        for key in opts:
            why = RESERVED_OPTIONS.get(key) or (kind == "engine" and _ENGINE_FROM_CLUSTER.get(key)
                                                 and f"give {_ENGINE_FROM_CLUSTER[key]}")
            if why:
                raise ConfigError(f"actor_options[{kind!r}][{key!r}] is set by dcr_ray: {why}")
        _ray_checks(kind, opts)
        out[kind] = dict(opts)
    return out


def _ray_checks(kind: str, opts: dict) -> None:
    """Ray's own checks of actor options (names and value types), run before any actor is spawned."""
    from dcr_ray.errors import ConfigError

    try:
        from ray._common.ray_option_utils import validate_actor_options
    except ImportError:
        try:  # Ray up to 2.4x keeps them here
            from ray._private.ray_option_utils import validate_actor_options
        except ImportError:  # Ray moved its checks: each value is then checked when the actor starts
            return
    try:
        validate_actor_options(dict(opts), in_options=True)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"actor_options[{kind!r}]: {e}") from None


def actor_options(kind: str, name: str | None = None, *, resources: dict | None = None,
                  num_cpus: float = 0, detached: bool = False, namespace: str = NAMESPACE,
                  user: dict | None = None, **extra) -> dict:
    """Ray ``.options(...)`` for an actor of ``kind`` (coordinator, owner, relay, engine) in ``namespace``.

    ``user`` is the checked ``RefitConfig(actor_options=...)`` of every kind (see :func:`check_user_options`):
    its options for ``kind`` are added last, its ``resources`` merged into the ones dcr_ray pins."""
    conc = {"coordinator": COORDINATOR_CONCURRENCY, "engine": ENGINE_CONCURRENCY,
            "relay": RELAY_CONCURRENCY, "owner": OWNER_CONCURRENCY}[kind]
    opts = dict(num_cpus=num_cpus, max_concurrency=conc, namespace=namespace, max_restarts=0)
    if name is not None:
        opts["name"] = name
    if resources:
        opts["resources"] = dict(resources)
    if detached:
        opts["lifetime"] = "detached"
    opts.update(extra)
    mine = dict((user or {}).get(kind, {}))
    if mine.get("resources"):
        opts["resources"] = {**opts.get("resources", {}), **mine.pop("resources")}
    opts.update(mine)
    return opts


#: How long creating a named actor waits for the name of one that just died to be released.
NAME_RELEASE_S = 10.0


def create_named(make, name: str, *, wait_s: float = NAME_RELEASE_S, namespace: str = NAMESPACE):
    """``make()`` (a named actor's ``.remote(...)``), retried while ``name`` is still taken: the name of an
    actor that just died is released shortly after its death. A name still taken after ``wait_s``
    belongs to a live actor of another topology: :class:`~dcr_ray.errors.ConfigError` says so."""
    import time

    from dcr_ray.errors import ConfigError

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return make()
        except ValueError:
            if time.monotonic() > deadline:
                raise ConfigError(f"an actor named {name!r} already runs in namespace {namespace!r}: another "
                                  f"topology is running there (reach it with dcr_ray.Refit.get(namespace="
                                  f"{namespace!r}), shut it down, launch(..., resume=True), or launch this one "
                                  f"in another namespace)") from None
            time.sleep(0.2)
