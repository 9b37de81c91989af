"""What a run says: the targets' checks, the text table, the Markdown tables and the plot."""

from __future__ import annotations

from benchmarks.peers.settings import TARGETS

#: dcr_ray's rows (their corruption verdicts are what the last target checks).
DCR = ("dcr_default", "dcr_plain", "dcr_class_order")


def _le(a, b) -> bool:
    return a is not None and b is not None and a <= b


def checks(rows: list[dict]) -> dict:
    """Each target, per case where it applies: ``{target: {case: {"ok": bool, "value": number}}}``."""
    t = TARGETS

    def ratio(peer, key, limit, where):
        return {r["data"]: {"ok": _le(r[key], limit), "value": r[key]} for r in rows if r["peer"] == peer and where(r)}

    def adamw_lr6(r):
        return r["source"] == "adamw" and r.get("lr") == 1e-6

    return {
        f"dcr_default wire <= {t['default_over_skyrl_adamw_lr1e-6_max']}x SkyRL's (AdamW lr 1e-6)":
            ratio("dcr_default", "wire_over_skyrl", t["default_over_skyrl_adamw_lr1e-6_max"], adamw_lr6),
        f"dcr_class_order wire <= {t['class_order_over_skyrl_adamw_lr1e-6_max']}x SkyRL's (AdamW lr 1e-6)":
            ratio("dcr_class_order", "wire_over_skyrl", t["class_order_over_skyrl_adamw_lr1e-6_max"], adamw_lr6),
        f"dcr_default receiver CPU s <= {t['receiver_over_skyrl_stress3_max']}x SkyRL's (stress-3%)":
            ratio("dcr_default", "receiver_over_skyrl", t["receiver_over_skyrl_stress3_max"],
                  lambda r: r["data"] == "stress-3%"),
        "dcr_ray refuses every corrupted payload before any write":
            {f"{r['data']} {r['peer']} {kind}": {"ok": v["refused_before_write"], "value": v["error"]}
             for r in rows if r["peer"] in DCR for kind, v in r["corrupt"].items()},
    }


def corruption_cell(v: dict, with_bytes: bool = True) -> str:
    """One corruption's outcome in a few words (with the bytes its recovery fetched again)."""
    what = ("refused before write" if v["refused_before_write"] else "detected after writing" if v["detected"]
            else "undetected")
    if v["wrong_bits_served"]:
        what += ", WRONG BITS SERVED"
    if v.get("reset_and_replay"):
        what += f", reset + replay of {v.get('replayed_versions', '?')} versions"
    if v.get("recovered") is not None:
        again = f" ({v['refetched_bytes'] / 1e6:.2f} MB again)" if with_bytes else ""
        what += (f", recovered{again}" if v["recovered"]
                 else ", NOT recovered" + (f" ({v['operator_repair']} to go on)" if v.get("operator_repair") else ""))
    return what


