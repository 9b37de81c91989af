"""One scenario of the enumeration: arm one fault, run the operation that reaches it, recover as the errors
say, check everything against the trainer, then check that the next refit commits.

What reaches a point is its trigger (:mod:`dcr_ray.failpoints.catalog`):

============  ====================================================================================================
``refit``     a refit
``retry``     a refit whose first attempt fails before its flush (the engines wrote their frames)
``abandon``   a refit whose every attempt fails before its flush (expected to fail)
``restart``   the coordinator restarts (the fault is armed for its next start, or in the running relay), then a
              refit
``respawn``   engine ``a/e1`` is killed, then a refit: it is re-created and heals from ``a/e0`` after the commit
``lag``       ``a/e0`` is drained for a refit, then rejoins (the operation): it replays the delta it missed
``evict``     ``a/e1`` hangs past the stage timeout in a refit and is evicted; the operation is the next refit,
              which readmits it
``bootstrap`` a dense bootstrap of ``a/e0`` by the owners (``CoordinatorActor.bootstrap_dense``)
============  ====================================================================================================

A cell's ``outcome``, worst first: ``hang`` (an operation or a heal ran past its bound), ``wrong_bits`` (an
engine serves bits that are not the trainer's for its version, or the record names another version),
``broken`` (a check failed otherwise: a ready engine that does not generate, a required engine off the record's
version, the next refit not committing), ``failed_nofix`` (the operation failed with an error that names no
fix), ``not_fired`` (the fault's hit never came), ``failed_fix`` (a ``DcrError`` naming its fix, which the
harness applied), ``committed`` (at ``attempts``; ``ok`` for an operation that is not a refit; ``abandoned``: an
``abandon`` trigger's refit failed with a ``RefitError``, as that trigger intends, and everything after it checked
out). ``recovery``
lists what the harness did (the fixes applied, nodes added back, engines rejoined).
"""

from __future__ import annotations

import time

import ray

from benchmarks.chaos_matrix.bench import (NAMESPACE, STAGE_TIMEOUT_S, STALL_PAST_S, Bench, alive, message,
                                           names_fix, op_bound_s, root)
from dcr_ray.actors.fleet.topology import engine_name
from dcr_ray.errors import DcrError
from dcr_ray.failpoints import remote as fp_remote
from dcr_ray.failpoints.catalog import POINTS
from dcr_ray.failpoints.plan import Fault
from dcr_ray.options import COORDINATOR_NAME

#: The fault that makes a refit's attempts fail after the engines wrote their frames, before their flush (so an
#: in-place engine rolls back rather than parks): ``retry`` once, ``abandon`` at every attempt.
ATTEMPT_FAILS = "coordinator.flush.before"
OUTCOMES = ("hang", "wrong_bits", "broken", "failed_nofix", "not_fired", "failed_fix", "committed", "ok",
            "abandoned", "harness_error")


def _call(ref, bound_s: float):
    """``("done", value)``, ``("error", exception)`` or ``("hang", None)`` of an operation's ObjectRef."""
    ready, _ = ray.wait([ref], timeout=bound_s)
    if not ready:
        return "hang", None
    try:
        return "done", ray.get(ref)
    except Exception as e:  # noqa: BLE001 - the cell reports it
        return "error", e


