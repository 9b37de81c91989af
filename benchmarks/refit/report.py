"""Output of a result: the text table, Markdown tables and a PNG plot."""

from __future__ import annotations

from benchmarks.refit import codings, cpu
from benchmarks.refit.settings import PEERS, TRANSPORTS


def _fmt(v, f="{:.2f}", none="-"):
    return none if v is None else f.format(v)


#: How the receivers are named in the text.
_RECEIVER = {"hf": "transformers engines", "vllm": "vLLM engines (CPU)", "synthetic": "light engines"}


def receivers_markdown(r: dict) -> str:
    """The receiver comparison of the real-update cases, in Markdown."""
    out = ["| receiver | transport | steps | change rate | refit s | apply s (max engine) | apply s per engine "
           "| of which flush s | engine peak GB per engine | added by the refit MB per engine | exact |",
           "|" + "---|" * 11]
    for m in r.get("summary", []):
        per = m.get("per_engine", {})
        out.append(f"| {_RECEIVER.get(m.get('engine_kind'), m['case'])} | {m['transport']} | {m['steps']} | "
                   f"{m['change_rate']:.3%} | {m['dcr_seconds']:.2f} | {_fmt(m.get('apply_seconds'), '{:.3f}')} | "
                   + ", ".join(f"{v['apply_s']:.3f}" for v in per.values()) + " | "
                   + ", ".join(_fmt(v.get("flush_s"), "{:.3f}") for v in per.values()) + " | "
                   + ", ".join(f"{v['peak_bytes'] / 2**30:.2f}" for v in per.values()) + " | "
                   + ", ".join(f"{v.get('added_bytes', 0) / 1e6:.0f}" for v in per.values())
                   + f" | {'yes' if m.get('bit_exact') else 'NO'} |")
    return "\n".join(out) + "\n"


def _mb(v) -> str:
    return "-" if v is None else f"{v / 1e6:.0f}"


def _x(c: dict, k: str) -> str:
    return _fmt(c.get(k), "{:.1f}x")


def _pages(c: dict) -> str:
    """``dirty / changed (of baseline)`` pages of a case's promote."""
    if c.get("changed_pages") is None:
        return "-"
    return f"{_fmt(c.get('dirty_pages'), '{:d}')} / {c['changed_pages']} ({c.get('baseline_pages', 0)})"


#: Columns of the case table (text and Markdown).
HEAD = ["case", "receiver", "transport", "link Mbit/s", "rate", "refit s", "ready s", "promote s", "meas. ref s",
        "meas. dense s", "formula s", "x meas. ref", "x meas. dense", "x formula", "wire MB", "meas. ref MB",
        "meas. dense MB", "byte ratio", "LB/refit", "construct s", "apply s", "dirty / changed pages (baseline)",
        "tensors", "owner GB (share)", "engine GB", "exact", "peer dense s", "areal s", "slime s"]


def _row(c: dict) -> list[str]:
    p = c.get("peers", {})
    return [c.get("case", c["name"]), c.get("engine_kind", "-"), c["transport"], _fmt(c["link_mbps"], "{:g}", "none"),
            f"{c['change_rate']:.2%}", f"{c['dcr_seconds']:.2f}", _fmt(c.get("ready_for_next_seconds")),
            _fmt(c.get("promote_seconds")), _fmt(c.get("measured_reference_seconds")),
            _fmt(c.get("measured_dense_refit_seconds")), _fmt(c["reference_seconds"], "{:.1f}"),
            _x(c, "speedup_vs_measured_reference"), _x(c, "speedup_vs_measured_dense_refit"), _x(c, "speedup"),
            f"{c['wire_bytes'] / 1e6:.2f}", _mb(c.get("measured_reference_bytes")),
            _mb(c.get("measured_dense_refit_bytes")), _fmt(c["byte_ratio"], "{:.1f}"),
            _fmt(c["lower_bound_fraction"], "{:.0%}"), f"{c['construct_s']:.2f}", f"{c['apply_s']:.2f}", _pages(c),
            f"{c.get('tensors', '-')}/{c.get('tensors_total', '-')}",
            f"{c['owner_peak_bytes'] / 2**30:.2f} ({c.get('owner_share_bytes', 0) / 2**30:.2f})",
            f"{c['engine_peak_bytes'] / 2**30:.2f}", "yes" if c["bit_exact"] else "NO",
            *(_fmt(p.get(k), "{:.1f}") for k in PEERS)]


