"""The ``dcr-ray bench refit`` subcommand: its options and its entry point."""

from __future__ import annotations

import argparse
import json
import os

from benchmarks.refit.progress import log
from benchmarks.refit.report import format_table, markdown, plot
from benchmarks.refit.runner import run_bench
from benchmarks.refit.settings import (DEFAULT_BUCKET_MIB, DEFAULT_LATENCY_MS, DEFAULT_LINK_MBPS, DEFAULT_LINKS,
                                          STRESS_RATES, TRANSPORTS, Settings)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``refit`` to the ``bench`` subcommands."""
    p = subparsers.add_parser(
        "refit", help="end-to-end refit time vs measured full-checkpoint references over an emulated link",
        description="End-to-end refits on a local Ray (relay tree and object storage) over an emulated "
                    "cross-cluster link, against full-checkpoint references measured through the same system "
                    "and link (uncompressed checkpoint, and dcr_ray's compressed dense refit) and peers; "
                    "promote time and dirtied baseline pages per refit. Table on stdout, progress on stderr.",
    )
    p.add_argument("--quick", action="store_true", help="a few minutes: the medium model instead of large")
    p.add_argument("--json", metavar="PATH", help="write results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG: speedup vs change rate, and the link sweep")
    p.add_argument("--markdown", metavar="PATH", help="write the result tables as Markdown (for BENCHMARKS.md)")
    p.add_argument("--link-mbps", type=float, default=DEFAULT_LINK_MBPS,
                   help=f"headline link bandwidth in Mbit/s (default {DEFAULT_LINK_MBPS:g})")
    p.add_argument("--links", default=None,
                   help="other links of the 3%% relay case, Mbit/s, comma-separated, 0 = no link emulation "
                        f"(default {','.join(f'{x:g}' for x in DEFAULT_LINKS)}); each with its measured references")
    p.add_argument("--latency-ms", type=float, default=DEFAULT_LATENCY_MS,
                   help=f"one-way link latency in ms (default {DEFAULT_LATENCY_MS:g})")
    p.add_argument("--size", choices=["tiny", "small", "medium", "large"], default=None,
                   help="shapes of the synthetic stress model (default large; medium with --quick)")
    p.add_argument("--engines", type=int, default=2, help="engines in the rollout cluster (default 2)")
    p.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated (default: both)")
    p.add_argument("--real-steps", type=int, default=None, help="measured AdamW steps (default 3; 2 quick)")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate of the real case (default 1e-6)")
    p.add_argument("--bucket-mib", type=int, default=DEFAULT_BUCKET_MIB,
                   help="payload bucket in MiB of raw bytes, diff chunk = bucket / 8 (default: the library's "
                        "CodecConfig defaults, 16 MiB and 1 Mi elements)")
    p.add_argument("--rates", default=",".join(f"{100 * r:g}" for r in STRESS_RATES),
                   help="stress change rates in %% (default %(default)s)")
    p.add_argument("--cases", default="stress,adamw,experts",
                   help="comma-separated: stress (synthetic model, every rate), adamw (real AdamW steps), experts "
                        "(10^5 small MoE expert tensors at 1%%: the fixed cost per tensor); default: all three")
    p.add_argument("--receivers", default=None,
                   help="engines of the adamw cases: hf (transformers; case adamw), vllm (dcr_ray-started vLLM "
                        "on CPU; case adamw-vllm) or both (default hf,vllm; hf with --quick)")
    p.add_argument("--baseline", choices=["memory", "mmap"], default="memory",
                   help="owners' baseline store: in memory (dcr_ray's default) or memory-mapped files in the "
                        "temporary directory (OwnerConfig.baseline_dir; measures the pages each promote dirties)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-sweep", action="store_true", help="skip the other links (--links)")
    p.add_argument("--no-codings", action="store_true",
                   help="skip the comparison of CodecConfig.coding auto / plain / context at every link (3 rounds "
                        "of 3% relay refits per link, 2 with --quick)")
    p.add_argument("--no-reference-check", action="store_true",
                   help="skip the measured references (speedups then only against the formula)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Entry point of ``dcr-ray bench refit``."""
    s = Settings.from_args(args)
    result = run_bench(s)
    print(format_table(result))
    if args.json:
        _mkdir_for(args.json)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        log(f"wrote {args.json}")
    if args.plot:
        _mkdir_for(args.plot)
        plot(result, args.plot)
        log(f"wrote {args.plot}")
    if args.markdown:
        _mkdir_for(args.markdown)
        with open(args.markdown, "w") as f:
            f.write(markdown(result))
        log(f"wrote {args.markdown}")
    return 0 if all(c["bit_exact"] for c in result["cases"]) else 1


def _mkdir_for(path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
