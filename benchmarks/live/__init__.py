"""``dcr-ray bench live``: the loop's costs where an RL team feels them, beside the peers' ways.

Engines generate continuously (a closed loop of requests per engine) while the trainer steps and the
new policy reaches them, refit after refit; per refit it measures the engines' serving pause (their own
clock), the trainer's stall, the freshness of what they serve and the tokens per second around it, for
dcr_ray in place and staged and, on the same engines and emulated link, a dense sync (OpenRLHF/veRL's
shape) and a fetch-then-reload (SkyRL's). Modules: :mod:`.settings`, :mod:`.load` (the closed loop),
:mod:`.topology`, :mod:`.peers` (the peers' ways), :mod:`.measure`, :mod:`.runner`, :mod:`.report`.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    from benchmarks.live.settings import add_arguments

    p = subparsers.add_parser(
        "live", help="serving pause, trainer stall, freshness while engines serve: dcr_ray vs the peers' ways",
        description=__doc__.split("\n\n")[1])
    add_arguments(p)
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    from benchmarks import write_json_and_plot
    from benchmarks.live.report import format_table, plot
    from benchmarks.live.runner import run
    from benchmarks.live.settings import LiveSettings

    result = run(LiveSettings.from_args(args))
    print(format_table(result))
    if args.json:
        write_json_and_plot(result, args.json, plot)
    return 0 if all(c["bit_exact"] for c in result["cases"]) else 1
