"""Output of a result: the text table, Markdown tables and a PNG plot."""

from __future__ import annotations

from dcr_ray.bench.refit.settings import PEERS, TRANSPORTS


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


def _rows(r: dict) -> tuple[list[str], list[list[str]]]:
    head = ["case", "receiver", "transport", "rate", "refit s", "ref s", "speedup", "wire MB", "ref MB",
            "byte ratio", "eff", "LB/refit", "construct s", "apply s", "commit s", "owner GB (share)", "engine GB",
            "exact", "dense s", "areal s", "slime s"]
    rows = []
    for c in r["cases"]:
        p = c.get("peers", {})
        rows.append([c.get("case", c["name"]), c.get("engine_kind", "-"), c["transport"], f"{c['change_rate']:.2%}",
                     f"{c['dcr_seconds']:.2f}",
                     _fmt(c["reference_seconds"], "{:.1f}"), _fmt(c["speedup"], "{:.1f}x"),
                     f"{c['wire_bytes'] / 1e6:.2f}", f"{c['reference_bytes'] / 1e6:.0f}", _fmt(c["byte_ratio"], "{:.1f}"),
                     _fmt(c["efficiency"]), _fmt(c["lower_bound_fraction"], "{:.0%}"), f"{c['construct_s']:.2f}",
                     f"{c['apply_s']:.2f}", f"{c['commit_s']:.2f}",
                     f"{c['owner_peak_bytes'] / 2**30:.2f} ({c.get('owner_share_bytes', 0) / 2**30:.2f})",
                     f"{c['engine_peak_bytes'] / 2**30:.2f}", "yes" if c["bit_exact"] else "NO",
                     *(_fmt(p.get(k), "{:.1f}") for k in PEERS)])
    return head, rows


def format_table(r: dict) -> str:
    """The human-readable report."""
    s = r["settings"]
    head, rows = _rows(r)
    w = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)] if rows else [len(h) for h in head]
    lines = [f"dcr_ray refit benchmark{' (quick)' if r['quick'] else ''}: headline link {s['link_mbps']:g} Mbit/s, "
             f"latency {s['latency_s'] * 1e3:g} ms, {s['engines']} engines, stress model '{s['size']}'",
             "refit = coordinator time prepare..activate; ref = transport-only full checkpoint over the same link "
             "(model); LB = busiest link's busy time + latency; peers = measured construction + link model + "
             "measured apply", "",
             "  ".join(h.rjust(w[i]) for i, h in enumerate(head))]
    lines += ["  ".join(x.rjust(w[i]) for i, x in enumerate(row)) for row in rows]
    if r.get("summary"):
        lines.append("")
        for m in r["summary"]:
            lines.append(f"real AdamW, {_RECEIVER.get(m.get('engine_kind'), m['case'])} ({m['transport']}, mean of "
                         f"{m['steps']} steps): change rate {m['change_rate']:.3%}, refit {m['dcr_seconds']:.2f}s, "
                         f"speedup {_fmt(m.get('speedup'), '{:.1f}x')}")
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
    rc = r.get("reference_check")
    if rc:
        lines.append(f"reference check: {rc['bytes'] / 1e9:.2f} GB through a relay head at {rc['link_mbps']:g} Mbit/s: "
                     f"measured {rc['measured_s']:.2f}s vs model {rc['model_s']:.2f}s (x{rc['ratio']:.3f})")
    sw = r.get("sweep")
    if sw:
        lines += ["", f"link sweep ({sw['label']}): T_cpu {sw['t_cpu_s']:.2f}s, outside-link overhead "
                      f"{sw['overhead_s']:.2f}s outside the link; link-bound below ~"
                      f"{_fmt(sw['crossover_mbps'], '{:.0f}')} Mbit/s, compute-bound above",
                  "  link Mbit/s   refit s   ref s   speedup   (measured: LB/refit)"]
        for m in sw["measured"]:
            lines.append(f"  {_fmt(m['link_mbps'], '{:10.0f}', '   no link'):>10}  {m['dcr_seconds']:8.2f}  "
                         f"{m['reference_seconds']:6.1f}  {_fmt(m['speedup'], '{:7.1f}x')}   "
                         f"{_fmt(m['lower_bound_fraction'], '{:.0%}')}  measured")
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
    lines += ["", "targets (stress cases at the headline link):"]
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
        out += ["", "| link Mbit/s | refit s | reference s | speedup | LB/refit | |", "|---|---|---|---|---|---|"]
        for m in sw["measured"]:
            out.append(f"| {_fmt(m['link_mbps'], '{:.0f}', 'no link')} | {m['dcr_seconds']:.2f} | "
                       f"{m['reference_seconds']:.1f} | {_fmt(m['speedup'], '{:.1f}x')} | "
                       f"{_fmt(m['lower_bound_fraction'], '{:.0%}')} | measured |")
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
    return "\n".join(out) + "\n"


