"""``dcr-ray bench live``: the loop's costs where an RL team feels them, beside the peers' ways.

Clients stream generations from the engines all the time (concurrent closed loops of short requests and
of long, agentic-length ones per engine, every token timed) while the trainer steps and the new policy
reaches them, refit after refit, by each method at every link of a sweep (0.1 to 100 Gbit/s and no
emulated link). Per refit it measures the engines' admission-closed window and the drain before it (their
own clock), the longest gap a client saw between tokens and where it went, the trainer's stall, the
freshness of what the engines serve and the tokens per second around it, for dcr_ray staged and in place,
switching in flight (between two decoding steps) and staged draining, and, on the same engines and links,
a dense sync (OpenRLHF/veRL's broadcast, draining), PipelineRL's in-flight dense update, a full checkpoint
fetched then reloaded, and SkyRL 0.4.0's delta sync (its own code, in keep mode as it ships): each peer
through the engine's own loader (vLLM: vLLM's own reload) and pausing as it ships. Modules:
:mod:`.settings`, :mod:`.load` (the clients), :mod:`.stream` (per-token times), :mod:`.topology`,
:mod:`.peers` (the peers' ways, driver side), :mod:`.trainer_side` and :mod:`.engine_side` (what they run
in the trainer's and the engines' actors), :mod:`.measure`, :mod:`.runner` (targets, crossovers),
:mod:`.report`.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    from benchmarks.live.settings import add_arguments

    p = subparsers.add_parser(
        "live", help="client stalls, drain, serving pause, trainer stall, freshness while engines serve short and long "
             "requests, at every link: dcr_ray vs a dense sync, PipelineRL's in-flight update, a full "
             "fetch-then-reload and SkyRL's delta sync",
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
