"""Named failpoints: every step of the refit protocol is a place where a fault can be fired on purpose.

In the spirit of FoundationDB's ``BUGGIFY`` and etcd's gofail, each step of the protocol carries one line::

    failpoint("engine.flush")                                  # this process is about to flush
    c.undo.rollback(failpoints.each(c.backend, "engine.rollback"))   # each write of a rollback

The names are :data:`~dcr_ray.failpoints.catalog.POINTS` (:mod:`~dcr_ray.failpoints.catalog`: each name, the
role whose process hits it, its step, and what makes a refit reach it; owners, relays, engines, the coordinator). A
failpoint does nothing unless a fault plan (:mod:`~dcr_ray.failpoints.plan`) is armed in its process:
then it counts its hits and, at the hit a term names, does what the term says (raise, stall, exit the
process, remove its node, restart the coordinator: :mod:`~dcr_ray.failpoints.actions`). Disarmed, it is
one call and one comparison with None (``dcr-ray bench failpoints`` measures it against a refit), and
:func:`each` hands its target back unchanged.

A plan is armed in a process in one of three ways:

* the environment variable ``DCR_RAY_FAILPOINTS`` (:mod:`~dcr_ray.failpoints.plan`'s text form), read when
  this module is imported; per kind of actor through the config:
  ``RefitConfig(actor_options={"engine": {"runtime_env": {"env_vars": {"DCR_RAY_FAILPOINTS":
  "a/e1:engine.apply=raise@3"}}}})``;
* :func:`arm` in the process itself, or :func:`~dcr_ray.failpoints.remote.arm_actor` from a driver (the call
  runs inside the actor through Ray's ``__ray_call__``);
* :func:`~dcr_ray.failpoints.remote.arm_next_start`: a plan the next incarnation of a named actor arms as it
  starts (a restarted coordinator's resume, a re-created engine's first heal), for processes whose
  environment sets ``DCR_RAY_FAILPOINTS`` (even to an empty plan).

Hits are counted per process, per name, from the moment a plan (even an empty one) is armed:
:func:`report` returns the counts and the faults that fired.
"""

from __future__ import annotations

import os
import sys
import threading

from dcr_ray.failpoints.actions import FailpointError, fire
from dcr_ray.failpoints.plan import Fault, parse, text

#: The environment variable whose plan a process arms when it imports this module.
ENV = "DCR_RAY_FAILPOINTS"

__all__ = ["ENV", "Fault", "FailpointError", "arm", "armed", "disarm", "each", "failpoint", "report"]


class _Armed:
    """A plan armed in this process: its faults by point, the hits counted, the faults fired."""

    def __init__(self, faults: list[Fault]):
        self.faults = list(faults)
        self.by_point: dict[str, list[Fault]] = {}
        for f in self.faults:
            self.by_point.setdefault(f.point, []).append(f)
        self.counts: dict[str, int] = {}
        self.fired: list[dict] = []
        self.lock = threading.Lock()
        self._me: str | None = None

    def _mine(self, fault: Fault) -> bool:
        if fault.actor is None:
            return True
        if self._me is None:  # this process's Ray actor name ("" outside an actor: never starts Ray)
            ray = sys.modules.get("ray")
            try:
                self._me = (ray.get_runtime_context().get_actor_name() or "") if ray and ray.is_initialized() else ""
            except Exception:
                self._me = ""
        return self._me.endswith(fault.actor)

    def hit(self, point: str) -> None:
        with self.lock:
            n = self.counts[point] = self.counts.get(point, 0) + 1
            due = next((f for f in self.by_point.get(point, ()) if f.fires_at(n) and self._mine(f)), None)
            if due is not None:
                self.fired.append({"point": point, "action": due.action, "hit": n})
        if due is not None:
            fire(due, n)


_armed: _Armed | None = None


def failpoint(name: str) -> None:
    """The failpoint ``name`` (a key of :data:`~dcr_ray.failpoints.catalog.POINTS`): nothing unless a plan is
    armed in this process; then its hit is counted, and fires if a term of the plan names this hit."""
    if _armed is not None:
        _armed.hit(name)


class _EachApply:
    """``target`` with the failpoint ``name`` hit before each of its ``apply`` calls."""

    def __init__(self, target, name: str):
        self._target, self._name = target, name

    def apply(self, *args, **kwargs):
        failpoint(self._name)
        return self._target.apply(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self._target, attr)


def each(target, name: str):
    """``target`` as it is when no plan is armed; else one whose every ``apply`` first hits failpoint
    ``name`` (a step that writes frame by frame through a backend: a rollback, a park, a write-back)."""
    return target if _armed is None else _EachApply(target, name)


def arm(plan: list[Fault] | str, namespace: str | None = None) -> None:
    """Arm ``plan`` (faults, or their text form) in this process, in place of any plan armed before; the
    hit counts start from zero. An empty plan only counts."""
    global _armed
    faults = parse(plan, namespace) if isinstance(plan, str) else list(plan)
    _armed = _Armed(faults)


def disarm() -> dict:
    """Disarm this process; returns what the plan saw (:func:`report`)."""
    global _armed
    out = report()
    _armed = None
    return out


def armed() -> bool:
    return _armed is not None


def report() -> dict:
    """``{"plan": text form, "counts": {point: hits}, "fired": [{"point", "action", "hit"}]}`` of the plan
    armed in this process (empty when none is)."""
    a = _armed
    if a is None:
        return {"plan": None, "counts": {}, "fired": []}
    with a.lock:
        return {"plan": text(a.faults), "counts": dict(a.counts), "fired": list(a.fired)}


if os.environ.get(ENV):
    arm(os.environ[ENV])