def _rows(r: dict) -> tuple[list[str], list[list[str]]]:
    return HEAD, [_row(c) for c in r["cases"]] + [_row(c) for c in r.get("link_cases") or []]


def format_table(r: dict) -> str:
    """The human-readable report."""
    s = r["settings"]
    head, rows = _rows(r)
    w = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)] if rows else [len(h) for h in head]
    lines = [f"dcr_ray refit benchmark{' (quick)' if r['quick'] else ''}: headline link {s['link_mbps']:g} Mbit/s, "
             f"latency {s['latency_s'] * 1e3:g} ms, {s['engines']} engines, stress model '{s['size']}'",
             "refit = coordinator time prepare..activate (engines serve v+1); ready = until every owner's promote "
             "finished (the next refit can start); meas. ref = uncompressed checkpoint into every engine, meas. dense "
             "= dcr_ray's dense refit (zstd), both measured through the same system and link; formula = canonical "
             "bytes * 8 / link + latency; LB = busiest link's busy time + latency; dirty pages = baseline pages the "
             "promote dirtied (smaps, after msync) vs pages holding a change; peers = measured construction + "
             "link formula + measured apply", "",
             "  ".join(h.rjust(w[i]) for i, h in enumerate(head))]
    lines += ["  ".join(x.rjust(w[i]) for i, x in enumerate(row)) for row in rows]
    if r.get("summary"):
        lines.append("")
        for m in r["summary"]:
            lines.append(f"real AdamW, {_RECEIVER.get(m.get('engine_kind'), m['case'])} ({m['transport']}, mean of "
                         f"{m['steps']} steps): change rate {m['change_rate']:.3%}, refit {m['dcr_seconds']:.2f}s, "
                         f"speedup {_fmt(m.get('speedup_vs_measured_reference'), '{:.1f}x')} vs measured reference, "
                         f"{_fmt(m.get('speedup_vs_measured_dense_refit'), '{:.1f}x')} vs measured dense refit, "
                         f"{_fmt(m.get('speedup'), '{:.1f}x')} vs formula")
        lines += ["", "receivers (real AdamW, per engine: apply = validate + apply + flush of one refit, mean over "
                      "steps; flush = the backend's flush, vLLM: reload into the runtime; peak = max RSS during a refit, + what the refit added to the RSS it began with):"]
        for m in r["summary"]:
            per = ", ".join(f"{e} {v['apply_s']:.3f}s (flush {_fmt(v.get('flush_s'), '{:.3f}')}s) / "
                            f"{v['peak_bytes'] / 2**30:.2f} GB "
                            f"(+{v.get('added_bytes', 0) / 1e6:.0f} MB)"
                            for e, v in m.get("per_engine", {}).items())
            lines.append(f"  {_RECEIVER.get(m.get('engine_kind'), m['case']):26s} {m['transport']:12s} apply "
                         f"{_fmt(m.get('apply_seconds'), '{:.3f}')}s, engine peak "
                         f"{m['engine_peak_max_bytes'] / 2**30:.2f} GB [{per}], "
                         f"exact={'yes' if m.get('bit_exact') else 'NO'}")
    for sv in r.get("served", []):
        eq = {k: "==" if sv[k] else "!=" for k in ("served_storage_exact", "tokens_equal", "logprobs_equal")}
        lines.append(f"  vLLM served ({sv['transport']}) vs a fresh dense vLLM engine at v{sv['version']}: live "
                     f"storage ({sv['served_tensors']} parameters/buffers) {eq['served_storage_exact']}, greedy "
                     f"tokens {eq['tokens_equal']}, logprobs {eq['logprobs_equal']}")
    sw = r.get("sweep")
    if sw:
        lines += ["", f"links ({sw['label']}):",
                  "  link Mbit/s  refit s  ready s  meas. ref s  meas. dense s  formula s  x meas. ref  x meas. dense  "
                  "x formula  byte ratio  LB/refit"]
        for m in sw["measured"]:
            lines.append(f"  {_fmt(m['link_mbps'], '{:g}', 'none'):>11}  {m['dcr_seconds']:7.2f}  "
                         f"{_fmt(m['ready_for_next_seconds']):>7}  {_fmt(m['measured_reference_seconds']):>11}  "
                         f"{_fmt(m['measured_dense_refit_seconds']):>13}  {_fmt(m['reference_seconds'], '{:.1f}'):>9}  "
                         f"{_fmt(m['speedup_vs_measured_reference'], '{:.1f}x'):>11}  "
                         f"{_fmt(m['speedup_vs_measured_dense_refit'], '{:.1f}x'):>13}  "
                         f"{_fmt(m['speedup'], '{:.1f}x'):>9}  {_fmt(m['byte_ratio'], '{:.1f}'):>10}  "
                         f"{_fmt(m['lower_bound_fraction'], '{:.0%}'):>8}" + ("  (headline)" if m["headline"] else ""))
    for row in r.get("coding_cases", []):
        med = row["median_s"]
        lines.append(f"  codings at {codings._link(row)} (median of {row['rounds']}): plain {med['plain']:.2f}s, "
                     f"context {med['context']:.2f}s, auto {med['auto']:.2f}s = {row['auto_over_best']:.2f}x the "
                     f"better; auto chose {', '.join(x['coding'] for x in row['auto_chose'])}")
    pj = r.get("projection")
    if pj:
        lines += ["", f"PROJECTION (not measured): {pj['link_mbps'] / 1e3:g} Gbit/s at the cluster boundary, "
                      f"{pj['owners']} owners, {pj['appliers']} appliers per replica, this machine's CPU costs "
                      f"({pj['construct_bytes_per_s_per_owner'] / 1e9:.2f} GB/s construction per owner, "
                      f"{pj['apply_s_per_changed'] * 1e9:.0f} ns apply per changed element)",
                  "  model  rate  wire GB  construct s  link s  apply s  final s  refit s  ref s  speedup  "
                  "floor speedup  bound      NeMo-DCR relay (measured)"]
        for p in pj["rows"]:
            nemo = p.get("nemo_relay")
            ns = f"{nemo['refit_s']:.1f}s vs {nemo['reference_s']:.0f}s ({nemo['speedup']:.1f}x)" if nemo else ""
            lines.append(f"  {p['model']:>5}  {p['change_rate']:.0%}  {p['wire_bytes'] / 1e9:7.2f}  {p['construct_s']:11.1f}  "
                         f"{p['link_s']:6.1f}  {p['apply_s']:7.1f}  {p['finalize_s']:7.1f}  {p['refit_s']:7.1f}  "
                         f"{p['reference_s']:5.0f}  {p['speedup']:6.1f}x  {p['speedup_floor']:12.1f}x  {p['bound']:9s}  {ns}")
    lines += ["", "targets (speedups: stress cases at the headline link, against the measured reference):"]
    for name, per in r["checks"].items():
        bad = [k for k, v in per.items() if not v]
        lines.append(f"  {name:22s} {'PASS' if not bad else 'MISS: ' + ', '.join(bad)}"
                     + ("" if per else " (no cases)"))
    lines.append(f"elapsed {r['elapsed_s']:.1f}s; load average {r['machine']['loadavg_start']} -> "
                 f"{r['machine']['loadavg_end']}")
    return "\n".join(lines)


