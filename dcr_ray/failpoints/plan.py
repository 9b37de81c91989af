"""A fault plan: which failpoint fires, with which action, at which hit; parsed from one line of text.

A plan is a list of :class:`Fault` terms. Its text form (the ``DCR_RAY_FAILPOINTS`` environment variable,
:func:`parse`) follows etcd's gofail: terms separated by ``;``, each::

    [ACTOR:]POINT=ACTION[(ARG)][@N][*K]

``POINT`` is a name of :data:`~dcr_ray.failpoints.catalog.POINTS`; ``ACTION`` one of :data:`ACTIONS`
(``stall`` takes seconds as its ``ARG``); ``@N`` fires at the N-th hit of the point in the process (1 by
default: the first), ``*K`` at K hits in a row from there (1 by default; ``*0``: every hit from the N-th
on); ``ACTOR`` limits the term to processes whose Ray actor name ends with it (``a/e1``, ``dcr_coordinator``).
Examples: ``engine.apply=raise@3``, ``a/e1:engine.flush=stall(12)``, ``owner.stream=raise*0``.

Each term fires in one process's count of hits: a plan armed in a process that Ray restarts is gone
with the process (the new one arms what its environment or :func:`~dcr_ray.failpoints.remote.arm_next_start`
gives it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from dcr_ray.errors import ConfigError

Action = Literal["raise", "stall", "exit", "kill_node", "restart_coordinator"]
#: What a fired failpoint does: raise :class:`~dcr_ray.failpoints.FailpointError`; stall (sleep ``stall_s``,
#: past the stage timeout when it is set so); exit the process (``os._exit``: Ray sees the actor die); remove
#: the process's node (a harness actor does it: :data:`~dcr_ray.failpoints.actions.NODE_KILLER`); restart
#: the topology's coordinator (its process exits and Ray restarts it).
ACTIONS: tuple[str, ...] = get_args(Action)

_TERM = re.compile(r"^(?:(?P<actor>.+):)?(?P<point>[a-z_]+(?:\.[a-z_]+)+)=(?P<action>[a-z_]+)"
                   r"(?:\((?P<arg>[0-9.]+)\))?(?:@(?P<at>[0-9]+))?(?:\*(?P<times>[0-9]+))?$")


@dataclass(kw_only=True, slots=True, frozen=True)
class Fault:
    """One term of a plan: ``action`` at hit ``at`` of failpoint ``point`` (``times`` hits in a row)."""

    point: str
    """The failpoint's name (a key of :data:`~dcr_ray.failpoints.catalog.POINTS`)."""
    action: Action = "raise"
    at: int = 1
    """The hit of ``point`` in this process that fires first (1: the first hit)."""
    times: int = 1
    """How many hits in a row fire from ``at`` on (0: every one)."""
    stall_s: float = 0.0
    """Seconds a ``stall`` sleeps."""
    actor: str | None = None
    """Only in processes whose Ray actor name ends with this (None: any process the plan is armed in)."""
    namespace: str | None = None
    """The Ray namespace of the topology ``restart_coordinator`` and ``kill_node`` reach (None: the
    process's own: right for dcr_ray's actors, not for a trainer actor in another namespace)."""

    def __post_init__(self):
        from dcr_ray.failpoints.catalog import POINTS

        if self.point not in POINTS:
            near = sorted(p for p in POINTS if p.split(".")[0] == self.point.split(".")[0]) or sorted(POINTS)
            raise ConfigError(f"unknown failpoint {self.point!r}; known ones of that role: {near}")
        if self.action not in ACTIONS:
            raise ConfigError(f"failpoint action must be one of {ACTIONS}, got {self.action!r}")
        if isinstance(self.at, bool) or not isinstance(self.at, int) or self.at < 1:
            raise ConfigError(f"Fault.at is the first hit that fires, an integer >= 1; got {self.at!r}")
        if isinstance(self.times, bool) or not isinstance(self.times, int) or self.times < 0:
            raise ConfigError(f"Fault.times is how many hits fire (0: every one), an integer >= 0; got {self.times!r}")
        if self.action == "stall" and not self.stall_s > 0:
            raise ConfigError(f"a stall needs its seconds: Fault(action='stall', stall_s=...) or "
                              f"'{self.point}=stall(SECONDS)'; got {self.stall_s!r}")

    def fires_at(self, hit: int) -> bool:
        """Whether the ``hit``-th hit of its point fires."""
        return hit >= self.at and (self.times == 0 or hit < self.at + self.times)

    def text(self) -> str:
        """The term in the plan's text form (:func:`parse` reads it back)."""
        arg = f"({self.stall_s:g})" if self.action == "stall" else ""
        where = f"{self.actor}:" if self.actor else ""
        return f"{where}{self.point}={self.action}{arg}@{self.at}" + (f"*{self.times}" if self.times != 1 else "")


def parse(text: str, namespace: str | None = None) -> list[Fault]:
    """The faults of a plan's text form (see the module doc); ``ConfigError`` naming the bad term."""
    faults = []
    for term in (t.strip() for t in (text or "").split(";")):
        if not term:
            continue
        m = _TERM.match(term)
        if m is None:
            raise ConfigError(f"failpoint term {term!r} is not [ACTOR:]POINT=ACTION[(SECONDS)][@N][*K], e.g. "
                              f"'engine.apply=raise@3' or 'a/e1:engine.flush=stall(12)'")
        arg = m["arg"]
        faults.append(Fault(point=m["point"], action=m["action"], at=int(m["at"] or 1),
                            times=int(m["times"]) if m["times"] is not None else 1,
                            stall_s=float(arg) if arg else 0.0, actor=m["actor"], namespace=namespace))
    return faults


def text(faults: list[Fault]) -> str:
    """A plan's text form."""
    return ";".join(f.text() for f in faults)
