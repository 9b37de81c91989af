"""Output of a scale run: the text table (points, fitted slopes, targets, projection) and a PNG."""

from __future__ import annotations

from benchmarks.common import text_rows
from benchmarks.scale.fit import ROLES

MiB = 1 << 20


def _mib(v):
    return None if v is None else v / MiB


def point_rows(r: dict) -> list[str]:
    """One row per measured point: time, CPU and memory per role, object store and link bytes."""
    cols = [("point", 16, "{}"), ("sweeps", 16, "{}"), ("changed MB", 10, "{:.1f}"), ("wire MB", 8, "{:.1f}"),
            ("refit s", 7, "{:.2f}"), ("ready s", 7, "{:.2f}"),
            *[(f"{role[:5]} CPU s", 11, "{:.2f}") for role in ROLES],
            *[(f"{role[:5]} +MiB", 10, "{:.0f}") for role in ROLES],
            ("store +MiB", 10, "{:.0f}"), ("created MiB", 11, "{:.0f}"), ("boundary MB", 11, "{:.1f}"),
            ("exact", 5, "{}")]
    member = {}
    for name, keys in r["sweeps"].items():
        for k in keys:
            member.setdefault(k, []).append(name)
    rows = []
    for key in r.get("order", r["points"]):
        p = r["points"].get(key)
        if p is None:
            rows.append([key, ",".join(member.get(key, [])), *[None] * 15, "skipped"])
            continue
        if not p.get("ok") and "memory" not in p:
            rows.append([key, ",".join(member.get(key, [])), *[None] * 15, "FAILED"])
            continue
        m, c = p["memory"], p["cpu_s"]
        rows.append([key, ",".join(member.get(key, [])), p["changed_bytes"] / 1e6, p["wire_bytes"] / 1e6, p["refit_s"],
                     p["ready_s"], *[c[role]["max"] for role in ROLES],
                     *[_mib(m[role]["peak_above_start_max"]) for role in ROLES],
                     _mib(p["store"]["peak_above_before_bytes"]), _mib(p["store"]["created_bytes"]),
                     sum(p["links"]["boundary"].values()) / 1e6, "yes" if p.get("bit_exact") else "NO"])
    return text_rows(cols, rows)


def fit_rows(r: dict) -> list[str]:
    """One row per fitted series: slope (per x unit), intercept, R², power-law exponent, flag."""
    cols = [("series", 36, "{}"), ("x", 14, "{}"), ("slope", 12, "{:.4g}"), ("intercept", 12, "{:.4g}"),
            ("R2", 6, "{:.3f}"), ("exponent", 8, "{:.2f}"), ("top exp.", 8, "{:.2f}"), ("faster than linear", 18, "{}")]
    rows = []
    for name, s in r.get("fits", {}).items():
        f = s.get("fit") or {}
        rows.append([name, s["x"], f.get("slope"), f.get("intercept"), f.get("r2"), s.get("exponent"),
                     s.get("exponent_top"), "YES" if s.get("superlinear") else ""])
    return text_rows(cols, rows)


def target_rows(r: dict) -> list[str]:
    out = []
    for name, t in r.get("targets", {}).items():
        met = {True: "met", False: "NOT MET", None: "not measured"}[t["met"]]
        val = t.get("value")
        if val is not None and "memory" in name:
            detail = f"{val / MiB:.0f} MiB vs limit {t['limit'] / MiB:.0f} MiB at {t.get('at')}"
        elif val is not None:
            detail = f"{val:.3f} vs limit {t['limit']:g}"
        else:
            detail = "-"
        out.append(f"  {met:12} {name}: {t['target']} ({detail})")
    return out


