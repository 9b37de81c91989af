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


def actor_options(kind: str, name: str | None = None, *, resources: dict | None = None,
                  num_cpus: float = 0, detached: bool = False, namespace: str = NAMESPACE, **extra) -> dict:
    """Ray ``.options(...)`` for an actor of ``kind`` (coordinator, owner, relay, engine) in ``namespace``."""
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
