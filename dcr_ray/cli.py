"""The ``dcr-ray`` command line.

::

    dcr-ray bench codec [--quick] [--json PATH]    codec benchmark (wire bytes, bounds, peers, GB/s)
    dcr-ray status [--address ADDR] [--json]       a running topology: versions, engines, last refits
    dcr-ray chaos [--refits N] [--seed S] [--json PATH]   seeded faults; every refit checked bit for bit

Subcommand groups are added by the modules that own them (``benchmarks.MODULES`` for ``bench``), so this
file only wires groups together.

``bench`` and ``chaos`` live in the top-level ``benchmarks`` package of a checkout, not in the installed
library: :func:`find_benchmarks` looks for the checkout (beside the running ``dcr_ray`` package, as in an
editable install or with the checkout on ``PYTHONPATH``; on ``sys.path``; in the current directory or
one above it). Without one, both commands say how to run them from a checkout; ``status`` never needs it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

_EPILOG = """examples:
  dcr-ray bench codec --quick                  about a minute: table on stdout, progress on stderr
  dcr-ray bench codec --json out/codec.json    full run; also writes out/codec.png
  dcr-ray status                               the topology running in the local Ray cluster

Library use (refits on Ray) starts from `import dcr_ray` (dcr_ray.launch / dcr_ray.Refit)."""

_NO_CHECKOUT = """dcr-ray {command}: the benchmarks are not part of the installed package; they run from a checkout of
dcr_ray (its top-level benchmarks/ package). From the checkout's root:
  pip install -e .            (or: export PYTHONPATH=$PWD)
  dcr-ray {command} ...
dcr-ray looks for benchmarks/ beside the dcr_ray package it runs, on sys.path, and in the current
directory and the ones above it."""


def _checkout_roots():
    """Directories that may be a checkout's root, most specific first."""
    import dcr_ray

    yield Path(dcr_ray.__file__).resolve().parent.parent
    for entry in sys.path:
        yield Path(entry or os.curdir).resolve()
    cwd = Path.cwd().resolve()
    yield from (cwd, *cwd.parents)


def find_benchmarks():
    """The checkout's ``benchmarks`` package, or ``None`` when no checkout is found (see the module doc).

    A root counts only when it holds both ``benchmarks/`` and ``dcr_ray/``, so another project's
    ``benchmarks`` package is never taken. The root goes first on ``sys.path`` and on ``PYTHONPATH``:
    the Ray workers that the benchmarks start (a local Ray each) inherit this process's environment,
    while Ray itself hands them only the driver's current directory and script directory."""
    for root in _checkout_roots():
        if (root / "benchmarks" / "__init__.py").is_file() and (root / "dcr_ray" / "__init__.py").is_file():
            break
    else:
        return None
    import dcr_ray

    running = Path(dcr_ray.__file__).resolve().parent
    if running != root / "dcr_ray":
        print(f"dcr-ray: the benchmarks of {root} run with dcr_ray from {running} here and from {root} in "
              "Ray workers", file=sys.stderr)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(root) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, paths)])
    return importlib.import_module("benchmarks")


def build_parser() -> argparse.ArgumentParser:
    """The complete ``dcr-ray`` argument parser."""
    benchmarks = find_benchmarks()
    parser = argparse.ArgumentParser(
        prog="dcr-ray",
        description="dcr_ray: delta-compressed, bit-exact policy refits from trainers to rollout engines.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    groups = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = groups.add_parser(
        "bench", help="run a benchmark (see `dcr-ray bench --help`; from a checkout)",
        description="Benchmarks; each prints a table to stdout and can write JSON (and a plot).",
    )
    if benchmarks is not None:
        benches = bench.add_subparsers(dest="bench", metavar="BENCH")
        benchmarks.add_parsers(benches)
        bench.set_defaults(func=lambda args: _usage(bench))
    else:
        _needs_checkout(bench, "bench")
    from dcr_ray import status

    status.add_parser(groups)
    if benchmarks is not None:
        importlib.import_module("benchmarks.chaos").add_parser(groups)
    else:
        chaos = groups.add_parser("chaos", help="seeded faults against a multi-node topology (from a checkout)")
        _needs_checkout(chaos, "chaos")
    parser.set_defaults(func=lambda args: _usage(parser))
    return parser


def _needs_checkout(parser: argparse.ArgumentParser, command: str) -> None:
    """``parser`` takes any arguments (:func:`main` lets them through) and answers with how to run
    ``command`` from a checkout."""

    def refuse(args) -> int:
        print(_NO_CHECKOUT.format(command=command), file=sys.stderr)
        return 2

    parser.set_defaults(func=refuse, any_arguments=True)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dcr-ray`` console script."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
