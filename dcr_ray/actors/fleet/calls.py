"""Waiting on many actor calls under one deadline, with a dead actor told apart from an error.

A dead actor (Ray's ``RayActorError``) is a membership event: the coordinator drops an engine or
gives up on an owner. Anything else is an application error (a ``DcrError`` from the actor, or a
timeout): the attempt fails and may be retried.
"""

from __future__ import annotations

import time

import ray
from ray.exceptions import RayActorError

from dcr_ray.errors import DcrError, RefitError, RefitTimeoutError


class NoAnswerError(RefitTimeoutError):
    """An actor did not answer a stage within its timeout (alive, perhaps hung)."""


class ActorsDied(Exception):
    """Some of the actors called are dead (``ids``)."""

    def __init__(self, ids: list[str]):
        super().__init__(f"actors died: {ids}")
        self.ids = ids


#: How often a wait on many calls asks whether the actors still outstanding lost their node.
LOST_POLL_S = 0.25


def _outcome(ref, stage: str, k: str):
    """``("ok", value)``, ``("dead", None)`` or ``("error", exception)`` of a finished call."""
    try:
        return "ok", ray.get(ref, timeout=0)
    except DcrError as e:
        return "error", e
    except ray.exceptions.RayTaskError as e:
        # the actor is alive and its call raised, possibly because an actor *it* called died (a
        # relay under an owner's stream): an error of this attempt, not a death of ``k``
        cause = e.as_instanceof_cause()
        return "error", cause if isinstance(cause, DcrError) else RefitError(f"{stage}: {k}: {e}")
    except RayActorError:
        return "dead", None


def gather(calls: dict, timeout: float, stage: str, lost=None, broken=None) -> tuple[dict, list, dict]:
    """``(results, dead ids, {id: error})`` of ``{id: ref}``, all waited for within ``timeout``.

    ``lost(ids)`` (optional, e.g. :meth:`~dcr_ray.actors.fleet.nodes.NodeWatch.lost`) names those of the
    outstanding ids whose actor's node is gone: they count as dead at once, instead of after Ray
    notices the node's death (its calls wait until then). ``broken()`` (optional) returns an error when
    something the calls wait on is gone (a relay between owners and engines): every outstanding call
    fails with it at once."""
    deadline = time.monotonic() + timeout
    out, dead, errors = {}, [], {}
    pending = dict(calls)
    by_ref = {ref: k for k, ref in calls.items()}
    polled = lost is not None or broken is not None
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _ = ray.wait(list(pending.values()), num_returns=len(pending),
                            timeout=min(left, LOST_POLL_S if polled else left))
        for ref in ready:
            k = by_ref[ref]
            del pending[k]
            kind, value = _outcome(ref, stage, k)
            if kind == "ok":
                out[k] = value
            elif kind == "dead":
                dead.append(k)
            else:
                errors[k] = value
        if pending and lost is not None:
            for k in lost(list(pending)):
                del pending[k]
                dead.append(k)
        why = broken() if pending and broken is not None else None
        if why is not None:
            errors.update(dict.fromkeys(pending, why))
            return out, dead, errors
    for k in pending:
        errors[k] = NoAnswerError(f"stage '{stage}': {k} did not answer within {timeout:.0f} s")
    return out, dead, errors


def get_all(calls: dict, timeout: float, stage: str, lost=None, broken=None) -> dict:
    """Results of ``{id: ref}``; dead actors (and, with ``lost``, actors whose node is gone: see
    :func:`gather`) raise :class:`ActorsDied`, otherwise the first error."""
    out, dead, errors = gather(calls, timeout, stage, lost, broken)
    if dead:
        raise ActorsDied(dead)
    if errors:
        raise next(iter(errors.values()))
    return out
