"""``dcr-ray chaos --enumerate``: every failpoint x action x apply mode x transport, each fired once at its first
hit and at a middle hit, checked against the trainer; a matrix as JSON and Markdown.

The systems trusted most with data test by named faults, not luck: FoundationDB's ``BUGGIFY`` points,
etcd's gofail failpoints fired by its robustness tests, TigerBeetle's VOPR against a model of the correct
state. Here each step of the protocol is a failpoint (:mod:`dcr_ray.failpoints`), and each scenario fires one
(:mod:`~benchmarks.chaos_matrix.scenarios`), lets the operation and its recovery run, and checks every engine
against the trainer's own tensors for the version it serves (:mod:`~benchmarks.chaos_matrix.run`,
:mod:`~benchmarks.chaos_matrix.bench`).

Scenarios of one apply mode and transport share one topology on one Ray cluster; the middle hit of a point
is half the hits a refit of that topology makes in the armed process (counted first, with an empty plan
armed everywhere, once per trigger).
"""

from __future__ import annotations

import json
import os
import sys
import time

from benchmarks.chaos_matrix.scenarios import CI_SUBSET, MODES, TRANSPORTS, composed, scenarios, target


def enumerate_matrix(*, modes=MODES, transports=TRANSPORTS, points=None, actions=None, only=None,
                     json_path: str | None = None, md_path: str | None = None, progress=sys.stderr,
                     limit_s: float | None = None, composed_names=None) -> dict:
    """Run the scenarios (``only``: a list of ``(point, action, hit)``; else every combination of ``points`` and
    ``actions``), then the composed scenarios (:data:`~benchmarks.chaos_matrix.scenarios.COMPOSED`, or those
    named in ``composed_names``) of each combination; returns ``{"cells": [...], "seconds",
    ...}`` and writes the JSON (after each cell, so a run cut short keeps what it did) and the Markdown.
    ``limit_s``: stop starting scenarios past this many seconds."""
    from benchmarks.chaos_matrix.bench import Bench, Fleet
    from benchmarks.chaos_matrix.run import run
    from dcr_ray.failpoints.plan import ACTIONS

    todo = scenarios(points=points, actions=actions or ACTIONS, modes=modes, transports=transports)
    if only is not None:
        keep = set(only)
        todo = [s for s in todo if (s.point, s.action, s.hit) in keep]
    t0 = time.monotonic()
    result = {"cores": os.cpu_count(), "cells": [], "seconds": 0.0, "complete": False,
              "scenarios": len(todo), "runnable": sum(not s.skip for s in todo)}
    say = (lambda m: print(f"[enumerate {time.monotonic() - t0:7.1f}s] {m}", file=progress, flush=True)) \
        if progress else (lambda m: None)
    fleet = Fleet()
    try:
        for combo in [(m, t) for m in modes for t in transports]:
            mine = [s for s in todo if (s.mode, s.transport) == combo]
            if not mine:
                continue
            bench = None
            counts: dict[str, dict] = {}  # trigger -> process -> point -> hits
            for i, sc in enumerate(mine):
                if limit_s is not None and time.monotonic() - t0 > limit_s:
                    say(f"stopping: past {limit_s:.0f} s")
                    raise _Stop
                base = {**sc.to_dict(), "key": sc.key}
                if sc.skip:
                    result["cells"].append({**base, "outcome": "n/a", "why": sc.skip})
                    continue
                if bench is None:
                    say(f"launching the {combo[0]} / {combo[1]} topology")
                    bench = Bench(fleet, *combo)
                    _middle(bench, counts, "refit", "owner.send.before", "owner0")  # the frames per refit, on record
                at = 1
                if sc.hit == "middle":
                    at = _middle(bench, counts, sc.spec.trigger, sc.point, target(sc.point))
                    if not at:
                        result["cells"].append({**base, "outcome": "n/a",
                                                "why": f"hit at most once per operation in {target(sc.point)}"})
                        continue
                try:
                    cell = {**base, **run(bench, sc.point, sc.action, at)}
                except Exception as e:  # noqa: BLE001 - the harness's own failure: recorded, then start over
                    cell = {**base, "outcome": "harness_error", "error": f"{type(e).__name__}: {str(e)[:600]}",
                            "seconds": 0.0}
                    bench.relaunch()
                bench.scenarios += 1
                result["cells"].append(cell)
                say(f"{i + 1}/{len(mine)} {sc.key} @{at}: {cell['outcome']}"
                    + (f" ({cell.get('error', '')[:120]})" if cell['outcome'] not in ("committed", "ok") else "")
                    + f" [{cell['seconds']:.1f}s]")
                _write(result, t0, json_path)
            for comp in [c for c in composed([combo[0]], [combo[1]])
                         if composed_names is None or c.name in composed_names]:
                if limit_s is not None and time.monotonic() - t0 > limit_s:
                    say(f"stopping: past {limit_s:.0f} s")
                    raise _Stop
                if bench is None:
                    say(f"launching the {combo[0]} / {combo[1]} topology")
                    bench = Bench(fleet, *combo)
                try:
                    cell = {**comp.to_dict(), "key": comp.key, **_run_composed(bench, comp, counts)}
                except Exception as e:  # noqa: BLE001 - the harness's own failure: recorded, then start over
                    cell = {**comp.to_dict(), "key": comp.key, "outcome": "harness_error",
                            "error": f"{type(e).__name__}: {str(e)[:600]}", "seconds": 0.0}
                    bench.relaunch()
                result["cells"].append(cell)
                say(f"composed {comp.key}: {cell['outcome']} [{cell['seconds']:.1f}s]")
                _write(result, t0, json_path)
            result.setdefault("hits", {})["/".join(combo)] = counts  # per trigger, process and point
            if bench is not None:
                bench.shutdown()
        result["complete"] = True
    except _Stop:
        pass
    finally:
        fleet.shutdown()
        _write(result, t0, json_path)
    if md_path:
        from benchmarks.chaos_matrix.matrix import markdown

        os.makedirs(os.path.dirname(os.path.abspath(md_path)), exist_ok=True)
        with open(md_path, "w") as f:
            f.write(markdown(result) + "\n")
    return result


