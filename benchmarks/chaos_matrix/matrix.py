"""The enumeration's matrix as Markdown: a summary (outcomes per apply mode and transport) and one table per
combination (a row per failpoint, a column per action; each cell its first hit's outcome, then its middle
hit's where the point repeats), rendered from the JSON alone."""

from __future__ import annotations

from collections import Counter

from dcr_ray.failpoints.catalog import POINTS
from dcr_ray.failpoints.plan import ACTIONS

#: Each outcome's short form in a table cell.
SHORT = {"hang": "**HANG**", "wrong_bits": "**WRONG**", "broken": "**BROKEN**", "failed_nofix": "**ERR**",
         "harness_error": "h!",
         "not_fired": "nf", "failed_fix": "fix", "ok": "ok", "abandoned": "ab", "n/a": "·"}
LEGEND = ("`c1`/`c2`/`c3`: committed at attempt n; `ok`: the operation (a rejoin, a dense bootstrap) succeeded; "
          "`ab`: a refit whose every attempt the trigger failed was abandoned cleanly (engines back at the version); "
          "`fix`: failed with a DcrError that names its fix, which the harness applied; `nf`: the hit never came; "
          "`·`: cannot happen (the apply mode or transport never reaches it, or the action does not apply); "
          "**ERR**: failed with an error that names no fix; **BROKEN**: a check failed (a ready engine that does "
          "not generate, the next refit not committing); **WRONG**: an engine served bits other than the trainer's "
          "for its version; **HANG**: an operation or heal ran past its bound; `h!`: the harness itself failed (the "
          "topology was relaunched). `first/middle` where the point "
          "is hit more than once per refit.")


def short(cell: dict) -> str:
    out = cell["outcome"]
    if out == "committed":
        return f"c{cell.get('attempts', '?')}"
    return SHORT.get(out, out)


def summary(cells: list[dict]) -> list[dict]:
    """Outcome counts per combination (and in all), over the cells that ran."""
    rows = []
    combos = sorted({(c["mode"], c["transport"]) for c in cells})
    for combo in [*combos, ("all", "all")]:
        mine = [c for c in cells if combo == ("all", "all") or (c["mode"], c["transport"]) == combo]
        n = Counter(c["outcome"] for c in mine)
        rows.append({"mode": combo[0], "transport": combo[1], "ran": sum(v for k, v in n.items() if k != "n/a"),
                     "n/a": n.get("n/a", 0), **{k: n.get(k, 0) for k in ("committed", "ok", "abandoned", "failed_fix",
                                                                             "not_fired", "failed_nofix", "broken",
                                                                             "wrong_bits", "hang", "harness_error")}})
    return rows


def markdown(result: dict) -> str:
    cells = result["cells"]
    lines = [f"{len(POINTS)} failpoints x {len(ACTIONS)} actions x apply mode x transport, at the first hit and a "
             f"middle hit; {result.get('seconds', 0):.0f} s on {result.get('cores', '?')} cores.", ""]
    cols = ["mode", "transport", "ran", "n/a", "committed", "ok", "abandoned", "failed_fix", "not_fired",
            "failed_nofix", "broken", "wrong_bits", "hang", "harness_error"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in summary(cells)]
    lines += ["", LEGEND, ""]
    by = {}
    for c in (c for c in cells if not c.get("composed")):
        by.setdefault((c["mode"], c["transport"]), {}).setdefault((c["point"], c["action"]), {})[c["hit"]] = c
    for (mode, transport), table in sorted(by.items()):
        lines += [f"#### {mode}, {transport}", "", "| failpoint | " + " | ".join(ACTIONS) + " |",
                  "|---|" + "---|" * len(ACTIONS)]
        for point in POINTS:
            row = []
            for action in ACTIONS:
                hits = table.get((point, action), {})
                row.append("/".join(short(hits[h]) for h in ("first", "middle") if h in hits) or "")
            if any(row):
                lines.append(f"| `{point}` | " + " | ".join(row) + " |")
        lines.append("")
    comp = [c for c in cells if c.get("composed")]
    if comp:
        combos = sorted({(c["mode"], c["transport"]) for c in comp})
        lines += ["#### Faults that compose", "", "| scenario | " + " | ".join(f"{m}, {t}" for m, t in combos) + " |",
                  "|---|" + "---|" * len(combos)]
        for name in dict.fromkeys(c["name"] for c in comp):
            mine = {(c["mode"], c["transport"]): short(c) for c in comp if c["name"] == name}
            lines.append(f"| {name} | " + " | ".join(mine.get(k, "") for k in combos) + " |")
        lines.append("")
    return "\n".join(lines)
