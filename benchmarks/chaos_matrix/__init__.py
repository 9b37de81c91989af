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

from benchmarks.chaos_matrix.scenarios import CI_SUBSET, MODES, TRANSPORTS, scenarios, target


def enumerate_matrix(*, modes=MODES, transports=TRANSPORTS, points=None, actions=None, only=None,
                     json_path: str | None = None, md_path: str | None = None, progress=sys.stderr,
                     limit_s: float | None = None) -> dict:
    """Run the scenarios (``only``: a list of ``(point, action, hit)``; else every combination of ``points`` and
    ``actions``); returns ``{"cells": [...], "seconds", ...}`` and writes the JSON (after each cell, so a run cut
    short keeps what it did) and the Markdown. ``limit_s``: stop starting scenarios past this many seconds."""
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
                at = 1
                if sc.hit == "middle":
                    trig = sc.spec.trigger
                    if trig not in counts:
                        say(f"counting hits ({trig})")
                        counts[trig] = run(bench, sc.point, None, 1, count=True).get("counts", {})
                    n = counts[trig].get(target(sc.point), {}).get(sc.point, 0)
                    if n < 2:
                        result["cells"].append({**base, "outcome": "n/a",
                                                "why": f"hit {n} time(s) per operation in {target(sc.point)}"})
                        continue
                    at = (n + 1) // 2
                cell = {**base, **run(bench, sc.point, sc.action, at)}
                result["cells"].append(cell)
                say(f"{i + 1}/{len(mine)} {sc.key} @{at}: {cell['outcome']}"
                    + (f" ({cell.get('error', '')[:120]})" if cell['outcome'] not in ("committed", "ok") else "")
                    + f" [{cell['seconds']:.1f}s]")
                _write(result, t0, json_path)
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
