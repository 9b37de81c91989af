"""``python -m benchmarks BENCH ...`` from a checkout's root: the benchmarks without the ``dcr-ray`` command
(``dcr-ray bench BENCH ...`` is the same parser, found beside an editable install), and ``python -m
benchmarks chaos ...`` for the fault drill."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import benchmarks

#: The checkout's root: the Ray workers a benchmark starts import ``benchmarks`` (its actors) from there.
ROOT = str(Path(benchmarks.__file__).resolve().parents[1])


def main(argv: list[str] | None = None) -> int:
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description="dcr_ray's benchmarks (from a checkout); each prints a table "
                                                 "to stdout and can write JSON and a plot.")
    subs = parser.add_subparsers(dest="bench", metavar="BENCH")
    benchmarks.add_parsers(subs)
    importlib.import_module("benchmarks.chaos").add_parser(subs)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
