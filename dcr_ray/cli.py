"""The ``dcr-ray`` command line.

::

    dcr-ray bench codec [--quick] [--json PATH]    codec benchmark (wire bytes, bounds, peers, GB/s)
    dcr-ray status [--address ADDR] [--json]       a running topology: versions, engines, last refits
    dcr-ray chaos [--refits N] [--seed S] [--json PATH]   seeded faults; every refit checked bit for bit

Subcommand groups are added by the modules that own them (``dcr_ray.bench.MODULES`` for ``bench``),
so this file only wires groups together.
"""

from __future__ import annotations

import argparse
import sys

_EPILOG = """examples:
  dcr-ray bench codec --quick                  about a minute: table on stdout, progress on stderr
  dcr-ray bench codec --json out/codec.json    full run; also writes out/codec.png
  dcr-ray status                               the topology running in the local Ray cluster

Library use (refits on Ray) starts from `import dcr_ray` (dcr_ray.launch / dcr_ray.Refit)."""


def build_parser() -> argparse.ArgumentParser:
    """The complete ``dcr-ray`` argument parser."""
    from dcr_ray.bench import add_parsers

    parser = argparse.ArgumentParser(
        prog="dcr-ray",
        description="dcr_ray: delta-compressed, bit-exact policy refits from trainers to rollout engines.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    groups = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = groups.add_parser(
        "bench", help="run a benchmark (see `dcr-ray bench --help`)",
        description="Benchmarks; each prints a table to stdout and can write JSON (and a plot).",
    )
    benches = bench.add_subparsers(dest="bench", metavar="BENCH")
    add_parsers(benches)
    bench.set_defaults(func=lambda args: _usage(bench))
    from dcr_ray import status

    status.add_parser(groups)
    from dcr_ray.bench import chaos

    chaos.add_parser(groups)
    parser.set_defaults(func=lambda args: _usage(parser))
    return parser


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dcr-ray`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