def _restart_coordinator(bench: Bench) -> None:
    """Kill the coordinator's process (Ray restarts it; it resumes from the record) and wait until it answers."""
    ray.kill(bench.refit.actor, no_restart=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            bench.status()
            return
        except Exception:
            time.sleep(0.5)


def run(bench: Bench, point: str, action: str | None, at: int, *, count: bool = False,
        also: list[tuple[str, Fault]] = ()) -> dict:
    """Run one scenario (``action`` None with ``count``: no fault, every process counts its hits; ``also``:
    more faults, ``(process, fault)``, armed beside it: faults that compose); returns its cell (see the
    module doc)."""
    trigger = POINTS[point].trigger
    target = _target_name(point)
    t0 = time.monotonic()
    cell = {"point": point, "action": action, "at": at, "trigger": trigger, "target": target,
            "recovery": bench.ensure()}
    bench.keep_owner_state(POINTS[point].role == "owner" or point == "objstore.put"
                           or any(f.action in ("exit", "kill_node") and t.startswith("owner") for t, f in also))
    marks = {"ensure": time.monotonic() - t0}
    fault = None if action is None else Fault(point=point, action=action, at=at,
                                              stall_s=STAGE_TIMEOUT_S + STALL_PAST_S, namespace=NAMESPACE)
    coordinator_faults = []
    if trigger == "retry":
        coordinator_faults.append(Fault(point=ATTEMPT_FAILS, at=1))
    elif trigger == "abandon":
        coordinator_faults.append(Fault(point=ATTEMPT_FAILS, at=1, times=0))
    if count:
        _count_everywhere(bench)
    # -- what reaches the point ------------------------------------------------------------------------
    if trigger == "lag":
        bench.refit.drain("a/e0")
        bench.step()
        _, err = _call(bench.refit.remote(), op_bound_s(False))
        bench.bind()
    elif trigger == "evict":
        fp_remote.arm_actor(bench.process("a/e1"), [Fault(point="engine.flush.backend", action="stall",
                                                           stall_s=STAGE_TIMEOUT_S + STALL_PAST_S)])
        bench.step()
        _call(bench.refit.remote(), op_bound_s(False))
        bench.bind()
        _wait_answers(bench, "a/e1", STAGE_TIMEOUT_S + STALL_PAST_S + 30)
    elif trigger == "respawn":
        ray.kill(bench.process("a/e1"))
    # -- arm ---------------------------------------------------------------------------------------------
    plan: dict[str, list[Fault]] = {}
    for tgt, f in ([(target, fault)] if fault is not None else []) + list(also):
        plan.setdefault(tgt, []).append(f)
    if coordinator_faults:
        plan.setdefault("coordinator", []).extend(coordinator_faults)
    handle = None
    for tgt, faults in plan.items():
        if tgt == "coordinator" and trigger == "restart":
            fp_remote.arm_next_start(COORDINATOR_NAME, NAMESPACE, faults)
        elif tgt == "a/e1" and trigger == "respawn":
            fp_remote.arm_next_start(engine_name("a/e1"), NAMESPACE, faults)
        else:
            h = bench.process(tgt)
            fp_remote.arm_actor(h, faults)
            handle = h if tgt == target else handle
    epoch = bench.status()["epoch"]
    if trigger == "restart":
        _restart_coordinator(bench)
    # -- the operation -------------------------------------------------------------------------------------
    restarts = action in ("exit", "kill_node", "restart_coordinator") or trigger == "restart"
    bound = op_bound_s(restarts)
    t_op = time.monotonic()
    if trigger == "lag":
        kind, out = _call(bench.refit.actor.rejoin.remote("a/e0"), bound)
    elif trigger == "bootstrap":
        kind, out = _call(bench.refit.actor.bootstrap_dense.remote(["a/e0"]), bound)
    else:
        bench.step()
        kind, out = _call(bench.refit.remote(), bound)
    cell["op_seconds"] = round(time.monotonic() - t_op, 2)
    cell["op_bound_s"] = bound
    early = {}
    if handle is not None:  # what fired in the operation (recovery may replace the process)
        try:
            early[target] = fp_remote.report_of(handle, timeout_s=30)
        except Exception:  # noqa: BLE001 - it died
            pass
    if coordinator_faults:  # the trigger's faults stop with the operation they were for
        try:
            early["coordinator"] = fp_remote.report_of(bench.refit.actor, disarm=True, timeout_s=30)
        except Exception:  # noqa: BLE001 - it restarted: nothing armed there any more
            pass
    if kind == "hang":
        cell.update(outcome="hang", detail=f"the operation did not return within {bound:.0f} s")
        _start_over(bench, cell)
        return _done(cell, t0)
    err = out if kind == "error" else None
    warnings = []
    if err is None and trigger not in ("lag", "bootstrap"):
        cell["attempts"] = out.attempts
        warnings = list(out.warnings)
    elif err is not None:
        cell["error"] = message(err)[:600]
        cell["names_fix"] = names_fix(err)
    # -- recovery and the checks ------------------------------------------------------------------------
    try:
        t1 = time.monotonic()
        bench.bind()
        cell["recovery"] += bench.fix(err, warnings)
        cell["recovery"] += bench.heal()
        bench.bind()
        marks["recover"] = time.monotonic() - t1
        t1 = time.monotonic()
        first = bench.check()
        marks["check"] = time.monotonic() - t1
        # the fault fired in the operation and its recovery, or not at all: the next refit runs disarmed
        reports = bench.disarm_all()
        for name, rep in early.items():  # what fired before the trigger's faults were disarmed, or the process
            later = reports.get(name, {})  # replaced, merged with what its last report says
            fired = {(f["point"], f["hit"]): f for f in [*rep["fired"], *later.get("fired", [])]}
            reports[name] = {**rep, "fired": list(fired.values()),
                             "counts": {**rep["counts"], **later.get("counts", {})}}
        cell["fired"] = _fired(bench, action, target, handle, reports, epoch)
        if count:
            cell["counts"] = {name: r["counts"] for name, r in reports.items()}
        t1 = time.monotonic()
        bench.step()
        kind2, nxt = _call(bench.refit.remote(), op_bound_s(False))
        marks["next"] = time.monotonic() - t1
        if kind2 == "hang":
            cell.update(outcome="hang", detail="the next refit did not return within its bound")
            _start_over(bench, cell)
            return _done(cell, t0)
        if kind2 == "error":
            cell["next_error"] = message(nxt)[:600]
        bench.bind()
        cell["recovery"] += bench.fix(nxt if kind2 == "error" else None)
        cell["recovery"] += bench.heal()
        second = bench.check()
    except Exception as e:  # noqa: BLE001 - a recovery that cannot finish is a finding, then start over
        cell.update(outcome="hang" if "still heal after" in str(e) else "broken",
                    detail=f"recovery failed: {type(e).__name__}: {str(e)[:400]}")
        _start_over(bench, cell)
        return _done(cell, t0)
    cell["wrong_bits"] = first["wrong_bits"] + second["wrong_bits"]
    cell["problems"] = first["problems"] + second["problems"]
    cell["notes"] = sorted(set(first["notes"] + second["notes"]))
    bench.dirty = bool(second["wrong_bits"] or second["problems"])
    cell["phase_s"] = {k: round(v, 2) for k, v in marks.items()}
    cell["outcome"] = _outcome(cell, err, kind2 == "done", expect_fail=trigger == "abandon")
    return _done(cell, t0)


def _target_name(point: str) -> str:
    from benchmarks.chaos_matrix.scenarios import target

    return target(point)


def _count_everywhere(bench: Bench) -> None:
    """An empty plan in every process: each counts its hits."""
    for kind, procs in bench.handles().items():
        for h in ([procs] if kind == "coordinator" else procs.values()):
            fp_remote.arm_actor(h, [])
    fp_remote.arm_next_start(COORDINATOR_NAME, NAMESPACE, [])
    fp_remote.arm_next_start(engine_name("a/e1"), NAMESPACE, [])


def _wait_answers(bench: Bench, engine: str, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            ray.get(bench.process(engine).state.remote(), timeout=1.0)
            return
        except Exception:
            time.sleep(0.2)


def _fired(bench: Bench, action, target: str, handle, reports: dict, epoch: int) -> bool | None:
    if action is None:
        return None
    name = "coordinator" if target == "coordinator" else target
    if any(f for f in reports.get(name, {}).get("fired", [])):
        return True
    if action == "restart_coordinator" or target == "coordinator":
        if bench.status()["epoch"] > epoch:
            return True
    if action in ("exit", "kill_node") and handle is not None and not alive(handle):
        return True
    if handle is None and action in ("exit", "kill_node"):
        return None  # armed for a start: a process that died with it leaves no report (unknown)
    return False


def _outcome(cell: dict, err, next_committed: bool, expect_fail: bool) -> str:
    if cell["wrong_bits"]:
        return "wrong_bits"
    if cell["problems"] or not next_committed:
        return "broken"
    if err is not None and not names_fix(err) and not (expect_fail and isinstance(root(err), DcrError)):
        return "failed_nofix"
    if cell["fired"] is False:
        return "not_fired"
    if err is not None and not expect_fail:
        return "failed_fix"
    if expect_fail and err is not None:
        return "abandoned"
    return "committed" if "attempts" in cell else "ok"


def _start_over(bench: Bench, cell: dict) -> None:
    """After a hang or a recovery that could not finish: relaunch the topology."""
    try:
        bench.disarm_all()
    except Exception:
        pass
    bench.relaunch()
    cell["recovery"].append("relaunched")


def _done(cell: dict, t0: float) -> dict:
    cell["seconds"] = round(time.monotonic() - t0, 2)
    return cell


__all__ = ["OUTCOMES", "run"]
