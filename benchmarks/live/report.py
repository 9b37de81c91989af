"""The live benchmark's table (stdout, BENCHMARKS.md), its targets and crossovers, and its PNG: freshness,
admission window and client gap of every method against the link speed."""

from __future__ import annotations

from benchmarks.live.runner import _link, _order, crossover_text, name


def _ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def _s(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _parts(p) -> str:
    if not p:
        return "-"
    return " / ".join(_ms(p[k]) for k in ("before_s", "drain_s", "window_s", "after_s"))


def format_table(result: dict) -> str:
    old_link = result.get("settings", {}).get("link_mbps")  # a run from before the sweep had one link
    for c in result["cases"]:
        c.setdefault("link_mbps", old_link)
    rows = ["| receiver | model | data | link | method | switch | drain before the window (ms) | admission window (ms) | "
            "client gap, longest (ms) | long requests' (ms) | across the switch (ms) | its parts: before / drain / window / after (ms) | "
            "client gap p99 (ms) | trainer stall (s) | freshness (s) | refit (s) | link MB | tok/s refit / quiet | "
            "token step (ms) | bit-exact |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(result["cases"], key=lambda c: (c["receiver"], c["data"], _order(c.get("link_mbps")),
                                                    c["method"] != "dcr", c["method"], c["mode"], c.get("switch", ""))):
        rows.append(f"| {c['receiver']} | {c.get('size', '-')} | {c['data']} | {_link(c.get('link_mbps'))} | "
                    f"{name(c)} | {c.get('switch', 'drain').replace('_', ' ')} | {_ms(c.get('drain_seconds'))} | "
                    f"{_ms(c['pause_seconds'])} | {_ms(c.get('client_gap_seconds'))} | "
                    f"{_ms(c.get('client_gap_long_seconds'))} | {_ms(c.get('client_gap_switch_seconds'))} | "
                    f"{_parts(c.get('client_gap_parts'))} | "
                    f"{_ms(c.get('client_gap_p99_seconds'))} | "
                    f"{_s(c['trainer_stall_seconds'])} | {_s(c['freshness_seconds'])} | {_s(c['refit_seconds'])} | "
                    f"{(c.get('link_bytes') or 0) / 1e6:.1f} | {(c['tokens_per_second_refit'] or 0):.0f} / "
                    f"{c['tokens_per_second_quiet']:.0f} | {_ms(c.get('token_step_seconds'))} | "
                    f"{'yes' if c['bit_exact'] else 'NO'} |")
    lines = ["\n".join(rows), ""]
    quiet = {(c["receiver"], c["data"]): c for c in result["cases"] if "client_gap_quiet_seconds" in c}
    for (receiver, data), c in sorted(quiet.items()):
        lines.append(f"- quiet clients ({receiver}, {data}): longest gap {_ms(c['client_gap_quiet_seconds'])} ms, "
                     f"p99 {_ms(c['client_gap_quiet_p99_seconds'])} ms")
    lines.append("")
    for x in result.get("crossovers", []):
        lines.append(f"- crossover, {x['peer']} vs dcr {x['mode']} ({x['receiver']}, {x['data']}): {crossover_text(x)}")
    lines.append("")
    for t in result.get("targets", []):
        met = {True: "met", False: "unmet", None: "reported"}[t["met"]]
        lines.append(f"- {t['target']}: {t['value']:.2f} ({met})")
    return "\n".join(lines)


#: The headline's columns in the order they are shown (names as :func:`~benchmarks.live.runner.name` gives them).
_HEADLINE = ("dcr staged", "dcr in_place", "dcr staged drain", "dcr in_place drain", "skyrl_delta",
             "pipelinerl_dense", "full_fetch_reload", "dense_sync")


