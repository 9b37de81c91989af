"""One ``bench live`` result from runs of separate receivers: ``python -m benchmarks.live.merge A.json B.json
--json OUT.json`` (PNG beside it). A run per receiver loses less when a shared machine kills one; the cases are
concatenated as measured, and the targets and crossovers are computed again over all of them by the same code
a single run uses. Each run's settings, commit, load averages and seconds are kept under ``runs``."""

from __future__ import annotations

import argparse
import json


def merge(results: list[dict]) -> dict:
    from benchmarks.live.runner import crossovers, targets

    first = results[0]
    cases = [c for r in results for c in r["cases"]]
    settings = dict(first["settings"])
    settings["receivers"] = [x for r in results for x in r["settings"]["receivers"]]
    return {"bench": "live", "settings": settings, "git": first["git"], "loadavg_start": first["loadavg_start"],
            "loadavg_end": results[-1].get("loadavg_end"), "started": first["started"],
            "seconds": sum(r.get("seconds", 0.0) for r in results), "cases": cases, "targets": targets(cases),
            "crossovers": crossovers(cases),
            "runs": [{k: r.get(k) for k in ("settings", "git", "loadavg_start", "loadavg_end", "started", "seconds")}
                     for r in results]}


def main(argv=None) -> int:
    from benchmarks import write_json_and_plot
    from benchmarks.live.report import format_table, plot

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results", nargs="+", help="JSON of dcr-ray bench live runs")
    ap.add_argument("--json", required=True, help="write the merged result here; PNG beside it")
    args = ap.parse_args(argv)
    results = []
    for path in args.results:
        with open(path) as f:
            results.append(json.load(f))
    merged = merge(results)
    print(format_table(merged))
    write_json_and_plot(merged, args.json, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
