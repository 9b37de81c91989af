"""``dcr-ray bench scale [--quick] [--json PATH]``: how dcr's cost grows with its work, per role.

What runs (real Ray on this machine, loopback only): the refit benchmark's synthetic topology
(:mod:`benchmarks.refit`: two owners of BF16 tensors with a Qwen2 layout, light engines that apply in place
with the undo record a ``transformers`` engine keeps), one topology per *point*, each refitted after a uniform
1% change of every owner's elements. Three sweeps share the points (:mod:`.plan`):

- **model size**: 10 M, 40 M, 200 M, 600 M and 1.2 B elements (20 MB to 2.4 GB BF16), one cluster of one
  engine;
- **engines per cluster**: 1, 2, 4 and 8 at 200 M elements, one cluster (a relay forwards to at most 4
  children: 8 engines make a head and two sub-relays);
- **clusters**: 1, 2 and 4 clusters of 2 engines at 200 M elements.

``--quick`` (a smoke run of a few minutes): sizes 10 M and 40 M, engines 1 and 2, clusters 1 and 2 (of one
engine), at 10 M elements; two measured refits per point instead of three (after two warm-ups, as in full).

Before the warm-up refits every owner and engine loads the codec's compiled kernels (they otherwise load on a
background thread at start-up, whose CPU a measured refit would pay). Each point records which of torch,
transformers, numba and vLLM each role's processes imported, and the JSON whether the workers were forked from a
prefork server (the test suite's: every role then starts with them imported, which moves each start).

Per role (owner, relay, coordinator, engine) and point (:mod:`.measure`): wall seconds of the refit, CPU
seconds of each role's processes, peak RSS above the process's start (and what the refit itself added),
Ray's object-store bytes (peak above its level before the refit, and bytes created), and the bytes on each
link (into each cluster across its boundary, into each relay, into each engine). Then (:mod:`.fit`)
least-squares slopes with their R² (seconds per changed GB, memory per model GB per role, seconds and CPU
per engine and per cluster), a power-law exponent for each series (above 1.15: grows faster than the work,
flagged), and the issue's targets, each ``met`` true or false with its value and limit. The 30B-1T
projection is recomputed from the slopes (:func:`benchmarks.refit.large_models.projection_from_scale`),
naming the two inputs a GPU changes (the diff and apply rates); its 3% and 5% rows take bytes per change
from a refit run's JSON (``--refit-json``, default the committed ``docs/bench_refit_memory.json``).

Memory: the 1.2 B point holds two owners of 1.2 GB shares and one 2.4 GB engine, about 15-20 GiB at its
peak. Before each point the sweep estimates its peak (linear in the model's elements from the largest
smaller point of the same shape, else per-byte constants) and *skips* it, saying why in the JSON
(``skipped``) and the table, when that exceeds 90% of ``MemAvailable``; ``--no-memory-guard`` runs it
anyway, ``--sizes`` leaves it out. Points run from the fan-out sweeps to the largest size, so a point that
fails (recorded with its error; the sweep goes on) comes last.

Modules: :mod:`.plan` (sizes, points, memory estimate), :mod:`.probes` (what is read from processes and
Ray, and the engine factory; light, as it runs in relays and the coordinator), :mod:`.actors` (the owner,
noting its start), :mod:`.measure` (one point), :mod:`.runner` (the sweep and what is derived), :mod:`.fit`
(slopes, exponents, targets), :mod:`.report` (table, PNG).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks.scale import fit, plan
from benchmarks.scale.fit import SUPERLINEAR, TARGETS, exponent, flags, linear, series, slopes, targets
from benchmarks.scale.plan import LAYOUTS, Plan, Point, estimate_bytes, layout_shapes, numel, shapes

__all__ = ["LAYOUTS", "Plan", "Point", "SUPERLINEAR", "TARGETS", "add_parser", "estimate_bytes", "exponent", "fit",
           "flags", "layout_shapes", "linear", "numel", "plan", "run", "series", "shapes", "slopes", "targets"]

#: The refit run whose bytes per change at 3% and 5% the projection uses by default (the 1% sweep has its own).
DEFAULT_REFIT_JSON = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                  "docs", "bench_refit_memory.json")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``scale`` to the ``bench`` subcommands."""
    p = subparsers.add_parser(
        "scale", help="how refit time, CPU and memory per role grow with model size, engines and clusters",
        description="Sweeps model size (10M-1.2B elements, 1% change), engines per cluster (1-8) and clusters "
                    "(1-4) on synthetic owners and light engines; per role (owner, relay, coordinator, engine): "
                    "refit wall time, CPU seconds, peak RSS above the process's start, object-store bytes, link "
                    "bytes; least-squares slopes with R², faster-than-linear flags, the issue's targets and the "
                    "30B-1T projection from the slopes. The full sweep is 10 topologies (~15-25 min on 2 cores); "
                    "the 1.2B point needs ~15-20 GiB and is skipped, with the reason in the JSON, when its "
                    "estimated peak exceeds 90% of MemAvailable (--no-memory-guard runs it anyway). "
                    "Table on stdout, progress on stderr.")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: sizes 10M,40M; engines 1,2; clusters 1,2 (of 1 engine) at 10M; fewer refits")
    p.add_argument("--json", metavar="PATH", help="write results as JSON (after every point) and a PNG beside it")
    p.add_argument("--sizes", default=None,
                   help=f"comma-separated sizes of the size sweep, of {','.join(plan.LAYOUTS)} (default all; "
                        f"{','.join(plan.QUICK_SIZES)} with --quick)")
    p.add_argument("--engines", default=None, help="engines per cluster of the engine sweep (default 1,2,4,8)")
    p.add_argument("--clusters", default=None, help="clusters of the cluster sweep (default 1,2,4)")
    p.add_argument("--at", default=None, choices=list(plan.LAYOUTS),
                   help=f"size of the engine and cluster sweeps (default {plan.FANOUT_SIZE}; "
                        f"{plan.QUICK_FANOUT_SIZE} with --quick)")
    p.add_argument("--link-mbps", type=float, default=None,
                   help="emulate each cluster's boundary link at this bandwidth (default: none, bytes are counted "
                        "but not delayed: the sweep measures CPU and memory)")
    p.add_argument("--no-memory-guard", action="store_true",
                   help="run every point even when its estimated peak memory exceeds 90%% of MemAvailable")
    p.add_argument("--refit-json", default=None,
                   help="a `dcr-ray bench refit` JSON whose relay stress cases give the projection's bytes per "
                        "change at their rates (default docs/bench_refit_memory.json when present)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--from", dest="from_json", metavar="JSON", default=None,
                   help="measure nothing: recompute the fits, targets and projection of an earlier run's JSON from "
                        "its points, print its table (and write --json)")
    p.set_defaults(func=_run_from_args)
    return p


