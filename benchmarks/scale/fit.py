"""Slopes, their R², growth exponents and the issue's targets, from the measured points (numpy only).

Every fitted *series* is ``y`` against one measured ``x`` over the points of one sweep:

- :func:`linear`: least squares ``y = intercept + slope * x`` (``numpy.linalg.lstsq``) and its R², the
  share of ``y``'s variance the line explains (None when ``y`` does not vary: there is nothing to explain);
- :func:`exponent`: ``k`` of a power law ``y = a * x^k`` fitted in log-log space (points with ``x, y > 0``),
  over all points and over the *top* of the range (``x >= x_max / TOP_RANGE``): a fixed cost lowers the
  exponent of the small points and could hide a quadratic term there, not at the top. ``k`` near 1 is linear;
  either exponent above ``SUPERLINEAR`` flags a term that grows faster than the work (:func:`flags`). A series
  whose largest value is under its noise floor is not flagged: a coordinator going from 2 MB to 9 MB is a
  large exponent of nothing.

:func:`slopes` fits the series the issue names (seconds per changed GB, memory per model GB per role, seconds
and CPU per engine and per cluster); :func:`targets` evaluates the issue's targets, each ``{"met", "value",
"limit"}`` with what was compared.
"""

from __future__ import annotations

import math

#: A power-law exponent above this flags a term growing faster than the work.
SUPERLINEAR = 1.15
#: The top of a series' range, for its second exponent: points with x >= x_max / TOP_RANGE (sizes: 200M-1.2B).
TOP_RANGE = 20.0
#: Below these a series is noise, not growth (largest value): seconds, bytes.
NOISE_FLOOR_S = 0.05
NOISE_FLOOR_BYTES = 32 << 20
GB = 1e9
MB = 1 << 20
#: The issue's targets (what each is compared with is in :func:`targets`).
TARGETS = {
    "owner_extra_per_share_max": 1.1, "owner_extra_fixed_bytes": 256 * MB,
    "engine_extra_per_changed_max": 3.0, "engine_extra_fixed_bytes": 256 * MB,
    "relay_buckets_per_child_max": 4,
    "coordinator_bytes_max": 300 * MB,
    "refit_time_r2_min": 0.95,
    "engine_added_cost_max": 0.1,
}
#: Roles of a point's per-role figures.
ROLES = ("owner", "relay", "coordinator", "engine")


