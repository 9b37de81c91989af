"""``dcr-ray bench live``: every (receiver, mode, data) topology, every method on it, one JSON."""

from __future__ import annotations

import os
import time

from benchmarks.live import measure, topology
from benchmarks.refit.progress import log


def run(s) -> dict:
    import ray

    from benchmarks.provenance import git_commit, loadavg

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    result = {"bench": "live", "settings": {k: getattr(s, k) for k in s.__dataclass_fields__},
              "git": git_commit(), "loadavg_start": loadavg(), "started": time.time(), "cases": []}
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    for receiver in s.receivers:
        for data in s.data:
            for mode in s.modes:
                methods = tuple(m for m in s.methods if m == "dcr" or mode == "in_place")
                if not methods:
                    continue
                topo, step = topology.launch(s, receiver, mode, data)
                try:
                    cases = measure.run_case(topo, s, receiver, mode, data, methods, step)
                finally:
                    topo.shutdown()
                for c in cases:
                    log(f"  {c['method']:<12} {c['mode']:<8} pause {c['pause_seconds']:.3f}s stall "
                        f"{c['trainer_stall_seconds']:.3f}s fresh {c['freshness_seconds']:.3f}s "
                        f"exact {c['bit_exact']}")
                result["cases"] += cases
    result["loadavg_end"] = loadavg()
    result["seconds"] = time.time() - result["started"]
    result["targets"] = targets(result["cases"])
    return result


def _find(cases, **kw):
    return next((c for c in cases if all(c.get(k) == v for k, v in kw.items())), None)


def targets(cases: list[dict]) -> list[dict]:
    """Issue 28's targets, each met or unmet with its numbers (only where both sides were measured)."""
    out = []
    for data in sorted({c["data"] for c in cases}):
        staged = _find(cases, method="dcr", mode="staged", receiver="hf", data=data)
        dense = _find(cases, method="dense_sync", receiver="hf", data=data)
        fetch = _find(cases, method="fetch_reload", receiver="hf", data=data)
        if staged and dense and dense["pause_seconds"]:
            r = staged["pause_seconds"] / dense["pause_seconds"]
            out.append({"target": f"HF staged pause <= 0.1x dense sync's ({data})", "value": r, "met": r <= 0.1})
        if staged and fetch and fetch["pause_seconds"] and data == "adamw":
            r = staged["pause_seconds"] / fetch["pause_seconds"]
            out.append({"target": "HF staged pause <= 0.5x fetch-then-reload's (adamw)", "value": r,
                        "met": r <= 0.5})
        if staged and fetch and fetch["pause_seconds"] and data != "adamw":
            r = staged["pause_seconds"] / fetch["pause_seconds"]
            out.append({"target": f"(reported) HF staged pause / fetch-then-reload's ({data})", "value": r,
                        "met": None})
    for c in cases:
        if c["method"] != "dcr":
            continue
        tag = f"{c['receiver']} {c['mode']} {c['data']}"
        if c["construct_seconds"]:
            r = c["trainer_stall_seconds"] / c["construct_seconds"]
            out.append({"target": f"trainer stall <= 1.2x construct ({tag})", "value": r, "met": r <= 1.2})
        if c["refit_seconds"]:
            r = c["freshness_seconds"] / c["refit_seconds"]
            out.append({"target": f"freshness <= 1.2x refit seconds ({tag})", "value": r, "met": r <= 1.2})
    return out
