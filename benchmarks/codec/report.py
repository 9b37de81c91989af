"""What a run says: the targets' checks, the text table, and the plot."""

from __future__ import annotations

from benchmarks.common import text_rows
from benchmarks.codec.data import FIXED_COST_MAX_S
from benchmarks.codec.settings import LINK_GBITPS, TARGETS


def checks(cases: list[dict]) -> dict:
    """Each target, per case where it applies: {target: {case: passed}}."""
    t = TARGETS
    out = {
        "wire_over_bound<=1.10": {c["name"]: _le(c["wire_over_bound"], t["wire_over_bound_max"]) for c in cases},
        "mixed_saving>=35%": {c["name"]: _le(t["mixed_saving_min"], c["mixed_saving"]) for c in cases},
        "encode>=1.5GB/s": {c["name"]: c["encode_gbps"] >= t["encode_gbps_min"] for c in cases},
        "apply>=3GB/s": {c["name"]: c["apply_gbps"] >= t["apply_gbps_min"] for c in cases},
        "bit_exact": {c["name"]: c["bit_exact"] for c in cases},
    }
    out["wire<=0.85x today's (adamw)"] = {
        c["name"]: _le(c["new_over_today"], t["new_over_today_adamw_max"]) for c in cases if c["source"] == "adamw"}
    out["default wire<=0.75x plain (adamw)"] = {
        c["name"]: _le(c.get("default_over_plain"), t["default_over_plain_adamw_max"]) for c in cases
        if c["source"] == "adamw"}
    out["context encode>=1.5GB/s"] = {c["name"]: c["context_encode_gbps"] >= t["context_encode_gbps_min"]
                                      for c in cases}
    out["context decode+apply>=3GB/s"] = {c["name"]: c["context_apply_gbps"] >= t["context_apply_gbps_min"]
                                          for c in cases}
    out["bytes_per_change(stress-3%)<=1.35"] = {
        c["name"]: c["bytes_per_change"] <= t["bytes_per_change_stress3_max"] for c in cases
        if c["name"] == "stress-3%"
    }
    return out


def fixed_cost_checks(moe: dict | None) -> dict:
    """The 10**5-tensor targets: owner encode and engine decode+apply each within FIXED_COST_MAX_S."""
    if not moe:
        return {}
    return {f"10^5 tensors: encode<={FIXED_COST_MAX_S}s": {"many-tensors": moe["encode_s"] <= FIXED_COST_MAX_S},
            f"10^5 tensors: decode+apply<={FIXED_COST_MAX_S}s": {
                "many-tensors": moe["decode_apply_s"] <= FIXED_COST_MAX_S},
            "10^5 tensors: bit_exact": {"many-tensors": moe["bit_exact"]}}


def _le(a, b) -> bool:
    """``a <= b``, False when either is missing (nothing changed: no ratio to judge)."""
    return a is not None and b is not None and a <= b


def _short(c: dict) -> str:
    return (f"{c['changed']:,} changed ({c['change_rate']:.2%}), {c['bytes_per_change']:.3f} B/change, "
            f"{c['wire_over_bound'] or float('nan'):.3f}x bound, enc {c['encode_gbps']:.2f} GB/s, "
            f"apply {c['apply_gbps']:.2f} GB/s, exact={c['bit_exact']}")