def markdown(r: dict) -> str:
    """The result tables in Markdown."""
    head, rows = _rows(r)
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    if r.get("summary"):
        out += ["", receivers_markdown(r).rstrip("\n")]
    sw = r.get("sweep")
    if sw:
        out += ["", "| link Mbit/s | refit s | ready for next s | measured reference s | measured dense refit s "
                    "| formula s | speedup vs measured reference | vs measured dense refit | vs formula | byte ratio "
                    "| LB/refit |", "|" + "---|" * 11]
        for m in sw["measured"]:
            out.append(f"| {_fmt(m['link_mbps'], '{:g}', 'none')}{' (headline)' if m['headline'] else ''} | "
                       f"{m['dcr_seconds']:.2f} | {_fmt(m['ready_for_next_seconds'])} | "
                       f"{_fmt(m['measured_reference_seconds'])} | {_fmt(m['measured_dense_refit_seconds'])} | "
                       f"{_fmt(m['reference_seconds'], '{:.1f}')} | "
                       f"**{_fmt(m['speedup_vs_measured_reference'], '{:.1f}x')}** | "
                       f"{_fmt(m['speedup_vs_measured_dense_refit'], '{:.1f}x')} | {_fmt(m['speedup'], '{:.1f}x')} | "
                       f"{_fmt(m['byte_ratio'], '{:.1f}')} | {_fmt(m['lower_bound_fraction'], '{:.0%}')} |")
    if r.get("coding_cases"):
        out += ["", codings.markdown(r["coding_cases"]).rstrip("\n")]
    cpu_rows = [c for c in r["cases"] + list(r.get("link_cases") or []) if "cpu_role_seconds" in c]
    if cpu_rows:
        out += ["", cpu.markdown(cpu_rows).rstrip("\n")]
    pj = r.get("projection")
    if pj:
        out += ["", "| model | rate | wire GB | construct s | link s | apply s | finalize s | refit s (projected) "
                    "| reference s | speedup | link-only speedup | bound | NeMo-DCR relay (measured) |", "|" + "---|" * 13]
        for p in pj["rows"]:
            nemo = p.get("nemo_relay")
            ns = f"{nemo['refit_s']:.1f} s vs {nemo['reference_s']:.0f} s ({nemo['speedup']:.1f}x)" if nemo else ""
            out.append(f"| {p['model']} | {p['change_rate']:.0%} | {p['wire_bytes'] / 1e9:.2f} | {p['construct_s']:.1f} | "
                       f"{p['link_s']:.1f} | {p['apply_s']:.1f} | {p['finalize_s']:.1f} | {p['refit_s']:.1f} | "
                       f"{p['reference_s']:.0f} | {p['speedup']:.1f}x | {p['speedup_floor']:.1f}x | {p['bound']} | {ns} |")
    if r.get("checks"):
        from benchmarks.codec.report import targets_markdown

        out += ["", targets_markdown(r).rstrip("\n")]
    return "\n".join(out) + "\n"


