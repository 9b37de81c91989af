"""Waiting on many actor calls under one deadline, with a dead actor told apart from an error.

A dead actor (Ray's ``RayActorError``) is a membership event: the coordinator drops an engine or
gives up on an owner. Anything else is an application error (a ``DcrError`` from the actor, or a
timeout): the attempt fails and may be retried.
"""

from __future__ import annotations

import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from dcr_ray.errors import DcrError, RefitError, RefitTimeoutError


class NoAnswerError(RefitTimeoutError):
    """An actor did not answer a stage within its timeout (alive, perhaps hung)."""


class ActorsDied(Exception):
    """Some of the actors called are dead (``ids``)."""

    def __init__(self, ids: list[str]):
        super().__init__(f"actors died: {ids}")
        self.ids = ids


def gather(calls: dict, timeout: float, stage: str) -> tuple[dict, list, dict]:
    """``(results, dead ids, {id: error})`` of ``{id: ref}``, all waited for within ``timeout``."""
    deadline = time.monotonic() + timeout
    out, dead, errors = {}, [], {}
    for k, ref in calls.items():
        try:
            out[k] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except DcrError as e:
            errors[k] = e
        except ray.exceptions.RayTaskError as e:
            # the actor is alive and its call raised, possibly because an actor *it* called died (a
            # relay under an owner's stream): an error of this attempt, not a death of ``k``
            cause = e.as_instanceof_cause()
            errors[k] = cause if isinstance(cause, DcrError) else RefitError(f"{stage}: {k}: {e}")
        except RayActorError:
            dead.append(k)
        except GetTimeoutError:
            errors[k] = NoAnswerError(f"stage '{stage}': {k} did not answer within {timeout:.0f} s")
    return out, dead, errors


def get_all(calls: dict, timeout: float, stage: str) -> dict:
    """Results of ``{id: ref}``; dead actors raise :class:`ActorsDied`, otherwise the first error."""
    out, dead, errors = gather(calls, timeout, stage)
    if dead:
        raise ActorsDied(dead)
    if errors:
        raise next(iter(errors.values()))
    return out
