"""Every engine's standing lives in one container (:mod:`dcr_ray.actors.fleet.standings`): the coordinator's
parts change it only through its methods, and ``required`` is a read-only view of it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dcr_ray.actors.fleet.standings import HEALING, MOVES, Standing, Standings
from dcr_ray.errors import EngineStateError

ROOT = Path(__file__).resolve().parents[1] / "dcr_ray"


def test_each_transition_moves_an_engine_to_its_standing_and_required_is_a_view_of_them():
    s = Standings()
    s.require(["a/e0", "a/e1", "b/e0"])
    s.evict(["a/e1"])
    s.heal(["b/e0"])
    assert s.required == frozenset({"a/e0"})
    assert s.as_dict() == {"a/e0": "required", "a/e1": "evicted", "b/e0": "queued"}
    s.move(["b/e0"], Standing.WAITING)
    assert s.of("b/e0").healing and not Standing.REQUIRED.healing
    s.move(["b/e0"], Standing.QUEUED)
    s.joining(["b/e0"])
    s.move(["a/e1"], Standing.QUEUED)
    s.move(["a/e1"], Standing.FAILED)
    assert (s.of("b/e0"), s.of("a/e1"), s.of("c/e9")) == (Standing.JOINING, Standing.FAILED, None)
    assert s.with_standing(Standing.FAILED) == ["a/e1"]
    s.require(["b/e0"])
    assert s.required == frozenset({"a/e0", "b/e0"})


def test_a_move_the_table_does_not_allow_raises_naming_both_standings_and_changes_nothing():
    s = Standings()
    s.require(["a/e0"])
    with pytest.raises(EngineStateError, match="'unknown' cannot become 'evicted'"):
        s.evict(["a/e1"])
    s.heal(["a/e0"])
    with pytest.raises(EngineStateError, match="engine a/e0: its standing 'queued' cannot become 'evicted'"):
        s.evict(["a/e0"])
    with pytest.raises(EngineStateError, match="'queued' cannot become 'out'"):
        s.out(["a/e0"])
    s.require(["b/e0"])
    with pytest.raises(EngineStateError):
        s.evict(["b/e0", "a/e0"])  # all or none
    assert s.as_dict() == {"a/e0": "queued", "b/e0": "required"}


def test_every_standing_has_its_moves_and_every_move_lands_on_a_standing():
    assert set(MOVES) == {None, *Standing}
    assert all(isinstance(to, Standing) for tos in MOVES.values() for to in tos)
    assert HEALING <= set(Standing) and Standing.REQUIRED not in HEALING


def test_the_coordinators_required_set_cannot_be_written_past_the_standings():
    from dcr_ray.actors.fleet.state import CoordinatorState

    state = CoordinatorState(config=None, topology=None, commits=None, backend_factory=None)
    state.standings.require(["a/e0"])
    assert state.required == frozenset({"a/e0"})
    with pytest.raises(AttributeError):
        state.required = {"b/e0"}
    with pytest.raises(AttributeError):
        state.required.add("b/e0")


def test_no_library_module_changes_the_required_set_except_through_the_standings():
    write = re.compile(r"\brequired\s*(\|=|-=|&=|=[^=])|\brequired\.(add|discard|remove|update|clear|pop)\(")
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "standings.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if write.search(code) and "st[\"required\"]" not in code:
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