#: How each reference is drawn: (case key, line style, label).
_REFS = (("speedup_vs_measured_reference", "-", "vs measured reference (uncompressed checkpoint)"),
         ("speedup_vs_measured_dense_refit", "--", "vs measured dcr_ray dense refit (zstd)"),
         ("speedup", ":", "vs formula (canonical bytes / link)"))


def plot(r: dict, path: str) -> None:
    """Top left: speedup vs change rate at the headline link, against each reference. Top right: the 3%
    refit at every link. Bottom left: promote (dirtied vs changed baseline pages, promote and ready
    seconds). Bottom right: receivers of the real-update cases (when measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = r["settings"]
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    ax, bx, cx, dx = axes.flat
    colors = {"relay": "C0", "object_store": "C1"}
    head = [c for c in r["cases"] if c.get("case", "").startswith("stress") and c["link_mbps"] == s["link_mbps"]]
    for tr in TRANSPORTS:
        cs = sorted((c for c in head if c["transport"] == tr), key=lambda c: c["change_rate"])
        x = [100 * c["change_rate"] for c in cs]
        for key, ls, label in _REFS:
            pts = [(xi, c[key]) for xi, c in zip(x, cs) if c.get(key)]
            if pts:
                ax.plot(*zip(*pts), ls, marker="o", color=colors[tr], lw=2 if ls == "-" else 1, label=f"{tr}: {label}")
        for case, mk, who in (("adamw", "*", "transformers"), ("adamw-vllm", "P", "vLLM")):
            real = [c for c in r["cases"] if c.get("case") == case and c["transport"] == tr
                    and c.get("speedup_vs_measured_reference")]
            if real:
                ax.plot([100 * c["change_rate"] for c in real], [c["speedup_vs_measured_reference"] for c in real], mk,
                        ms=11, color=colors[tr], mec="k", label=f"real AdamW, small model, {who} ({tr}), vs measured ref.")
    ax.axhline(20, color="gray", lw=0.8, ls="-.")
    ax.text(0.01, 20, " target 20x at 3%, 1 Gbit/s", color="gray", fontsize=7, va="bottom",
            transform=ax.get_yaxis_transform())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("elements whose bits changed (%)")
    ax.set_ylabel("speedup (time until engines serve v+1)")
    ax.set_title(f"refit speedup at {s['link_mbps']:g} Mbit/s ({s['size']} model, measured)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6)
    sw = r.get("sweep")
    m = [p for p in (sw or {}).get("measured", []) if p["link_mbps"]]
    if m:
        xs = [p["link_mbps"] for p in m]
        for key, ls, label in _REFS:
            bx.plot(xs, [p[key] or float("nan") for p in m], ls, marker="o", color="k", lw=2 if ls == "-" else 1,
                    label=label)
        bx.plot(xs, [p["byte_ratio"] for p in m], "-", color="C2", lw=1, alpha=0.6, label="byte ratio")
        for mbps, want in ((100, 60), (1000, 20)):  # the targets at their links
            bx.plot([mbps], [want], "_", ms=18, mew=2, color="gray")
        bx.set_xscale("log")
        bx.set_yscale("log")
        bx.set_xlabel("cross-cluster link (Mbit/s)")
        bx.set_ylabel("speedup of the 3% refit")
        bx.set_title("3% relay refit at each link (every point measured)")
        bx.grid(alpha=0.3, which="both")
        bx.legend(fontsize=7, loc="upper left")
        rows = sorted((c for c in r.get("coding_cases", []) if c["link_mbps"]), key=lambda c: c["link_mbps"])
        if rows:  # the codings compared at each link: median refit seconds (right axis)
            tx = bx.twinx()
            for setting, mk in (("plain", "s"), ("context", "^"), ("auto", "o")):
                tx.plot([c["link_mbps"] for c in rows], [c["median_s"][setting] for c in rows], mk + ":", ms=6,
                        color={"plain": "C3", "context": "C4", "auto": "C5"}[setting], label=f"{setting}: refit s")
            tx.set_yscale("log")
            tx.set_ylabel("3% refit seconds, median per coding setting")
            tx.legend(fontsize=7, loc="lower left")
    else:
        _empty(bx, "no other links in this run")
    pc = [c for c in r["cases"] + list(r.get("link_cases") or []) if c.get("dirty_pages") is not None]
    if pc:
        labels = [f"{c['case']}\n{c['transport'][:5]} {_fmt(c['link_mbps'], '{:g}', 'none')}" for c in pc]
        x = list(range(len(pc)))
        cx.bar([i - 0.2 for i in x], [c["changed_pages"] for c in pc], 0.4, color="C2", label="pages holding a change")
        cx.bar([i + 0.2 for i in x], [c["dirty_pages"] for c in pc], 0.4, color="C3", label="pages the promote dirtied")
        cx.plot(x, [c["baseline_pages"] for c in pc], "_", ms=14, color="k", label="baseline pages")
        cx.set_xticks(x, labels, fontsize=6, rotation=60)
        cx.set_ylabel("4 KiB pages (owners summed)")
        cx.set_yscale("log")
        cx.set_title("promote: dirtied baseline pages per refit (smaps after msync)")
        cx.legend(fontsize=7, loc="lower right")
        ex = cx.twinx()
        ex.plot(x, [c.get("promote_seconds") or 0 for c in pc], "o", color="C4", label="promote s")
        ex.plot(x, [c["ready_for_next_seconds"] - c["dcr_seconds"] for c in pc], "x", color="C5",
                label="ready for next - serve s")
        ex.set_ylabel("seconds")
        ex.set_ylim(bottom=0)
        ex.legend(fontsize=7, loc="upper right")
    else:
        _empty(cx, "no memory-mapped baselines in this run")
    recv = [m for m in r.get("summary", []) if m.get("per_engine")]
    if recv:
        _plot_receivers(dx, recv)
    else:
        _empty(dx, "no real-update cases in this run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _empty(ax, text: str) -> None:
    ax.set_axis_off()
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=9, color="gray", transform=ax.transAxes)


def _plot_receivers(cx, summary: list[dict]) -> None:
    """Right panel: apply seconds (bars) and engine peak RSS (line, right axis) per receiver and transport."""
    labels = [f"{m.get('engine_kind', m['case'])}\n{m['transport']}" for m in summary]
    x = list(range(len(summary)))
    cx.bar(x, [m.get("apply_seconds") or 0 for m in summary], color=["C4" if m.get("engine_kind") == "vllm" else "C0"
                                                                       for m in summary], alpha=0.8)
    cx.set_xticks(x, labels, fontsize=8)
    cx.set_ylabel("engine apply s per refit (max engine, mean of steps)")
    cx.set_title("receivers: real AdamW, small model (measured)")
    dx = cx.twinx()
    dx.plot(x, [m["engine_peak_max_bytes"] / 2**30 for m in summary], "o--", color="k", label="engine peak RSS")
    dx.set_ylabel("engine peak RSS during the refit (GB)")
    dx.set_ylim(bottom=0)
    dx.legend(fontsize=7, loc="upper left")
    cx.grid(alpha=0.3, axis="y")
