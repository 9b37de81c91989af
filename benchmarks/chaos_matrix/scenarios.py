"""The scenarios of ``dcr-ray chaos --enumerate``: every failpoint x action x apply mode x transport, fired at
its first hit and, where a refit hits it more than once in a process, at a middle hit.

A scenario that cannot happen is a cell of its own (``n/a`` and why), so the matrix shows every combination:
a point that the apply mode or the transport never reaches, a coordinator point's ``kill_node`` (the coordinator
runs on the head node, which the harness cannot remove) and its ``restart_coordinator`` (for the coordinator's
own process that is its ``exit``).

Each runnable scenario names the process it arms (:func:`target`): the owners' points in ``owner0``, the
relays' in cluster ``a``'s head relay (a sub-relay's in cluster ``b``'s, whose tree has one), the engines' in
``a/e0`` (a peer's snapshot in it too, while ``a/e1`` heals), the coordinator's in the coordinator.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dcr_ray.failpoints.catalog import POINTS, Point
from dcr_ray.failpoints.plan import ACTIONS

MODES = ("in_place", "staged")
TRANSPORTS = ("relay", "object_store")
HITS = ("first", "middle")


@dataclass(kw_only=True, slots=True, frozen=True)
class Scenario:
    point: str
    action: str
    hit: str
    mode: str
    transport: str
    skip: str | None = None
    """Why the combination cannot happen (the cell is ``n/a``), or None: it runs."""

    @property
    def key(self) -> str:
        return f"{self.mode}/{self.transport}/{self.point}/{self.action}/{self.hit}"

    @property
    def spec(self) -> Point:
        return POINTS[self.point]

    def to_dict(self) -> dict:
        return {**asdict(self), "role": self.spec.role, "trigger": self.spec.trigger, "target": target(self.point)}


def target(point: str) -> str:
    """The process a scenario of ``point`` arms: ``owner0``, a relay id, an engine id or ``coordinator``."""
    p = POINTS[point]
    if p.role == "owner":
        return "owner0"
    if p.role == "relay":
        return "b/r0" if point == "relay.subforward" else "a/head"
    if p.role == "engine":
        return "a/e1" if point == "engine.heal_from" else "a/e0"
    return "coordinator"


def skip_reason(p: Point, action: str, mode: str, transport: str) -> str | None:
    if mode not in p.modes:
        return f"{mode} refits never reach it"
    if transport not in p.transports:
        return f"the {transport} transport never reaches it"
    if p.role == "coordinator" and action == "kill_node":
        return "the coordinator runs on the head node, which cannot be removed"
    if p.role == "coordinator" and action == "restart_coordinator":
        return "in the coordinator's own process this is its exit"
    return None


def scenarios(points=None, actions=ACTIONS, modes=MODES, transports=TRANSPORTS) -> list[Scenario]:
    """Every cell of the matrix, in run order: combination by combination (one topology each), point by point."""
    out = []
    for mode in modes:
        for transport in transports:
            for name in points or POINTS:
                p = POINTS[name]
                for action in actions:
                    why = skip_reason(p, action, mode, transport)
                    for hit in HITS if p.repeats else HITS[:1]:
                        out.append(Scenario(point=name, action=action, hit=hit, mode=mode, transport=transport,
                                            skip=why))
    return out


@dataclass(kw_only=True, slots=True, frozen=True)
class Composed:
    """Faults that compose: ``faults`` (``(process, point, action, hit, stall seconds or None)``) armed
    together; the first is the scenario's own (its row in the matrix), the others set the stage."""

    name: str
    faults: tuple[tuple[str, str, str, str, float | None], ...]
    mode: str
    transport: str

    @property
    def key(self) -> str:
        return f"{self.mode}/{self.transport}/composed/{self.name}"

    def to_dict(self) -> dict:
        return {"name": self.name, "faults": [list(f) for f in self.faults], "mode": self.mode,
                "transport": self.transport, "point": self.faults[0][1], "action": self.faults[0][2],
                "hit": self.faults[0][3], "composed": True}


#: How long a composed scenario's engine holds a payload back: past its flush's timeout and past the
#: coordinator's restart, so the payload is still missing when the resumed coordinator settles the engine.
HELD_BACK_S = 30.0
#: The engine of cluster ``a`` evicted mid-stream: one payload held back in delivery, its flush hung past the
#: stage timeout (so the coordinator evicts it, rather than failing the attempt); the others commit.
_EVICTED_MID_STREAM = (("a/e1", "engine.deliver", "stall", "middle", HELD_BACK_S),
                       ("a/e1", "engine.flush", "stall", "first", None))
#: The composed scenarios: an engine evicted mid-stream while the refit commits without it, then the
#: coordinator restarts at a step after the record (its resume settles the engine that never finished).
COMPOSED = {f"evicted mid-stream, restart at {point}": ((("coordinator", point, "exit", "first", None),
                                                         *_EVICTED_MID_STREAM))
            for point in ("coordinator.record.after", "coordinator.activate.before")}


def composed(modes=MODES, transports=TRANSPORTS) -> list[Composed]:
    return [Composed(name=n, faults=f, mode=m, transport=t) for m in modes for t in transports
            for n, f in COMPOSED.items()]


#: The fixed subset CI runs (``tests/test_chaos_matrix.py``), in one combination (in place, relay): each action
#: once or more, at the steps where reading found wrong bits (a retry after a mid-stream send, a park that
#: fails half-way) and where the recovery paths start (an engine's node lost mid-apply, an engine hanging in
#: its flush, the coordinator restarting while engines activate; the composed scenario exits the coordinator).
CI_SUBSET = (
    ("owner.send.after", "raise", "first"),
    ("engine.park", "raise", "middle"),
    ("engine.apply", "kill_node", "middle"),
    ("engine.flush.backend", "stall", "first"),
    ("engine.activate", "restart_coordinator", "first"),
)
#: The composed scenario CI runs (an engine evicted mid-stream, then a coordinator restart after the record).
CI_COMPOSED = ("evicted mid-stream, restart at coordinator.record.after",)