# ---------------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------------
def format_table(r: dict) -> str:
    """The human-readable report."""
    m = r["machine"]
    lines = ["dcr_ray codec benchmark" + (" (quick)" if r["quick"] else ""),
             f"memory bandwidth reference (numpy copy): {r['memcpy_gbps']:.2f} GB/s; codec threads "
             f"{m['codec_threads']}; load average at start {m['loadavg_start']}", "",
             "wire bytes (B/chg = bytes per changed element, context coding; today = plain coding (XOR at "
             "flat positions) on the same changes; new/td = ratio; bound = global entropy bound; pt bnd = "
             "per-tensor bound (integer differences); cls bnd = class bound; ow = overwrite-only; mixed- = "
             "saving vs overwrite-only; areal, slime = peers):"]
    cols = [("case", 14, "{}"), ("rate", 7, "{:.2%}"), ("changed", 11, "{:,}"), ("wire MB", 8, "{:.3f}"),
            ("B/chg", 6, "{:.3f}"), ("today", 6, "{:.3f}"), ("new/td", 6, "{:.3f}"), ("bound", 6, "{:.3f}"),
            ("pt bnd", 6, "{:.3f}"), ("cls bnd", 7, "{:.3f}"), ("ow B/chg", 8, "{:.3f}"),
            ("mixed-", 6, "{:.1%}"), ("areal", 6, "{:.3f}"), ("slime", 6, "{:.3f}"), ("exact", 5, "{}")]
    rows = []
    for c in r["cases"]:
        n = max(c["changed"], 1)
        rows.append([c["name"], c["change_rate"], c["changed"], c["wire_bytes"] / 1e6, c["bytes_per_change"],
                     c["today_bytes_per_change"], c["new_over_today"], c["entropy_bound_bytes"] / n,
                     c["per_tensor_bound_bytes"] / n, c["class_bound_bytes"] / n, c["overwrite_only_bytes"] / n,
                     c["mixed_saving"], c["peers_bytes_per_change"]["areal"],
                     c["peers_bytes_per_change"]["slime"],
                     "yes" if c["bit_exact"] and c.get("peers_bit_exact", True) else "NO"])
    lines += text_rows(cols, rows)
    for c in r["cases"]:
        if c.get("step_change_rates"):
            lines.append(f"  {c['name']} per-step change rates: "
                         + ", ".join(f"{x:.3%}" for x in c["step_change_rates"]))
    lines += ["", "throughput, GB/s of canonical BF16 bytes (best wall time of the repeats; 'cpu' = per CPU-second "
              "of all threads); apply = decode+apply on a live receiver (bits and kept class counts as after its "
              "last refit), cold = without kept class counts:"]
    cols = [("case", 14, "{}"), ("plain enc", 9, "{:.2f}"), ("(cpu)", 6, "{:.2f}"), ("plain app", 9, "{:.2f}"),
            ("(cpu)", 6, "{:.2f}"), ("ctx enc", 7, "{:.2f}"), ("(cpu)", 6, "{:.2f}"), ("ctx app", 7, "{:.2f}"),
            ("(cpu)", 6, "{:.2f}"), ("ctx cold", 8, "{:.2f}")]
    nan = float("nan")
    lines += text_rows(cols, [[c["name"], *(c.get(k, nan) for k in (
        "plain_encode_gbps", "plain_encode_cpu_gbps", "plain_apply_gbps", "plain_apply_cpu_gbps",
        "context_encode_gbps", "context_encode_cpu_gbps", "context_apply_gbps", "context_apply_cpu_gbps",
        "context_apply_cold_gbps"))] for c in r["cases"]])
    link = r.get("settings", {}).get("link_mbps")
    lines += ["", f"the library default (CodecConfig.coding='auto') on a {link:g} Mbit/s link, and its choice at other "
                  f"links:" if link else "the library default:"]
    cols = [("case", 14, "{}"), ("coding", 7, "{}"), ("wire MB", 8, "{:.3f}"), ("B/chg", 6, "{:.3f}"),
            ("/plain", 6, "{:.3f}"), ("enc", 6, "{:.2f}"), ("apply", 6, "{:.2f}"), ("by link (Mbit/s)", 40, "{}")]
    lines += text_rows(cols, [[c["name"], c.get("default_coding"), c.get("default_wire_bytes", nan) / 1e6,
                           c.get("default_bytes_per_change"), c.get("default_over_plain"),
                           c.get("default_encode_gbps"), c.get("default_apply_gbps"),
                           " ".join(f"{k}:{v}" for k, v in c.get("default_by_link", {}).items())]
                          for c in r["cases"]])
    mt = r.get("many_tensors")
    if mt:
        lines += ["", f"many small tensors (fixed cost per tensor): {mt['tensors']:,} tensors, {mt['elements']:,} "
                      f"elements, {mt['changed']:,} changed, {mt['frames']} frames, in packs: owner encode "
                      f"{mt['encode_s']:.2f} s ({mt['encode_us_per_tensor']:.1f} us/tensor), engine decode+apply "
                      f"{mt['decode_apply_s']:.2f} s ({mt['decode_apply_us_per_tensor']:.1f} us/tensor), "
                      f"{mt['bytes_per_change']:.2f} B/change; one item per tensor: encode "
                      f"{mt.get('items_encode_s', float('nan')):.2f} s, decode+apply "
                      f"{mt.get('items_decode_apply_s', float('nan')):.2f} s, "
                      f"{mt.get('items_bytes_per_change', float('nan')):.2f} B/change (plain items "
                      f"{mt['today_bytes_per_change']:.2f}); exact={mt['bit_exact']}"]
    sw = r.get("zstd_sweep") or {}
    if sw.get("levels"):
        lines += ["", f"zstd level sweep on {sw['case']} (default level {sw['default_level']}; "
                      "frame-only encode GB/s, then diff + frames):",
                  "level  hash_log      wire MB  B/chg  frames GB/s  enc GB/s  apply GB/s  "
                  + "  ".join(f"refit@{g:g}Gb/s" for g in LINK_GBITPS)]
        for row in sw["levels"]:
            lines.append(f"{row['level']:>5}  {row['hash_log']!s:12s}  {row['wire_bytes'] / 1e6:7.3f}  "
                         f"{row['bytes_per_change']:5.3f}  {row['frame_encode_gbps']:11.2f}  "
                         f"{row['encode_gbps']:8.2f}  {row['apply_gbps']:10.2f}  "
                         + "  ".join(f"{row[f'refit_s_at_{g:g}gbit'] * 1e3:10.1f}ms" for g in LINK_GBITPS))
    lines += ["", "targets:"]
    for name, per in r["checks"].items():
        bad = [k for k, v in per.items() if not v]
        lines.append(f"  {name:38s} {'PASS' if not bad else 'MISS: ' + ', '.join(bad)}")
    lines.append(f"elapsed {r['elapsed_s']:.1f}s")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    """Bytes per changed element per case: dcr_ray (mixed, overwrite) vs peers vs the entropy bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cases = r["cases"]
    names = [c["name"] for c in cases]
    series = {
        "dcr_ray (context coding)": [c["bytes_per_change"] for c in cases],
        "dcr_ray today (plain coding)": [c["today_bytes_per_change"] for c in cases],
        "dcr_ray overwrite": [c["overwrite_only_bytes"] / max(c["changed"], 1) for c in cases],
        f"library default (auto, {r.get('settings', {}).get('link_mbps', 0):g} Mbit/s)":
            [c.get("default_bytes_per_change", float("nan")) for c in cases],
        **{f"{k} (peer)": [c["peers_bytes_per_change"][k] for c in cases] for k in cases[0]["peers"]},
        "global bound": [c["entropy_bound_bytes"] / max(c["changed"], 1) for c in cases],
        "per-tensor bound": [c["per_tensor_bound_bytes"] / max(c["changed"], 1) for c in cases],
        "class bound": [c["class_bound_bytes"] / max(c["changed"], 1) for c in cases],
    }
    x = np.arange(len(names))
    wdt = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(12, 5.2))
    for i, (label, ys) in enumerate(series.items()):
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * wdt, ys, wdt, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
    ax.set_xticks(x, [f"{n}\n{c['change_rate']:.2%}" for n, c in zip(names, cases)])
    ax.set_ylabel("wire bytes per changed BF16 element")
    fig.suptitle("dcr_ray codec (context and today's plain coding) vs peers vs bounds" + (" (quick)" if r["quick"] else ""))
    ax.legend(fontsize=8, ncol=(len(series) + 1) // 2, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    ax.margins(y=0.12)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(r: dict) -> str:
    """The result tables in Markdown, as BENCHMARKS.md shows them (``dcr-ray bench markdown``)."""
    out = ["| case | change rate | context B/change | plain B/change | context / plain | global bound | "
           "per-tensor bound | class bound | context / per-tensor bound | overwrite-only | AReaL-style | "
           "slime-style |", "|" + "---|" * 12]
    for c in r["cases"]:
        n = max(c["changed"], 1)
        out.append(f"| {c['name']} | {c['change_rate']:.2%} | **{c['bytes_per_change']:.3f}** | "
                   f"{c['today_bytes_per_change']:.3f} | {c['new_over_today']:.3f} | {c['entropy_bound_bytes'] / n:.3f} | "
                   f"{c['per_tensor_bound_bytes'] / n:.3f} | {c['class_bound_bytes'] / n:.3f} | "
                   f"{c['wire_over_per_tensor_bound']:.3f} | {c['overwrite_only_bytes'] / n:.3f} | "
                   f"{c['peers_bytes_per_change']['areal']:.2f} | {c['peers_bytes_per_change']['slime']:.2f} |")
    keys = ("plain_encode", "plain_apply", "context_encode", "context_apply")
    out += ["", "| case | encode plain | (cpu) | decode+apply plain | (cpu) | encode context | (cpu) | "
                "decode+apply context | (cpu) | decode+apply context, cold | (cpu) |", "|" + "---|" * 11]
    for c in r["cases"]:
        cells = [f"{c[f'{k}_gbps']:.2f} | {c[f'{k}_cpu_gbps']:.2f}" for k in (*keys, "context_apply_cold")]
        out.append(f"| {c['name']} | " + " | ".join(cells) + " |")
    link = r.get("settings", {}).get("link_mbps")
    out += ["", f"| case | library default at {link:g} Mbit/s | B/change | / plain | encode GB/s | decode+apply GB/s "
                f"| its choice at 10 / 100 / 1000 / 10000 Mbit/s |", "|" + "---|" * 7]
    for c in r["cases"]:
        if "default_coding" in c:
            by = " / ".join(c["default_by_link"].values())
            out.append(f"| {c['name']} | {c['default_coding']} | {c['default_bytes_per_change']:.3f} | "
                       f"{c['default_over_plain']:.3f} | {c['default_encode_gbps']:.2f} | "
                       f"{c['default_apply_gbps']:.2f} | {by} |")
    out += ["", targets_markdown(r)]
    return "\n".join(out)


def targets_markdown(r: dict) -> str:
    """Every target of the run, met or unmet, with the cases that missed it."""
    out = ["| target | result |", "|---|---|"]
    for name, per in r["checks"].items():
        bad = [k for k, v in per.items() if not v]
        out.append(f"| {name} | " + ("met" if per and not bad else "no case" if not per
                                     else f"**unmet**: {', '.join(bad)}") + " |")
    return "\n".join(out) + "\n"