def _ints(arg):
    return None if arg is None else tuple(int(x) for x in arg.split(",") if x.strip())


def _sizes(arg):
    if arg is None:
        return None
    got = tuple(x.strip() for x in arg.split(",") if x.strip())
    bad = [s for s in got if s not in plan.LAYOUTS]
    if bad:
        raise ValueError(f"--sizes: unknown {bad}; choose from {','.join(plan.LAYOUTS)}")
    return got


def run(args: argparse.Namespace) -> dict:
    """Run the sweep of ``args`` (the ``scale`` subcommand's options); returns the result."""
    from benchmarks import write_json_and_plot
    from benchmarks.refit.large_models import bytes_per_change_of_refit
    from benchmarks.refit.progress import log
    from benchmarks.scale.report import plot
    from benchmarks.scale.runner import run_sweep

    refit_json = args.refit_json or (DEFAULT_REFIT_JSON if os.path.exists(DEFAULT_REFIT_JSON) else None)
    bpc = None
    if refit_json:
        with open(refit_json) as f:
            bpc = bytes_per_change_of_refit(json.load(f))

    def checkpoint(result):
        result["settings"]["refit_json"] = refit_json
        if args.json:
            write_json_and_plot(result, args.json, plot)

    if getattr(args, "from_json", None):
        from benchmarks.scale.runner import derive

        with open(args.from_json) as f:
            result = derive(json.load(f), bpc)
        checkpoint(result)
        return result
    p = Plan.of(args.quick, sizes=_sizes(args.sizes), engines=_ints(args.engines), clusters=_ints(args.clusters),
                fanout_size=args.at)
    result = run_sweep(p, quick=args.quick, seed=args.seed, link_mbps=args.link_mbps,
                       memory_guard=not args.no_memory_guard, bytes_per_change=bpc, checkpoint=checkpoint)
    checkpoint(result)
    if args.json:
        log(f"wrote {args.json} and its PNG")
    return result


def _run_from_args(args: argparse.Namespace) -> int:
    from benchmarks.scale.report import format_table

    result = run(args)
    print(format_table(result))
    sys.stdout.flush()
    return 0 if result["points"] and all(p.get("ok") for p in result["points"].values()) else 1