def _rows(cols, rows) -> list[str]:
    out = [" ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w, _) in enumerate(cols))]
    for vals in rows:
        cells = ["-" if v is None else f.format(v) for (_, _, f), v in zip(cols, vals)]
        out.append(" ".join(c.rjust(w) if i else c.ljust(w) for i, ((_, w, _), c) in enumerate(zip(cols, cells))))
    return out


def _by_data(r: dict) -> dict:
    out: dict = {}
    for row in r["cases"]:
        out.setdefault(row["data"], []).append(row)
    return out


def format_table(r: dict) -> str:
    """The human-readable report."""
    m = r["machine"]
    lines = [f"dcr-ray bench peers ({r['mode']}); load average at start {m['loadavg_start']}, end {m['loadavg_end']}",
             f"skyrl: peer_code={r['skyrl']['peer_code']}: {r['skyrl']['note']}", "",
             "B/chg = wire bytes per changed element; bound = per-tensor entropy bound; x sky = over SkyRL's; send / "
             "recv = CPU seconds (best of the repeats, summed over steps) of the sender and of the receiver until "
             "the engine holds the new version; exact = the engine's bits equal the trainer's (integer views)"]
    cols = [("peer", 17, "{}"), ("code", 13, "{}"), ("wire MB", 9, "{:.3f}"), ("B/chg", 6, "{:.3f}"),
            ("x sky", 6, "{:.3f}"), ("send s", 7, "{:.3f}"), ("recv s", 7, "{:.3f}"), ("x sky", 6, "{:.3f}"),
            ("exact", 5, "{}")]
    for data, rows in _by_data(r).items():
        c = rows[0]
        lines += ["", f"{data}: {c['changed']:,} of {c['elements']:,} elements changed ({c['change_rate']:.2%}) over "
                      f"{c['steps']} step(s); per-tensor bound {c['bound_bytes_per_change']:.3f} B/chg"]
        lines += _rows(cols, [[x["peer"], x["peer_code"], x["wire_bytes"] / 1e6, x["bytes_per_change"],
                               x["wire_over_skyrl"], x["sender_seconds"], x["receiver_seconds"],
                               x["receiver_over_skyrl"], "yes" if x["bit_exact"] else "NO"] for x in rows])
        for x in rows:
            lines.append(f"  {x['peer']:17s} flip: {corruption_cell(x['corrupt']['flip'])}; "
                         f"truncate: {corruption_cell(x['corrupt']['truncate'])}")
    lines += ["", "targets:"]
    for name, per in r["checks"].items():
        bad = [k for k, v in per.items() if not v["ok"]]
        vals = ", ".join(f"{k} {v['value']:.3f}" for k, v in per.items() if isinstance(v["value"], float))
        lines.append(f"  {name}: {'MET' if per and not bad else 'no case' if not per else 'UNMET: ' + ', '.join(bad)}"
                     + (f" ({vals})" if vals else ""))
    lines.append(f"elapsed {r['elapsed_s']:.1f}s")
    return "\n".join(lines)


def markdown(r: dict) -> str:
    """The result tables in Markdown, as BENCHMARKS.md shows them (``dcr-ray bench markdown``)."""
    out = ["| data | change rate | peer | code | B/change | per-tensor bound | x SkyRL bytes | sender CPU s | "
           "receiver CPU s | x SkyRL receiver | bit-exact |", "|" + "---|" * 11]
    for data, rows in _by_data(r).items():
        for x in rows:
            b = f"**{x['bytes_per_change']:.3f}**" if x["peer"].startswith("dcr") else f"{x['bytes_per_change']:.3f}"
            out.append(f"| {data} | {x['change_rate']:.2%} | {x['peer']} | {x['peer_code']} | {b} | "
                       f"{x['bound_bytes_per_change']:.3f} | {x['wire_over_skyrl']:.3f} | {x['sender_seconds']:.3f} | "
                       f"{x['receiver_seconds']:.4f} | {x['receiver_over_skyrl']:.3f} | "
                       f"{'yes' if x['bit_exact'] else '**no**'} |")
    out += ["", "Corrupted payloads (the last step of each case; the peer's largest payload with its middle byte\n"
                "flipped, or cut at its middle), per peer, the same on every case unless listed:", "",
            "| peer | flipped byte | truncation |", "|---|---|---|"]
    for peer in dict.fromkeys(x["peer"] for x in r["cases"]):
        cells = {}
        for kind in ("flip", "truncate"):
            seen: dict = {}
            for x in r["cases"]:
                if x["peer"] == peer:
                    seen.setdefault(corruption_cell(x["corrupt"][kind], with_bytes=False), []).append(x["data"])
            cells[kind] = "; ".join(w if len(seen) == 1 else f"{w} ({', '.join(d)})" for w, d in seen.items())
        out.append(f"| {peer} | {cells['flip']} | {cells['truncate']} |")
    out += ["", "Bytes a recovery fetched again (MB; the step's wire bytes in brackets): dcr_ray's retry sends\n"
                "OVERWRITE frames of the whole changed set; SkyRL's next fetch downloads again what it deleted:", "",
            "| data | dcr_plain | dcr_class_order | skyrl, flipped byte | skyrl, truncation |", "|---|---|---|---|---|"]
    for data, rows in _by_data(r).items():
        got = {x["peer"]: x for x in rows}

        def again(peer, kind):
            v = got[peer]["corrupt"][kind]
            return (f"{v['refetched_bytes'] / 1e6:.2f} ({got[peer]['wire_bytes'] / 1e6:.2f})" if v["recovered"]
                    else "not recovered")
        out.append(f"| {data} | {again('dcr_plain', 'flip')} | {again('dcr_class_order', 'flip')} | "
                   f"{again('skyrl', 'flip')} | {again('skyrl', 'truncate')} |")
    out += ["", targets_markdown(r)]
    return "\n".join(out)


def targets_markdown(r: dict) -> str:
    """Every target of the run, met or unmet, with each case's number."""
    out = ["| target | result |", "|---|---|"]
    for name, per in r["checks"].items():
        bad = [k for k, v in per.items() if not v["ok"]]
        vals = ", ".join(f"{k}: {v['value']:.3f}" for k, v in per.items() if isinstance(v["value"], float))
        out.append(f"| {name} | " + ("met" if per and not bad else "no case" if not per
                                     else f"**unmet**: {', '.join(bad)}") + (f" ({vals})" if vals else "") + " |")
    return "\n".join(out) + "\n"


def plot(r: dict, path: str) -> None:
    """Bytes per changed element and receiver CPU seconds, per peer and data case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    by = _by_data(r)
    datas = list(by)
    peers = list(dict.fromkeys(x["peer"] for x in r["cases"]))
    x = np.arange(len(datas))
    wdt = 0.85 / len(peers)
    fig, axes = plt.subplots(2, 1, figsize=(13, 8.5), sharex=True)
    for key, ax, label in (("bytes_per_change", axes[0], "wire bytes per changed element"),
                           ("receiver_seconds", axes[1], "receiver CPU seconds until the engine holds it")):
        for i, p in enumerate(peers):
            ys = [next((row[key] for row in by[d] if row["peer"] == p), np.nan) for d in datas]
            code = next(row["peer_code"] for row in r["cases"] if row["peer"] == p)
            ax.bar(x + (i - (len(peers) - 1) / 2) * wdt, ys, wdt, label=f"{p} ({code})")
        ax.set_ylabel(label)
        if key == "bytes_per_change":
            bound = [by[d][0]["bound_bytes_per_change"] for d in datas]
            ax.hlines(bound, x - 0.45, x + 0.45, color="k", zorder=3, label="per-tensor entropy bound")
            ax.set_yscale("log")
            ax.legend(fontsize=7, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
        else:
            ax.set_yscale("log")
    axes[1].set_xticks(x, [f"{d}\n{by[d][0]['change_rate']:.2%}" for d in datas], fontsize=8)
    fig.suptitle(f"dcr_ray vs peers on the same steps ({r['mode']} run; SkyRL {r['skyrl']['peer_code']} code)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
