"""Arming failpoints in other processes: a running actor, or the next incarnation of a named one.

* :func:`arm_actor` / :func:`report_of` run :func:`~dcr_ray.failpoints.arm` / :func:`~dcr_ray.failpoints.report`
  inside an actor through Ray's ``__ray_call__`` (any actor: dcr_ray's, or a trainer that holds an owner).
* :func:`arm_next_start` leaves a plan in Ray's key-value store for the next start of the actor named
  ``name``: its constructor's :func:`started` takes it (and removes it, so the incarnation after that
  starts clean). Only processes whose environment sets ``DCR_RAY_FAILPOINTS`` (even to an empty plan)
  look, so a production start never asks the store.
"""

from __future__ import annotations

import json
import os

from dcr_ray.failpoints.plan import Fault, parse, text

#: Keyed by the actor's name alone: a Ray actor knows its name but not the namespace it was created in (its
#: runtime context names the job's), so a drill arms one topology's actors at a time.
_KV_KEY = "dcr_ray/failpoints/next/{name}"


def _arm_here(_actor, faults: list[Fault]) -> bool:
    from dcr_ray import failpoints

    failpoints.arm(faults)
    return True


def _report_here(_actor, disarm: bool) -> dict:
    from dcr_ray import failpoints

    return failpoints.disarm() if disarm else failpoints.report()


def arm_actor(handle, faults: list[Fault] | str, timeout_s: float = 60.0) -> None:
    """Arm ``faults`` (or their text form) in the process of the actor ``handle``, replacing what it had
    armed (an empty plan: only count hits)."""
    import ray

    plan = parse(faults) if isinstance(faults, str) else list(faults)
    ray.get(handle.__ray_call__.remote(_arm_here, plan), timeout=timeout_s)


def report_of(handle, *, disarm: bool = False, timeout_s: float = 60.0) -> dict:
    """The actor's :func:`~dcr_ray.failpoints.report` (with ``disarm``: and its plan disarmed)."""
    import ray

    return ray.get(handle.__ray_call__.remote(_report_here, disarm), timeout=timeout_s)


def arm_next_start(name: str, namespace: str, faults: list[Fault]) -> None:
    """Leave ``faults`` for the next start of the actor named ``name`` (see the module doc); ``namespace`` is the
    topology's, where its ``restart_coordinator`` and ``kill_node`` reach."""
    from ray.experimental import internal_kv

    value = json.dumps({"plan": text(faults), "namespace": namespace})
    internal_kv._internal_kv_put(_KV_KEY.format(name=name), value.encode(), overwrite=True)


def clear_next_start(name: str) -> None:
    """Take back a plan :func:`arm_next_start` left that no start took."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(_KV_KEY.format(name=name))


def started() -> None:
    """Called by an actor's constructor: arm the plan left for this start of it, if any (see the module doc)."""
    from dcr_ray import failpoints

    if failpoints.ENV not in os.environ:
        return
    import ray
    from ray.experimental import internal_kv

    key = _KV_KEY.format(name=ray.get_runtime_context().get_actor_name())
    value = internal_kv._internal_kv_get(key)
    if not value:
        return
    internal_kv._internal_kv_del(key)
    left = json.loads(value)
    failpoints.arm(parse(left["plan"], left["namespace"]))
