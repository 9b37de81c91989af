"""Named failpoints: the library's steps and the catalog name the same points, a disarmed failpoint does
nothing, and an armed plan fires its action once at the hit it names (in this process, in an actor, and in
the next incarnation of a named actor)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from raytools import local_ray  # noqa: F401

from dcr_ray import failpoints
from dcr_ray.errors import ConfigError
from dcr_ray.failpoints import FailpointError, failpoint, plan
from dcr_ray.failpoints.catalog import POINTS, ROLES

LIBRARY = Path(__file__).resolve().parents[1] / "dcr_ray"
#: ``failpoint("name")`` and ``failpoints.each(target, "name")`` at a call site
CALL = re.compile(r'\bfailpoint\(\s*"([a-z_.]+)"\s*\)|\beach\(\s*[^,()]+(?:\([^()]*\))?\s*,\s*"([a-z_.]+)"\s*\)')


def _library_failpoints() -> dict[str, list[str]]:
    """Each failpoint name written in the library (its own package aside), with where."""
    found: dict[str, list[str]] = {}
    for path in sorted(LIBRARY.rglob("*.py")):
        rel = path.relative_to(LIBRARY.parent)
        if rel.parts[1] in ("failpoints", "testing"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for m in CALL.finditer(line):
                found.setdefault(m.group(1) or m.group(2), []).append(f"{rel}:{i}")
    return found


@pytest.fixture(autouse=True)
def _disarmed():
    failpoints.disarm()
    yield
    failpoints.disarm()


def test_every_failpoint_the_library_hits_is_in_the_catalog_once_and_every_catalog_entry_is_hit():
    found = _library_failpoints()
    assert set(found) == set(POINTS), (f"in the library, not in the catalog: {sorted(set(found) - set(POINTS))}; "
                                       f"in the catalog, not in the library: {sorted(set(POINTS) - set(found))}")
    twice = {n: w for n, w in found.items() if len(w) > 1}
    assert not twice, f"each failpoint marks one step: {twice}"
    assert len(POINTS) >= 40 and {p.role for p in POINTS.values()} == set(ROLES)


def test_the_name_check_sees_both_call_forms():
    line = 'failpoint("owner.stream"); c.undo.rollback(failpoints.each(c.backend, "engine.rollback"))'
    assert [m.group(1) or m.group(2) for m in CALL.finditer(line)] == ["owner.stream", "engine.rollback"]


def test_a_disarmed_failpoint_does_nothing_and_each_hands_its_target_back():
    target = object()
    failpoint("engine.apply")
    assert failpoints.each(target, "engine.park") is target
    assert failpoints.report() == {"plan": None, "counts": {}, "fired": []}


def test_an_armed_fault_fires_once_at_the_hit_it_names_and_every_hit_is_counted():
    failpoints.arm("engine.apply=raise@3")
    outcomes = []
    for _ in range(5):
        try:
            failpoint("engine.apply")
            outcomes.append("ok")
        except FailpointError as e:
            outcomes.append(str(e))
    failpoint("owner.stream")
    assert outcomes == ["ok", "ok", "failpoint engine.apply (hit 3): injected failure", "ok", "ok"]
    rep = failpoints.disarm()
    assert rep["counts"] == {"engine.apply": 5, "owner.stream": 1}
    assert rep["fired"] == [{"point": "engine.apply", "action": "raise", "hit": 3}]
    failpoint("engine.apply")  # disarmed again


def test_each_hits_its_failpoint_before_every_apply_of_the_target():
    class Backend:
        applied = 0

        def apply(self, frame):
            self.applied += 1

        def flush(self):
            return "flushed"

    b = Backend()
    failpoints.arm([plan.Fault(point="engine.rollback", at=2)])
    wrapped = failpoints.each(b, "engine.rollback")
    wrapped.apply(None)
    with pytest.raises(FailpointError):
        wrapped.apply(None)
    assert b.applied == 1 and wrapped.flush() == "flushed"


def test_a_stall_sleeps_its_seconds_and_every_hit_from_n_on_fires_with_star_zero():
    failpoints.arm("owner.send.after=stall(0.05)@2*0")
    t0 = time.perf_counter()
    for _ in range(4):
        failpoint("owner.send.after")
    assert time.perf_counter() - t0 >= 0.15
    assert [f["hit"] for f in failpoints.report()["fired"]] == [2, 3, 4]


def test_a_term_for_another_actor_does_not_fire_here():
    failpoints.arm("a/e1:engine.flush=raise")
    failpoint("engine.flush")  # this process is no Ray actor named ...a/e1
    assert failpoints.report()["fired"] == []


def test_the_text_form_reads_back_and_bad_terms_say_the_fix():
    text = "a/e1:engine.apply=raise@3;owner.stream=stall(1.5)@1*0;coordinator.record.after=exit@1"
    faults = plan.parse(text)
    assert plan.text(faults) == text and plan.parse(plan.text(faults)) == faults
    with pytest.raises(ConfigError, match="known ones of that role"):
        plan.parse("engine.aply=raise")
    with pytest.raises(ConfigError, match="one of"):
        plan.parse("engine.apply=explode")
    with pytest.raises(ConfigError, match="SECONDS"):
        plan.parse("engine.apply raise")
    with pytest.raises(ConfigError, match="stall needs its seconds"):
        plan.parse("engine.apply=stall")
    with pytest.raises(ConfigError, match=">= 1"):
        plan.Fault(point="engine.apply", at=0)


@pytest.mark.slow
def test_a_plan_armed_in_an_actor_fires_there_and_a_plan_left_for_a_start_fires_in_the_next_incarnation(local_ray):
    import ray

    from dcr_ray.failpoints import remote

    class Stepper:  # defined here: Ray ships it by value (workers do not import the tests)
        """An actor whose ``step`` is a failpoint, and whose constructor takes a plan left for its start."""

        def __init__(self):
            from dcr_ray.failpoints import remote

            remote.started()

        def step(self) -> str:
            from dcr_ray.failpoints import failpoint

            failpoint("engine.apply")
            return "stepped"

    Stepper = ray.remote(num_cpus=0)(Stepper)
    a = Stepper.remote()
    remote.arm_actor(a, "engine.apply=raise@2")
    assert ray.get(a.step.remote()) == "stepped"
    with pytest.raises(ray.exceptions.RayTaskError, match="engine.apply \\(hit 2\\)"):
        ray.get(a.step.remote())
    assert remote.report_of(a, disarm=True)["counts"] == {"engine.apply": 2}
    remote.arm_actor(a, "engine.apply=exit")
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(a.step.remote())
    # a plan left for the next start of a named actor: taken by it once, and only where the environment asks
    env = {"runtime_env": {"env_vars": {failpoints.ENV: ""}}}
    remote.arm_next_start("fp-stepper", "fp-tests", plan.parse("engine.apply=raise"))
    b = Stepper.options(name="fp-stepper", namespace="fp-tests", **env).remote()
    with pytest.raises(ray.exceptions.RayTaskError, match="injected failure"):
        ray.get(b.step.remote())
    ray.kill(b)
    remote.arm_next_start("fp-stepper2", "fp-tests", plan.parse("engine.apply=raise"))
    c = Stepper.options(name="fp-stepper2", namespace="fp-tests").remote()  # no DCR_RAY_FAILPOINTS: never looks
    assert ray.get(c.step.remote()) == "stepped"
    remote.clear_next_start("fp-stepper2")
    ray.kill(c)
