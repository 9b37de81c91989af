"""The whole sweep (:func:`run_sweep`): every point of the plan once, then the slopes, targets and projection
derived from them, as one JSON-able dict (written after every point when a path is given, so a run cut short
keeps what it measured)."""

from __future__ import annotations

import os
import platform
import time

from benchmarks import provenance
from benchmarks.refit.progress import log
from benchmarks.scale import fit, plan

#: A point runs only when its estimated peak memory is under this share of ``MemAvailable``.
MEMORY_HEADROOM = 0.9


def run_sweep(p: plan.Plan, *, quick: bool, seed: int = 0, link_mbps: float | None = None,
              latency_s: float = 0.025, memory_guard: bool = True, bytes_per_change: dict | None = None,
              checkpoint=None) -> dict:
    """Run every point of ``p``; ``checkpoint(result)`` is called after each (the CLI writes the JSON there)."""
    import numpy as np
    import ray
    import torch

    from benchmarks.refit.runner import _cpu_model, _init_ray
    from benchmarks.scale import measure, probes

    t_start = time.perf_counter()
    _init_ray()
    from dcr_ray.config import CodecConfig

    sweeps = {name: [pt.key for pt in pts] for name, pts in p.sweeps().items()}
    points = p.points()
    result = {"bench": "scale", "git": provenance.git_commit(), "quick": quick, "change_rate": plan.CHANGE_RATE,
              "settings": {"sizes": list(p.sizes), "engines": list(p.engines), "clusters": list(p.clusters),
                           "fanout_size": p.fanout_size, "cluster_engines": p.cluster_engines,
                           "size_engines": plan.SIZE_ENGINES, "owners": plan.OWNERS, "seed": seed,
                           "link_mbps": link_mbps, "latency_s": latency_s if link_mbps else 0.0,
                           "projection_latency_s": latency_s, "bucket_bytes": CodecConfig().bucket_bytes,
                           "memory_guard": memory_guard, "memory_headroom": MEMORY_HEADROOM,
                           "warmup_refits": measure.QUICK_WARMUP_REFITS if quick else measure.WARMUP_REFITS,
                           "measured_refits": measure.QUICK_MEASURED_REFITS if quick else measure.MEASURED_REFITS},
              "sweeps": sweeps, "order": [pt.key for pt in points], "points": {}, "skipped": {},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": _cpu_model(),
                          "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                          "python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
                          "ray": ray.__version__, "loadavg_start": provenance.loadavg()}}
    log(f"dcr-ray bench scale ({'quick' if quick else 'full'}): {len(points)} topologies, "
        f"{', '.join(pt.key for pt in points)}")
    idle = {role: probes.idle_rss(mod) for role, mod in probes.ROLE_MODULES.items()}
    result["idle_rss"] = {role: v["rss"] for role, v in idle.items()}
    result["idle_loaded"] = {role: v["loaded"] for role, v in idle.items()}
    result["settings"]["prefork_workers"] = probes.prefork_workers()
    for pt in points:
        peaks = {k: v for k, v in _peaks(result["points"]).items() if k[1:] == (pt.clusters, pt.engines)}
        est = plan.estimate_bytes(pt, {k[0]: v for k, v in peaks.items()})
        avail = probes.mem_available()
        if memory_guard and est > MEMORY_HEADROOM * avail:
            reason = (f"estimated peak {est / 2**30:.1f} GiB > {MEMORY_HEADROOM:.0%} of MemAvailable "
                      f"{avail / 2**30:.1f} GiB (--no-memory-guard runs it anyway)")
            result["skipped"][pt.key] = reason
            log(f"  {pt.key}: skipped: {reason}")
            continue
        log(f"  {pt.key}: launching (estimated peak {est / 2**30:.1f} GiB of {avail / 2**30:.1f} GiB available)")
        rec = measure.run_point(pt, quick=quick, idle=result["idle_rss"], seed=seed, link_mbps=link_mbps,
                                latency_s=latency_s)
        rec["memory_estimate_bytes"], rec["mem_available_bytes"] = est, avail
        result["points"][pt.key] = rec
        if rec["ok"]:
            log(f"  {pt.key}: {_short(rec)}")
        derive(result, bytes_per_change)
        result["elapsed_s"] = time.perf_counter() - t_start
        if checkpoint is not None:
            checkpoint(result)
    result["machine"]["loadavg_end"] = provenance.loadavg()
    derive(result, bytes_per_change)
    result["elapsed_s"] = time.perf_counter() - t_start
    log(f"finished in {result['elapsed_s']:.1f}s")
    return result


def derive(result: dict, bytes_per_change: dict | None = None) -> dict:
    """Fill ``fits``, ``superlinear``, ``targets`` and ``projection`` from ``result["points"]`` (pure: tests and
    ``dcr-ray bench scale --from JSON`` recompute them from a run's points)."""
    from benchmarks.refit.large_models import projection_from_scale

    pts, sweeps = result["points"], result["sweeps"]
    result["fits"] = fit.slopes(pts, sweeps)
    result["superlinear"] = fit.flags(result["fits"])
    result["targets"] = fit.targets(pts, sweeps, result["fits"], result["settings"]["bucket_bytes"])
    result["targets_met"] = all(t["met"] is not False for t in result["targets"].values()) and all(
        p.get("ok") for p in pts.values())
    result["projection"] = projection_from_scale(result, bytes_per_change=bytes_per_change)
    return result


def _peaks(points: dict) -> dict:
    """``{(size, clusters, engines): (peak bytes, start bytes)}``: every process's peak (during the refits, or
    through its launch where that was higher) plus the object store's peak, and every process's start: what the
    next size's estimate scales (:func:`benchmarks.scale.plan.estimate_bytes`)."""
    out = {}
    for rec in points.values():
        if not rec.get("ok"):
            continue
        each = [v for role in rec["memory"].values() for v in role["each"].values()]
        procs = sum(max(v["peak"], v.get("launch_hwm") or 0) for v in each)
        start = sum(v.get("start") or 0 for v in each)
        out[(rec["size"], rec["clusters"], rec["engines_per_cluster"])] = (
            procs + (rec["store"]["peak_bytes"] or 0), start)
    return out


def _short(r: dict) -> str:
    m, c = r["memory"], r["cpu_s"]
    return (f"refit {r['refit_s']:.2f}s (changed {r['changed_bytes'] / 1e6:.1f} MB, "
            f"wire {r['wire_bytes'] / 1e6:.1f} MB); "
            f"CPU s owner {c['owner']['max']:.2f} relay {c['relay']['max']:.2f} coord {c['coordinator']['max']:.2f} "
            f"engine {c['engine']['max']:.2f}; above start MiB owner {_mb(m['owner']['peak_above_start_max'])} relay "
            f"{_mb(m['relay']['peak_above_start_max'])} coord {_mb(m['coordinator']['peak_above_start_max'])} engine "
            f"{_mb(m['engine']['peak_above_start_max'])}; "
            f"store peak +{_mb(r['store']['peak_above_before_bytes'])} MiB; "
            f"exact={r['bit_exact']}")


def _mb(v) -> str:
    return "-" if v is None else f"{v / 2**20:.0f}"
