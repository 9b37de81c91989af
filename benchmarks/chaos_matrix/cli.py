"""``dcr-ray chaos --enumerate``'s options (added to ``dcr-ray chaos``) and its run."""

from __future__ import annotations

import sys

from benchmarks.chaos_matrix.scenarios import CI_COMPOSED, CI_SUBSET, MODES, TRANSPORTS

#: Where the full run goes when ``--json`` names no path (a partial run, one filtered by an option, needs --json).
DEFAULT_JSON = "docs/chaos_enumerate.json"
#: Outcomes that fail the command: wrong bits, a hang, a process or check that broke, a failure that names no fix,
#: and a cell the harness could not run.
FAILING = ("wrong_bits", "hang", "broken", "failed_nofix", "harness_error")


def add_arguments(p) -> None:
    g = p.add_argument_group("enumeration (--enumerate)")
    g.add_argument("--enumerate", action="store_true",
                   help="instead of the seeded soak: every failpoint x action x apply mode x transport, at the "
                        "first and a middle hit, each checked against the trainer (a matrix as JSON and Markdown)")
    g.add_argument("--mode", action="append", choices=MODES, help="only this apply mode (repeatable)")
    g.add_argument("--transport", action="append", choices=TRANSPORTS, help="only this transport (repeatable)")
    g.add_argument("--point", action="append", help="only this failpoint (repeatable)")
    g.add_argument("--action", action="append", help="only this action (repeatable)")
    g.add_argument("--subset", choices=("ci",), help="the fixed subset CI runs")
    g.add_argument("--md", metavar="PATH", help="also write the matrix as Markdown")
    g.add_argument("--limit-s", type=float, help="start no scenario past this many seconds (a partial run)")


def run_enumerate(args) -> int:
    from benchmarks.chaos_matrix import enumerate_matrix

    partial = args.mode or args.transport or args.point or args.action or args.subset or args.limit_s
    if partial and not args.json:
        print(f"dcr-ray chaos --enumerate: a partial run (--mode, --transport, --point, --action, --subset or "
              f"--limit-s) needs --json PATH; {DEFAULT_JSON} holds only the full run", file=sys.stderr)
        return 2

    out = enumerate_matrix(modes=tuple(args.mode or MODES), transports=tuple(args.transport or TRANSPORTS),
                           points=args.point, actions=tuple(args.action) if args.action else None,
                           only=CI_SUBSET if args.subset == "ci" else None, json_path=args.json or DEFAULT_JSON,
                           md_path=args.md, progress=sys.stderr, limit_s=args.limit_s,
                           composed_names=CI_COMPOSED if args.subset == "ci" else
                           ([] if (args.point or args.action) else None))
    bad = {k: sum(r[k] for r in out["summary"] if r["mode"] == "all") for k in FAILING}
    print(f"{out['summary'][-1]}", file=sys.stderr)
    return 0 if not any(bad.values()) else 1