def headline(result: dict) -> str:
    """Per receiver and data, one row per link: every method's longest client gap with its drain and admission
    window in brackets (ms), then every method's freshness (s)."""
    cases = result["cases"]
    out = []
    for receiver, data in sorted({(c["receiver"], c["data"]) for c in cases}):
        got = {(name(c), c.get("link_mbps")): c for c in cases if (c["receiver"], c["data"]) == (receiver, data)}
        cols = [m for m in _HEADLINE if any(k[0] == m for k in got)]
        out += [f"**{receiver} engines, {data}**: longest client gap (drain + admission window), ms | freshness, s",
                "", "| link | " + " | ".join(cols) + " | " + " | ".join(cols) + " |",
                "|---|" + "---|" * (2 * len(cols))]
        for link in sorted({k[1] for k in got}, key=_order):
            gaps = [got.get((m, link)) for m in cols]
            cell = [f"{_ms(c.get('client_gap_seconds'))} ({_ms(c.get('drain_seconds'))} + {_ms(c['pause_seconds'])})"
                    if c else "-" for c in gaps]
            fresh = [_s(c["freshness_seconds"]) if c else "-" for c in gaps]
            out.append(f"| {_link(link)} | " + " | ".join(cell) + " | " + " | ".join(fresh) + " |")
        out.append("")
    return "\n".join(out)


def markdown(result: dict) -> str:
    """The headline, the table, the crossovers and the targets, met or unmet with their numbers (BENCHMARKS.md)."""
    s = result.get("settings", {})
    links = ", ".join(_link(x) for x in s.get("links", [s.get("link_mbps")]))
    head = (f"HF engines: {s.get('size')} model, vLLM engines: {s.get('vllm_size', s.get('size'))} model; "
            f"{s.get('engines')} engines behind an emulated link of {links} ({1e3 * s.get('latency_s', 0):.0f} ms "
            f"one way when emulated), relay transport, {s.get('refits')} refits per method and link (medians), "
            f"AdamW lr {s.get('lr'):g}; each engine serves {s.get('clients')} concurrent clients, each a closed loop "
            f"of requests of {s.get('tokens')} tokens on average, beside {s.get('long_clients', 0)} long ones of "
            f"{s.get('long_tokens', '-')} tokens on average.\n\n")
    return head + headline(result) + "\n" + format_table(result) + "\n"


def plot(result: dict, path: str) -> None:
    """Per (receiver, data): freshness, admission window and longest client gap of every method against the
    link (no emulated link at the right); the crossovers of the peers against dcr_ray staged marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(c["receiver"], c["data"]) for c in result["cases"]})
    cols = (("freshness_seconds", "freshness (s)"), ("pause_seconds", "admission window (s)"),
            ("client_gap_seconds", "longest client gap (s)"))
    fig, axes = plt.subplots(max(1, len(groups)), 3, figsize=(14, 3.2 * max(1, len(groups))), squeeze=False)
    for row, (receiver, data) in zip(axes, groups):
        cases = [c for c in result["cases"] if (c["receiver"], c["data"]) == (receiver, data)]
        links = sorted({c["link_mbps"] for c in cases}, key=_order)
        xs = {m: i for i, m in enumerate(links)}
        series = sorted({name(c) for c in cases})
        for ax, (key, label) in zip(row, cols):
            for label_ in series:
                pts = sorted(((xs[c["link_mbps"]], c[key]) for c in cases if name(c) == label_ and c[key] is not None))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", lw=1.2,
                        ls="-" if label_.startswith("dcr") else "--", label=label_)
            if key == "freshness_seconds":
                for x in result.get("crossovers", []):
                    if (x["receiver"], x["data"], x["mode"], x["peer"]) == (receiver, data, "staged", "dense_sync") \
                            and x["crossover"] and x["dcr_wins_up_to"] is not None:
                        at = (xs[x["dcr_wins_up_to"]] + xs[x["peer_wins_from"]]) / 2
                        ax.axvline(at, color="k", lw=0.8, ls=":")
                        ax.text(at, ax.get_ylim()[1], " dense sync fresher ->", fontsize=7, va="top")
            ax.set_xticks(range(len(links)), [_link(x).replace(" ", "\n") for x in links], fontsize=7)
            ax.set_yscale("log")
            ax.set_title(f"{receiver}, {data}: {label}", fontsize=9)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
