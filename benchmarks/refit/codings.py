"""The library default against both codings at every link: is ``coding="auto"`` ever slower than the better?

On the 3% relay topology, at each link of the run (the headline link and ``--links``), :data:`ROUNDS`
rounds of three refits each, one per setting of the coordinator's ``CodecConfig.coding``: ``plain``,
``context``, then ``auto``, every refit a fresh 3% change, measured and checked bit for bit like every
other case (:func:`~benchmarks.refit.measure.measure_refit`). ``auto`` decides as in production,
from the reports of the refits before it (:mod:`dcr_ray.actors.coordinator.coding`): by the time it runs at a
link, its window holds a plain and a context refit at that link (and older ones at the previous link).
Per setting the JSON keeps every refit's seconds (``samples_s``), the coding ``auto`` chose each time
and why, and the machine's 1/5/15-minute load averages before and after (``loadavg``); the comparison
uses medians. Target (issue 22): ``auto`` no more than :data:`AUTO_SLACK` slower
than the better of the other two.
"""

from __future__ import annotations

import statistics

from benchmarks.refit.measure import measure_refit
from benchmarks.refit.progress import log

#: Rounds of (plain, context, auto) refits per link.
ROUNDS = 3
#: How much slower than the better coding ``auto`` may be.
AUTO_SLACK = 0.05
SETTINGS = ("plain", "context", "auto")


def compare_codings(topo, perturb, rounds: int = ROUNDS) -> dict:
    """Refit ``rounds`` times with each coding setting at ``topo``'s current link (``perturb(rate)`` makes
    the next change) and compare; the coordinator is left at ``auto``."""
    import os

    load0 = os.getloadavg()
    samples = {c: [] for c in SETTINGS}
    wire = {c: [] for c in SETTINGS}
    chosen, exact = [], True
    try:
        for _ in range(rounds):
            for c in SETTINGS:
                topo.set_coding(c)
                perturb(0.03)
                m = measure_refit(topo, with_peers=False)
                samples[c].append(m["dcr_seconds"])
                wire[c].append(m["wire_bytes"])
                exact &= m["bit_exact"]
                if c == "auto":
                    chosen.append({"coding": m["coding"], "reason": m["coding_reason"]})
    finally:
        topo.set_coding("auto")
    med = {c: statistics.median(v) for c, v in samples.items()}
    best = min(med["plain"], med["context"])
    out = {"link_mbps": topo.link_mbps, "rounds": rounds, "samples_s": samples, "wire_bytes": wire,
           "median_s": med, "auto_over_best": med["auto"] / best, "auto_chose": chosen, "bit_exact": bool(exact),
           "loadavg": [round(x, 2) for x in (*load0, *os.getloadavg())]}
    log(f"  codings at {_link(out)}: median plain {med['plain']:.2f}s, context {med['context']:.2f}s, auto "
        f"{med['auto']:.2f}s ({out['auto_over_best']:.2f}x the better; auto chose "
        f"{', '.join(x['coding'] for x in chosen)})")
    return out


def _link(row: dict) -> str:
    return f"{row['link_mbps']:g} Mbit/s" if row.get("link_mbps") else "no link"


def _load(avg) -> str:
    """The 1-minute load average before and after a comparison."""
    return f"{avg[0]:.1f} -> {avg[3]:.1f}" if avg else "-"


def markdown(rows: list[dict]) -> str:
    """One line per link: each setting's median refit seconds (and samples), auto's choices, the ratio."""
    out = ["| link | plain s (median; samples) | context s | auto s | auto / better | auto chose | exact | load |",
           "|" + "---|" * 8]
    for r in sorted(rows, key=lambda r: r["link_mbps"] or float("inf")):
        cell = {c: f"{r['median_s'][c]:.2f} ({', '.join(f'{x:.2f}' for x in r['samples_s'][c])})" for c in SETTINGS}
        picks = ", ".join(x["coding"] for x in r["auto_chose"])
        out.append(f"| {_link(r)} | {cell['plain']} | {cell['context']} | {cell['auto']} | "
                   f"**{r['auto_over_best']:.2f}x** | {picks} | {'yes' if r['bit_exact'] else 'NO'} | "
                   f"{_load(r.get('loadavg'))} |")
    return "\n".join(out) + "\n"