def linear(xs, ys) -> dict | None:
    """Least-squares line through ``(xs, ys)``: ``{"slope", "intercept", "r2", "n"}``; None under two
    distinct ``x``; ``r2`` None when ``y`` does not vary."""
    import numpy as np

    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if len(x) < 2 or np.ptp(x) == 0:
        return None
    a = np.stack([np.ones_like(x), x], axis=1)
    (b0, b1), *_ = np.linalg.lstsq(a, y, rcond=None)
    ss_res = float(np.sum((y - (b0 + b1 * x)) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    # R² of a y that does not vary is undefined (None): a flat line fits it, and its slope says so
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 1e-12 * float(np.sum(y * y)) else None
    return {"slope": float(b1), "intercept": float(b0), "r2": r2, "n": int(len(x))}


def exponent(xs, ys) -> float | None:
    """Exponent ``k`` of ``y = a * x^k`` (log-log least squares over the points with ``x > 0`` and
    ``y > 0``); None under two such points with distinct ``x``."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    fit = linear([p[0] for p in pts], [p[1] for p in pts]) if len(pts) >= 2 else None
    return None if fit is None else fit["slope"]


def series(name: str, xs, ys, *, x: str, y: str, floor: float) -> dict:
    """One fitted series: its points, line, exponent and whether it grows faster than linear."""
    pairs = [(float(a), float(b)) for a, b in zip(xs, ys) if b is not None]  # a figure not read is left out
    xs, ys = [a for a, _ in pairs], [b for _, b in pairs]
    fit = linear(xs, ys)
    k = exponent(xs, ys)
    top = [(a, b) for a, b in zip(xs, ys) if xs and a >= max(xs) / TOP_RANGE]
    k_top = exponent([a for a, _ in top], [b for _, b in top])
    big = bool(ys) and max(ys) >= floor
    worst = max((v for v in (k, k_top) if v is not None), default=None)
    return {"name": name, "x": x, "y": y, "xs": xs, "ys": ys, "fit": fit, "exponent": k, "exponent_top": k_top,
            "noise_floor": floor, "superlinear": bool(worst is not None and worst > SUPERLINEAR and big)}


def flags(fits: dict) -> list[str]:
    """Names of the fitted series that grow faster than linear."""
    return [name for name, s in fits.items() if s.get("superlinear")]


def slopes(points: dict, sweeps: dict) -> dict:
    """The fitted series of one run. ``points``: key -> measured point (:mod:`.measure`); ``sweeps``: sweep ->
    point keys. Sizes fit against changed GB (time, CPU where the work is the change) or model / share GB
    (memory, the owners' diff, which scans the whole share); fan-out against engines or clusters."""
    out = {}

    def got(name):
        return [points[k] for k in sweeps.get(name, []) if k in points and points[k].get("ok")]

    size = got("size")
    if size:
        ch = [p["changed_bytes"] / GB for p in size]
        model = [p["model_bytes"] / GB for p in size]
        share = [p["owner_share_bytes"] / GB for p in size]
        out["refit_s_per_changed_gb"] = series("refit_s_per_changed_gb", ch, [p["refit_s"] for p in size],
                                               x="changed GB", y="refit s", floor=NOISE_FLOOR_S)
        out["engine_cpu_s_per_changed_gb"] = series(
            "engine_cpu_s_per_changed_gb", ch, [p["cpu_s"]["engine"]["max"] for p in size],
            x="changed GB", y="slowest engine CPU s", floor=NOISE_FLOOR_S)
        out["relay_cpu_s_per_changed_gb"] = series(
            "relay_cpu_s_per_changed_gb", ch, [p["cpu_s"]["relay"]["max"] for p in size],
            x="changed GB", y="slowest relay CPU s", floor=NOISE_FLOOR_S)
        out["coordinator_cpu_s_per_changed_gb"] = series(
            "coordinator_cpu_s_per_changed_gb", ch, [p["cpu_s"]["coordinator"]["max"] for p in size],
            x="changed GB", y="coordinator CPU s", floor=NOISE_FLOOR_S)
        out["owner_cpu_s_per_share_gb"] = series(
            "owner_cpu_s_per_share_gb", share, [p["cpu_s"]["owner"]["max"] for p in size],
            x="owner share GB", y="slowest owner CPU s", floor=NOISE_FLOOR_S)
        out["wire_bytes_per_changed_gb"] = series(
            "wire_bytes_per_changed_gb", ch, [p["wire_bytes"] for p in size], x="changed GB", y="wire bytes",
            floor=NOISE_FLOOR_BYTES)
        out["store_peak_bytes_per_model_gb"] = series(
            "store_peak_bytes_per_model_gb", model, [p["store"]["peak_above_before_bytes"] for p in size],
            x="model GB", y="object store peak above its level before the refit, bytes", floor=NOISE_FLOOR_BYTES)
        for role in ROLES:
            xs = share if role == "owner" else model
            out[f"{role}_memory_per_{'share' if role == 'owner' else 'model'}_gb"] = series(
                f"{role}_memory_per_{'share' if role == 'owner' else 'model'}_gb", xs,
                [p["memory"][role]["peak_above_start_max"] for p in size],
                x="owner share GB" if role == "owner" else "model GB",
                y=f"{role} peak RSS above its start, bytes (largest {role})", floor=NOISE_FLOOR_BYTES)
    for sweep, x in (("engines", "engines"), ("clusters", "clusters")):
        pts = got(sweep)
        if not pts:
            continue
        xs = [p["engines_per_cluster"] if sweep == "engines" else p["clusters"] for p in pts]
        out[f"refit_s_per_{x[:-1]}"] = series(f"refit_s_per_{x[:-1]}", xs, [p["refit_s"] for p in pts],
                                              x=x, y="refit s", floor=NOISE_FLOOR_S)
        out[f"derived_streamed_s_per_{x[:-1]}"] = series(
            f"derived_streamed_s_per_{x[:-1]}", xs, [p["derived_streamed_s"] for p in pts], x=x,
            y="busiest actor's CPU s (derived: a core per actor)", floor=NOISE_FLOOR_S)
        for role in ROLES:
            out[f"{role}_cpu_s_per_{x[:-1]}"] = series(
                f"{role}_cpu_s_per_{x[:-1]}", xs, [p["cpu_s"][role]["sum"] for p in pts], x=x,
                y=f"{role} CPU s, all {role}s", floor=NOISE_FLOOR_S)
            out[f"{role}_memory_per_{x[:-1]}"] = series(
                f"{role}_memory_per_{x[:-1]}", xs, [p["memory"][role]["peak_above_start_max"] for p in pts], x=x,
                y=f"{role} peak RSS above its start, bytes (largest {role})", floor=NOISE_FLOOR_BYTES)
    return out


def _worst(rows: list[dict]) -> dict:
    """The row with the highest value / limit (the one that decides ``met``)."""
    return max(rows, key=lambda r: r["value"] / r["limit"] if r["limit"] else math.inf)


def targets(points: dict, sweeps: dict, fits: dict, bucket_bytes: int) -> dict:
    """The issue's targets on this run: ``{name: {"target", "met", "value", "limit", ...}}``. ``met`` is None
    where the run measured nothing to judge it by (a sweep left out). Memory targets are judged at every
    size point (the worst point decides); ``value`` and ``limit`` are that point's."""
    t = TARGETS
    size = [points[k] for k in sweeps.get("size", []) if k in points and points[k].get("ok")]
    out = {}

    def judged(name, text, rows, **extra):
        if not rows:
            out[name] = {"target": text, "met": None, "value": None, "limit": None, **extra}
            return
        w = _worst(rows)
        out[name] = {"target": text, "met": all(r["value"] <= r["limit"] for r in rows), "value": w["value"],
                     "limit": w["limit"], "at": w["at"], "every": rows, **extra}

    judged("owner_memory", "owner peak RSS above its start and its own tensors <= 1.1 x its share + 256 MB",
           [{"at": p["key"], "value": p["memory"]["owner"]["peak_above_start_max"] - p["owner_share_bytes"],
             "limit": t["owner_extra_per_share_max"] * p["owner_share_bytes"] + t["owner_extra_fixed_bytes"]}
            for p in size])
    judged("engine_memory", "engine peak RSS above its start and its model during a refit <= 3 x the changed bytes "
           "+ 256 MB",
           [{"at": p["key"], "value": p["memory"]["engine"]["peak_above_start_max"] - p["model_bytes"],
             "limit": t["engine_extra_per_changed_max"] * p["changed_bytes"] + t["engine_extra_fixed_bytes"]}
            for p in size])
    fan = [points[k] for name in ("size", "engines", "clusters") for k in sweeps.get(name, [])
           if k in points and points[k].get("ok")]
    judged("relay_memory", "relay peak RSS above its start <= 4 payload buckets per child, at every size and fan-out",
           [{"at": f"{p['key']} {rid}", "value": r["peak_above_start"],
             "limit": t["relay_buckets_per_child_max"] * bucket_bytes * max(1, r["children"])}
            for p in _unique(fan) for rid, r in p["memory"]["relay"]["each"].items()],
           note="RSS only: the payload copies a relay keeps until the transfer ends live in Ray's object store "
                "(a point's store columns), not in its process")
    judged("coordinator_memory", "coordinator peak RSS above its start <= 300 MB at every size",
           [{"at": p["key"], "value": p["memory"]["coordinator"]["peak_above_start_max"],
             "limit": t["coordinator_bytes_max"]} for p in size],
           absolute_peak_bytes=max((p["memory"]["coordinator"]["peak_max"] for p in size), default=None),
           growth=fits.get("coordinator_memory_per_model_gb", {}).get("fit"))
    f = fits.get("refit_s_per_changed_gb")
    r2 = ((f or {}).get("fit") or {}).get("r2")
    out["refit_time_linear"] = {"target": "refit time linear in changed bytes (R² >= 0.95)",
                                "met": None if r2 is None else bool(r2 >= t["refit_time_r2_min"]), "value": r2,
                                "limit": t["refit_time_r2_min"], "exponent": (f or {}).get("exponent")}
    out.update(_per_engine(points, sweeps, fits))
    return out


def _unique(points: list[dict]) -> list[dict]:
    seen, out = set(), []
    for p in points:
        if p["key"] not in seen:
            seen.add(p["key"])
            out.append(p)
    return out


def _per_engine(points: dict, sweeps: dict, fits: dict) -> dict:
    """Each engine added to a cluster costs <= 0.1 x a refit (the refit's time at one engine), measured on
    this machine's shared cores and derived with a core per actor (the busiest actor's CPU seconds), and the
    owners' CPU does not grow with engines (the same bound on their slope over their CPU at one engine)."""
    t = TARGETS["engine_added_cost_max"]
    pts = sorted((points[k] for k in sweeps.get("engines", []) if k in points and points[k].get("ok")),
                 key=lambda p: p["engines_per_cluster"])
    out = {}
    f, fo = fits.get("refit_s_per_engine"), fits.get("owner_cpu_s_per_engine")
    if not pts or f is None or f["fit"] is None:
        for name, text in (("engine_added_cost", "each engine added to a cluster costs <= 0.1 x a refit"),
                           ("engine_added_cost_derived", "each engine added costs <= 0.1 x a refit, derived with a "
                                                         "core per actor (busiest actor's CPU)"),
                           ("owners_flat_in_engines", "owners' CPU per engine added <= 0.1 x their CPU at one engine")):
            out[name] = {"target": text, "met": None, "value": None, "limit": t}
        return out
    base = pts[0]
    v = f["fit"]["slope"] / base["refit_s"] if base["refit_s"] else None
    out["engine_added_cost"] = {"target": "each engine added to a cluster costs <= 0.1 x a refit",
                                "met": None if v is None else bool(v <= t), "value": v, "limit": t,
                                "s_per_engine": f["fit"]["slope"], "r2": f["fit"]["r2"],
                                "refit_s_at": {base["key"]: base["refit_s"]}}
    fd = fits.get("derived_streamed_s_per_engine")
    vd = fd["fit"]["slope"] / base["derived_streamed_s"] if fd and fd["fit"] and base["derived_streamed_s"] else None
    out["engine_added_cost_derived"] = {
        "target": "each engine added costs <= 0.1 x a refit, derived with a core per actor (busiest actor's CPU)",
        "met": None if vd is None else bool(vd <= t), "value": vd, "limit": t,
        "s_per_engine": fd["fit"]["slope"] if fd and fd["fit"] else None}
    o0 = base["cpu_s"]["owner"]["sum"]
    vo = fo["fit"]["slope"] / o0 if fo and fo["fit"] and o0 else None
    out["owners_flat_in_engines"] = {"target": "owners' CPU per engine added <= 0.1 x their CPU at one engine",
                                     "met": None if vo is None else bool(vo <= t), "value": vo, "limit": t,
                                     "owner_cpu_s_per_engine": fo["fit"]["slope"] if fo and fo["fit"] else None}
    return out