class _Stop(Exception):
    pass


#: A trigger's hits are counted again after this many scenarios: the frames per refit shrink as training goes
#: on (fewer elements change their BF16 bits per step), and a middle hit must stay inside the operation.
RECOUNT_EVERY = 25


def _middle(bench, counts: dict, trigger: str, point: str, process: str) -> int:
    """Half the hits of ``point`` in ``process`` per operation of ``trigger`` (0 when it is hit once or never),
    counted with an empty plan armed everywhere, again every :data:`RECOUNT_EVERY` scenarios."""
    from benchmarks.chaos_matrix.run import run
    from dcr_ray.failpoints.catalog import POINTS

    seen = counts.setdefault("_scenarios", {})
    if trigger not in counts or bench.scenarios - seen.get(trigger, 0) >= RECOUNT_EVERY:
        example = next(p for p, spec in POINTS.items() if spec.trigger == trigger)
        for _ in range(3):  # an operation that retried (a slow stage on a loaded machine) counts its hits twice
            cell = run(bench, example, None, 1, count=True)
            counts[trigger] = cell.get("counts", {})
            if cell.get("attempts", 1) == (2 if trigger == "retry" else 1):
                break
        seen[trigger] = bench.scenarios
        counts.setdefault("_history", []).append({"trigger": trigger, "after_scenarios": bench.scenarios,
                                                   "counts": counts[trigger]})
    n = counts[trigger].get(process, {}).get(point, 0)
    return (n + 1) // 2 if n >= 2 else 0


def _run_composed(bench, comp, counts: dict) -> dict:
    from benchmarks.chaos_matrix.bench import NAMESPACE, STAGE_TIMEOUT_S, STALL_PAST_S
    from benchmarks.chaos_matrix.run import run
    from dcr_ray.failpoints.plan import Fault

    faults = []
    for process, point, action, hit, stall in comp.faults:
        at = _middle(bench, counts, "refit", point, process) or 1 if hit == "middle" else 1
        faults.append((process, Fault(point=point, action=action, at=at, namespace=NAMESPACE,
                                      stall_s=stall or (STAGE_TIMEOUT_S + STALL_PAST_S) if action == "stall" else 0.0)))
    (_, main), also = faults[0], faults[1:]
    return run(bench, main.point, main.action, main.at, also=also)


def _write(result: dict, t0: float, path: str | None) -> None:
    from benchmarks.chaos_matrix.matrix import summary

    result["seconds"] = round(time.monotonic() - t0, 1)
    result["summary"] = summary(result["cells"])
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, path)


__all__ = ["CI_SUBSET", "enumerate_matrix"]
