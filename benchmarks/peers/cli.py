"""The ``peers`` subcommand of ``dcr-ray bench``: options and entry point."""

from __future__ import annotations

import argparse

from benchmarks.codec.settings import DEFAULT_LINK_MBPS


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``peers`` to the ``bench`` subcommands."""
    p = subparsers.add_parser(
        "peers", help="dcr_ray vs SkyRL, vLLM sparse_nccl, XOR+zstd, AReaL/slime style on the same steps",
        description="Wire bytes, sender and receiver CPU seconds, bit-exactness and corrupted-payload behaviour of "
                    "dcr_ray and its peers (SkyRL's own code where installed) on the same AdamW and stress steps. "
                    "Table on stdout, progress on stderr; --json also writes a PNG plot beside the JSON.")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="3 repeats per timing, a 16 Mi-element stress tensor")
    size.add_argument("--tiny", action="store_true", help="the tiny model and a 1 Mi-element stress case (seconds; "
                                                          "the smoke test)")
    p.add_argument("--json", metavar="PATH", help="write results as JSON here and a PNG plot beside it")
    p.add_argument("--seed", type=int, default=0, help="seed of the models, batches and stress data")
    p.add_argument("--repeats", type=int, default=None, help="timing repeats per step (best is reported; "
                                                             "default 3 quick, 5 full)")
    p.add_argument("--link-mbps", type=float, default=DEFAULT_LINK_MBPS,
                   help=f"the link the library default (coding='auto') is asked about (default {DEFAULT_LINK_MBPS:g})")
    p.add_argument("--steps", default="1,10,50",
                   help="the optimizer steps of each AdamW run that are measured (default 1,10,50)")
    p.add_argument("--receivers", default="hf,vllm,vllm_capture",
                   help="where the receivers finish: hf (a transformers model's parameters), vllm (a vLLM engine on "
                        "this machine, its weights packed: through vLLM's own reload), vllm_capture (its weights "
                        "unpacked: dcr_ray writes in place through the captured loader copies); default all")
    p.add_argument("--reimplemented-skyrl", action="store_true",
                   help="use the reimplementation of SkyRL's delta sync even when its package is installed")
    p.set_defaults(func=_run_from_args)
    return p


def _run_from_args(args: argparse.Namespace) -> int:
    from benchmarks import write_json_and_plot
    from benchmarks.codec.settings import _log
    from benchmarks.peers.report import format_table, plot
    from benchmarks.peers.runner import run
    from benchmarks.peers.settings import Settings

    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    steps = tuple(int(x) for x in args.steps.split(","))
    settings = Settings.make(mode, args.seed, args.repeats, args.link_mbps, steps, tuple(args.receivers.split(",")))
    result = run(settings, skyrl_own=not args.reimplemented_skyrl)
    print(format_table(result))
    if args.json:
        write_json_and_plot(result, args.json, plot)
        _log(f"wrote {args.json} and its PNG beside it")
    # a peer whose receiver raised on this engine (its error is in the row) is a result, not a failed run
    return 0 if all(r["bit_exact"] for r in result["cases"] if not r.get("error")) else 1
