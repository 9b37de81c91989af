"""``dcr-ray chaos --enumerate``: a cell for every failpoint x action x apply mode x transport, a matrix rendered
from the JSON alone, and CI's fixed subset run for real (multi-node Ray, real engines, real AdamW steps):
no engine serves bits other than the trainer's, nothing hangs, and every failed operation names its fix.
The full enumeration is a command, ``dcr-ray chaos --enumerate``; a partial one names where its JSON goes."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.chaos_matrix import enumerate_matrix
from benchmarks.chaos_matrix.matrix import markdown, summary
from benchmarks.chaos_matrix.scenarios import (CI_COMPOSED, CI_SUBSET, COMPOSED, MODES, TRANSPORTS, composed,
                                               scenarios)
from dcr_ray.failpoints.catalog import POINTS
from dcr_ray.failpoints.plan import ACTIONS


def test_the_enumeration_has_a_cell_for_every_failpoint_action_apply_mode_and_transport():
    cells = scenarios()
    assert {(s.point, s.action, s.mode, s.transport) for s in cells} == set(
        itertools.product(POINTS, ACTIONS, MODES, TRANSPORTS))
    assert len({s.key for s in cells}) == len(cells)
    middles = {s.point for s in cells if s.hit == "middle"}
    assert middles == {p for p, spec in POINTS.items() if spec.repeats}
    runnable = [s for s in cells if not s.skip]
    assert {s.action for s in runnable} == set(ACTIONS) and {s.point for s in runnable} == set(POINTS)
    assert all(s.skip for s in cells if s.spec.role == "coordinator" and s.action == "kill_node")
    assert {(c.mode, c.transport) for c in composed()} == set(itertools.product(MODES, TRANSPORTS))
    assert set(CI_COMPOSED) <= set(COMPOSED)
    assert {(p, a, h) for p, a, h in CI_SUBSET} <= {(s.point, s.action, s.hit) for s in runnable}


def test_the_matrix_renders_from_the_json_alone():
    cells = [{"mode": "in_place", "transport": "relay", "point": "engine.apply", "action": "raise", "hit": "first",
              "outcome": "committed", "attempts": 2},
             {"mode": "in_place", "transport": "relay", "point": "engine.apply", "action": "raise", "hit": "middle",
              "outcome": "wrong_bits"},
             {"mode": "in_place", "transport": "relay", "point": "engine.apply", "action": "kill_node",
              "hit": "first", "outcome": "failed_fix"},
             {"mode": "staged", "transport": "relay", "point": "engine.apply", "action": "raise", "hit": "first",
              "outcome": "n/a"},
             {"mode": "in_place", "transport": "relay", "point": "coordinator.record.after", "action": "exit",
              "hit": "first", "outcome": "hang", "composed": True, "name": "x then y"}]
    md = markdown({"cells": cells, "seconds": 12.0, "cores": 2})
    assert "| `engine.apply` | c2/**WRONG** |  |  | fix |  |" in md
    assert "| x then y | **HANG** |" in md
    rows = {(r["mode"], r["transport"]): r for r in summary(cells)}
    assert rows[("all", "all")]["wrong_bits"] == 1 and rows[("all", "all")]["n/a"] == 1
    assert rows[("in_place", "relay")]["ran"] == 4


def test_a_partial_enumeration_without_a_json_path_is_refused_before_anything_starts(capsys):
    import argparse

    from benchmarks.chaos_matrix.cli import run_enumerate

    args = argparse.Namespace(mode=["in_place"], transport=None, point=None, action=None, subset=None, limit_s=None,
                              json=None, md=None)
    assert run_enumerate(args) == 2
    assert "needs --json PATH" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_ci_subset_shows_no_wrong_bits_no_hang_and_every_failure_names_its_fix(tmp_path):
    out = enumerate_matrix(modes=("in_place",), transports=("relay",), only=CI_SUBSET, composed_names=CI_COMPOSED,
                           json_path=str(tmp_path / "m.json"), progress=None)
    cells = out["cells"]
    assert len(cells) == len(CI_SUBSET) + len(CI_COMPOSED) and out["complete"]
    bad = {c["key"]: (c["outcome"], c.get("error"), c.get("wrong_bits"), c.get("problems")) for c in cells
           if c["outcome"] in ("wrong_bits", "hang", "broken", "failed_nofix", "not_fired")}
    assert not bad, bad
