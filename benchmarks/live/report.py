"""The live benchmark's table (stdout, BENCHMARKS.md) and its PNG timeline."""

from __future__ import annotations


def _f(x, unit="s") -> str:
    if x is None:
        return "-"
    return f"{1e3 * x:.0f} ms" if unit == "ms" else f"{x:.3f}"


def format_table(result: dict) -> str:
    rows = ["| receiver | model | data | method | mode | pause (ms) | apply in pause (ms) | longest gap (ms) | trainer "
            "stall (s) | construct (s) | freshness (s) | refit (s) | tok/s quiet | tok/s refit | bit-exact |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["cases"]:
        rows.append(f"| {c['receiver']} | {c.get('size', '-')} | {c['data']} | {c['method']} | {c['mode']} | "
                    f"{_f(c['pause_seconds'], 'ms')} | {_f(c['pause_apply_seconds'], 'ms')} | "
                    f"{_f(c['gap_seconds'], 'ms')} | {_f(c['trainer_stall_seconds'])} | "
                    f"{_f(c['construct_seconds'])} | {_f(c['freshness_seconds'])} | {_f(c['refit_seconds'])} | "
                    f"{c['tokens_per_second_quiet']:.0f} | {(c['tokens_per_second_refit'] or 0):.0f} | "
                    f"{'yes' if c['bit_exact'] else 'NO'} |")
    lines = ["\n".join(rows), ""]
    for t in result.get("targets", []):
        met = {True: "met", False: "unmet", None: "reported"}[t["met"]]
        lines.append(f"- {t['target']}: {t['value']:.2f} ({met})")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """The table and the targets, met or unmet with their numbers (BENCHMARKS.md)."""
    s = result.get("settings", {})
    head = (f"HF engines: {s.get('size')} model, vLLM engines: {s.get('vllm_size', s.get('size'))} model; "
            f"{s.get('engines')} engines behind a {s.get('link_mbps'):g} Mbit/s link "
            f"({1e3 * s.get('latency_s', 0):.0f} ms), relay transport, {s.get('refits')} refits per case (medians), "
            f"AdamW lr {s.get('lr'):g}; each engine serves a closed loop of {s.get('tokens')}-token requests.\n\n")
    return head + format_table(result) + "\n"


def plot(result: dict, path: str) -> None:
    """Tokens per second of every engine over time, per case, refit windows shaded and pauses marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {}
    for c in result["cases"]:
        groups.setdefault((c["receiver"], c["data"], c["mode"] if c["method"] == "dcr" else "in_place"), c)
    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 2.2 * max(1, len(groups))), squeeze=False)
    for ax, ((receiver, data, mode), c) in zip(axes[:, 0], sorted(groups.items())):
        tl = c["timeline"]
        t0 = tl["t0"]
        for i, recs in enumerate(tl["engines"]):
            ts = [r[2] - t0 for r in recs]
            rate = [r[3] / max(1e-6, r[2] - r[1]) for r in recs]
            ax.plot(ts, rate, lw=0.7, label=f"engine {i}")
        colors = {"dcr": "tab:green", "dense_sync": "tab:red", "fetch_reload": "tab:orange"}
        for method, a, b in tl["windows"]:
            ax.axvspan(a - t0, b - t0, color=colors.get(method, "grey"), alpha=0.15)
        for cc in result["cases"]:
            if cc["timeline"] is tl:
                for smp in cc["samples"]:
                    for p in smp["pauses"]:
                        ax.axvspan(p["at"] - t0, p["at"] + p["pause_s"] - t0, color="black", alpha=0.25)
        ax.set_title(f"{receiver} engines, {data}, dcr {mode} (green) / dense sync (red) / fetch-reload (orange); "
                     f"dark: pauses", fontsize=8)
        ax.set_ylabel("tok/s per call")
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