def projection_rows(r: dict) -> list[str]:
    pr = r.get("projection")
    if not pr:
        return ["  (no size slopes: no projection)"]
    cols = [("model", 6, "{}"), ("rate", 5, "{:.0%}"), ("construct s", 11, "{:.2f}"), ("link s", 8, "{:.2f}"),
            ("relay s", 8, "{:.2f}"), ("apply s", 8, "{:.2f}"), ("final s", 8, "{:.2f}"), ("refit s", 8, "{:.2f}"),
            ("ref s", 8, "{:.1f}"), ("speedup", 8, "{:.1f}x"), ("bound", 9, "{}")]
    rows = [[x["model"], x["change_rate"], x["construct_s"], x["link_s"], x["relay_s"], x["apply_s"], x["finalize_s"],
             x["refit_s"], x["reference_s"], x["speedup"], x["bound"]] for x in pr["rows"]]
    return [f"  {pr['label']}: {pr['owners']} owners, {pr['appliers']} appliers, {pr['link_mbps']:g} Mbit/s; "
            f"CPU inputs a GPU changes: {', '.join(pr['gpu_inputs'])}", *text_rows(cols, rows)]


def format_table(r: dict) -> str:
    lines = [f"dcr-ray bench scale ({'quick' if r.get('quick') else 'full'}): 1% uniform change, "
             f"{r['settings']['owners']} owners, relay trees; per role the slowest (CPU) or largest (memory) actor; "
             f"+MiB = peak RSS above the process's start; store = Ray object store above its level before the refit",
             *point_rows(r), ""]
    for key, why in r.get("skipped", {}).items():
        lines.append(f"  skipped {key}: {why}")
    for key, p in r["points"].items():
        if not p.get("ok"):
            lines.append(f"  FAILED {key}: {p.get('error')}")
    lines += ["", "fitted series:", *fit_rows(r), "",
              f"faster than linear (either exponent > 1.15): {', '.join(r.get('superlinear') or []) or 'none'}", "",
              "targets:", *target_rows(r), "", "projection:", *projection_rows(r)]
    if r.get("elapsed_s") is not None:
        lines.append(f"\nelapsed {r['elapsed_s']:.0f} s")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    """Top left: refit seconds vs changed GB (size sweep) with its line. Top right: peak RSS above start per role
    vs model GB. Bottom left: refit seconds and CPU seconds per role vs engines per cluster. Bottom right: the
    same vs clusters."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fits = r.get("fits", {})
    fig, axes = plt.subplots(2, 2, figsize=(14, 10))
    ax, bx, cx, dx = axes.flat

    def line(axis, s, label, color, scale=1.0):
        if not s:
            return
        axis.plot(s["xs"], [y * scale for y in s["ys"]], "o", color=color, label=label)
        f = s.get("fit")
        if f:
            lo, hi = min(s["xs"]), max(s["xs"])
            axis.plot([lo, hi], [(f["intercept"] + f["slope"] * x) * scale for x in (lo, hi)], "-", color=color,
                      lw=1, alpha=0.7)

    s = fits.get("refit_s_per_changed_gb")
    line(ax, s, "refit s", "C0")
    if s and s.get("fit"):
        r2 = s["fit"]["r2"]
        ax.set_title(f"refit time vs changed bytes: {s['fit']['slope']:.2f} s/GB, R² "
                     + ("-" if r2 is None else f"{r2:.3f}"))
    ax.set_xlabel("changed GB (1% of the model)")
    ax.set_ylabel("refit s (coordinator: arrival -> activate)")
    for i, role in enumerate(("owner", "relay", "coordinator", "engine")):
        key = "owner_memory_per_share_gb" if role == "owner" else f"{role}_memory_per_model_gb"
        ss = fits.get(key)
        if ss and role == "owner":  # on the model axis like the others: the owners share the model
            k = r["settings"]["owners"]
            f = ss.get("fit")
            ss = {**ss, "xs": [x * k for x in ss["xs"]],
                  "fit": f and {**f, "slope": f["slope"] / k}}
        line(bx, ss, role, f"C{i}", 1 / 2**30)
    bx.set_xlabel("model GB (BF16)")
    bx.set_ylabel("peak RSS above the process's start, GiB (largest of the role)")
    bx.set_title("memory per role vs model size")
    for axis, sweep in ((cx, "engine"), (dx, "cluster")):
        line(axis, fits.get(f"refit_s_per_{sweep}"), "refit s", "k")
        for i, role in enumerate(ROLES):
            line(axis, fits.get(f"{role}_cpu_s_per_{sweep}"), f"{role} CPU s (all)", f"C{i}")
        axis.set_xlabel(f"{sweep}s" + (" per cluster" if sweep == "engine" else ""))
        axis.set_ylabel("seconds")
        axis.set_title(f"refit and CPU per role vs {sweep}s ({r['settings']['fanout_size']} model)")
    for axis in axes.flat:
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    fig.suptitle(f"dcr-ray bench scale ({'quick' if r.get('quick') else 'full'}), measured on "
                 f"{r['machine']['cpus']} cores; git {str((r.get('git') or {}).get('commit'))[:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _md(cols: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
            *["| " + " | ".join("-" if v is None else str(v) for v in row) + " |" for row in rows]]


def _f(v, fmt="{:.2f}"):
    return None if v is None else fmt.format(v)


def markdown(r: dict) -> str:
    """The run's tables in Markdown (``dcr-ray bench markdown``, for BENCHMARKS.md): points, fitted series,
    targets, projection."""
    out = []
    rows = []
    for key in r.get("order", r["points"]):
        p = r["points"].get(key)
        if p is None or "memory" not in p:
            rows.append([key, "skipped" if p is None else "FAILED", *[None] * 14])
            continue
        m, c = p["memory"], p["cpu_s"]
        rows.append([key, "yes" if p.get("bit_exact") else "NO", _f(p["changed_bytes"] / 1e6, "{:.1f}"),
                     _f(p["wire_bytes"] / 1e6, "{:.1f}"), _f(p["refit_s"]),
                     *[_f(c[role]["max"]) for role in ROLES],
                     *[_f(_mib(m[role]["peak_above_start_max"]), "{:.0f}") for role in ROLES],
                     _f(_mib(m["engine"]["added_by_refit_max"]), "{:.0f}"),
                     _f(_mib(p["store"]["peak_above_before_bytes"]), "{:.0f}"),
                     _f(sum(p["links"]["boundary"].values()) / 1e6, "{:.1f}"),
                     _f(p.get("derived_streamed_s"))])
    out += _md(["point (size/clusters/engines per cluster)", "exact", "changed MB", "wire MB", "refit s",
                *[f"{role} CPU s" for role in ROLES], *[f"{role} +MiB" for role in ROLES], "engine added by refit MiB",
                "store +MiB", "boundary MB", "busiest actor CPU s (derived)"], rows)
    out.append("")
    out += _md(["series", "x", "slope", "intercept", "R²", "exponent (all / top)", "faster than linear"],
               [[name, s["x"], _f((s.get("fit") or {}).get("slope"), "{:.4g}"),
                 _f((s.get("fit") or {}).get("intercept"), "{:.4g}"), _f((s.get("fit") or {}).get("r2"), "{:.3f}"),
                 f"{_f(s.get('exponent')) or '-'} / {_f(s.get('exponent_top')) or '-'}",
                 "**yes**" if s.get("superlinear") else "no"] for name, s in r.get("fits", {}).items()])
    out.append("")
    out += [f"- {line.strip()}" for line in target_rows(r)]
    for key, why in r.get("skipped", {}).items():
        out.append(f"- skipped `{key}`: {why}")
    pr = r.get("projection")
    if pr:
        out += ["", f"*{pr['label']}*: {pr['owners']} owners, {pr['appliers']} appliers per replica, "
                    f"{pr['link_mbps']:g} Mbit/s; inputs a GPU changes: {', '.join(pr['gpu_inputs'])} "
                    f"({', '.join(f'{k}: {v}' for k, v in pr['inputs_from'].items())}).", ""]
        out += _md(["model", "rate", "construct s", "link s", "relay s", "apply s", "finalize s", "refit s",
                    "reference s", "speedup", "bound"],
                   [[x["model"], f"{x['change_rate']:.0%}", _f(x["construct_s"]), _f(x["link_s"]), _f(x["relay_s"]),
                     _f(x["apply_s"]), _f(x["finalize_s"]), _f(x["refit_s"]), _f(x["reference_s"], "{:.1f}"),
                     _f(x["speedup"], "{:.1f}x"), x["bound"]] for x in pr["rows"]])
    return "\n".join(out) + "\n"
