"""The ``codec`` subcommand of ``dcr-ray bench``: options and entry point."""

from __future__ import annotations

import argparse
import json
import os

from benchmarks.codec.report import format_table, plot
from benchmarks.codec.runner import run
from benchmarks.codec.settings import DEFAULT_LINK_MBPS, Settings, _log


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``codec`` to the ``bench`` subcommands."""
    p = subparsers.add_parser(
        "codec", help="codec wire bytes vs entropy bound and peers; encode/apply GB/s",
        description="Codec wire bytes against the entropy bound and two peer encodings, and codec "
                    "throughput, on real AdamW updates of a small model and on uniform stress changes. "
                    "Table on stdout, progress on stderr; --json also writes a PNG plot beside the JSON.",
    )
    p.add_argument("--quick", action="store_true",
                   help="about a minute: smaller stress tensor, fewer training steps and repeats")
    p.add_argument("--json", metavar="PATH", help="write results as JSON here and a PNG plot beside it")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, batches and stress data")
    p.add_argument("--repeats", type=int, default=None,
                   help="timing repeats per case (best is reported; default 7 quick, 9 full)")
    p.add_argument("--coding", choices=("context", "plain"), default="plain",
                   help="coding of the legacy main throughput columns (encode_gbps, apply_gbps; the other's are "
                        "other_*). Both codings are always encoded, decoded and timed in the same run "
                        "(plain_*, context_* fields)")
    p.add_argument("--link-mbps", type=float, default=DEFAULT_LINK_MBPS,
                   help="the link the library default (CodecConfig.coding='auto') is asked about for the "
                        f"default_* fields (default {DEFAULT_LINK_MBPS:g} Mbit/s; there is no link in this benchmark)")
    p.set_defaults(func=_run_from_args)
    return p


def _run_from_args(args: argparse.Namespace) -> int:
    settings = Settings.make(args.quick, args.seed, args.repeats, args.coding, args.link_mbps)
    result = run(settings)
    print(format_table(result))
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        png = os.path.splitext(args.json)[0] + ".png"
        plot(result, png)
        _log(f"wrote {args.json} and {png}")
    ok = all(c["bit_exact"] for c in result["cases"])
    return 0 if ok else 1