def plot(r: dict, path: str) -> None:
    """Left: speedup vs change rate per transport, with peers. Right: the link-bandwidth sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = r["settings"]
    recv = [m for m in r.get("summary", []) if m.get("per_engine")]
    fig, axes = plt.subplots(1, 3 if recv else 2, figsize=(19 if recv else 13, 5))
    ax, bx = axes[0], axes[1]
    if recv:
        _plot_receivers(axes[2], recv)
    colors = {"relay": "C0", "object_store": "C1"}
    pcol = {"dense": "C7", "areal": "C2", "slime": "C3"}
    head = [c for c in r["cases"] if c.get("case", "").startswith("stress") and c["link_mbps"] == s["link_mbps"]]
    for tr in TRANSPORTS:
        cs = sorted((c for c in head if c["transport"] == tr), key=lambda c: c["change_rate"])
        if cs:
            x = [100 * c["change_rate"] for c in cs]
            ax.plot(x, [c["speedup"] for c in cs], "o-", color=colors[tr], lw=2, label=f"dcr_ray {tr}")
            ax.plot(x, [c["byte_ratio"] for c in cs], ":", color=colors[tr], lw=1, label=f"byte ratio {tr} (ideal)")
            ls = "--" if tr == "relay" else "-."
            for p in PEERS:
                ax.plot(x, [c["peers_speedup"][p] for c in cs], ls, marker=".", color=pcol[p], lw=1,
                        label=f"{p} ({tr} run)")
        for case, mk, who in (("adamw", "*", "transformers"), ("adamw-vllm", "P", "vLLM")):
            real = [c for c in r["cases"] if c.get("case") == case and c["transport"] == tr and c.get("speedup")]
            if real:
                ax.plot([100 * c["change_rate"] for c in real], [c["speedup"] for c in real], mk, ms=11,
                        color=colors[tr], mec="k", label=f"real AdamW, small model, {who} engines ({tr})")
    ax.set_xlabel("elements whose bits changed (%)")
    ax.set_ylabel("speedup over full-checkpoint reference")
    ax.set_yscale("log")
    ax.set_title(f"refit speedup at {s['link_mbps']:g} Mbit/s ({s['size']} model, measured)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    sw = r.get("sweep")
    if sw:
        xs = [p["link_mbps"] for p in sw["curve"]]
        bx.plot(xs, [p["speedup"] for p in sw["curve"]], "-", color="C0", lw=2, label="dcr_ray relay (model)")
        bx.plot(xs, [p["serial_speedup"] for p in sw["curve"]], ":", color="C0", lw=1.5,
                label="dcr_ray, peers' serial model (construct + link + apply)")
        for p in PEERS:
            bx.plot(xs, [q["peers_speedup"][p] for q in sw["curve"]], "--", color=pcol[p], lw=1,
                    label=f"{p} (model)")
        bx.axhline(sw["byte_ratio"], color="C0", ls=":", lw=1, label="byte ratio (link-bound ideal)")
        m = [p for p in sw["measured"] if p["link_mbps"]]
        bx.plot([p["link_mbps"] for p in m], [p["speedup"] for p in m], "o", color="k", label="dcr_ray relay (measured)")
        if sw["crossover_mbps"]:
            bx.axvline(sw["crossover_mbps"], color="gray", ls="-.", lw=1)
            bx.text(sw["crossover_mbps"] / 1.15, 0.42, f"link-bound | compute-bound\n(~{sw['crossover_mbps']:.0f} Mbit/s "
                    f"on this machine) ", fontsize=8, color="gray", ha="right", transform=bx.get_xaxis_transform())
        bx.set_xscale("log")
        bx.set_yscale("log")
        bx.set_xlabel("cross-cluster link (Mbit/s)")
        bx.set_ylabel("speedup over full-checkpoint reference")
        bx.set_title(f"link sweep, {sw['case']} (model + measured points)")
        bx.grid(alpha=0.3, which="both")
        bx.legend(fontsize=7, loc="lower left")
    else:
        bx.set_axis_off()
        bx.text(0.5, 0.5, "no link sweep in this run (it needs the stress cases)", ha="center", va="center",
                fontsize=9, color="gray", transform=bx.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
