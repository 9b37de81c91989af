"""``dcr-ray status``: what a running topology holds, read from its coordinator.

Connects to a Ray cluster (``--address``, default: the local one), finds the coordinator by its name
and prints the committed version and record, the refit in flight and its phase, each engine's version
and state (its phase: ``empty`` / ``ready`` / ``staging`` / ``open`` / ``written`` / ``dirty``, or ``dead``)
and standing (``required`` / ``joining`` / ``evicted`` / ``healing`` / ``out``), the engines healing in the
background (phase, source: a peer of their cluster or the owners) and the last heals, the clusters waiting
for capacity (no live node can host them: since when), the relays per cluster, and the last refits (seconds
per stage, wire bytes per cluster link, change rate, retries).
``--json`` prints the same as one JSON object (what :meth:`dcr_ray.Refit.status` returns with
``detail=True``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_parser(groups) -> None:
    """Register ``status`` on the ``dcr-ray`` command's subparsers."""
    p = groups.add_parser("status", help="show a running topology (versions, engines, refits)",
                          description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="auto", help="Ray cluster address (default: the running local one)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--namespace", default=None,
                   help="the topology's Ray namespace (default: dcr_ray, launch()'s default)")
    p.set_defaults(func=run)


def run(args) -> int:
    import ray

    from dcr_ray.api import Refit
    from dcr_ray.options import NAMESPACE

    ns = args.namespace or NAMESPACE
    try:
        ray.init(address=args.address, namespace=ns, logging_level="ERROR", log_to_driver=False)
    except ConnectionError as e:
        print(f"dcr-ray status: no Ray cluster at {args.address!r} ({e})", file=sys.stderr)
        return 1
    try:
        refit = Refit.get(namespace=ns)
    except ValueError as e:  # none launched there (another namespace: --namespace NAME), or its coordinator died
        print(f"dcr-ray status: {e}", file=sys.stderr)
        return 1
    st = refit.status(detail=True)
    print(json.dumps(st, indent=2, default=str) if args.json else format_status(st))
    return 0


def _receiver(r: dict | None) -> str:
    """One engine's receiver in a few words: a vLLM engine's path and weights, and how many tensors are
    written in place (``captured``) or reloaded (``mirrored``)."""
    if not r:
        return "-"
    if "path" not in r:
        return str(r.get("receiver", "-"))
    return (f"{r.get('receiver', '')} {r['path']} ({r.get('weights')} weights; {r.get('captured', 0)} captured, "
            f"{r.get('mirrored', 0)} mirrored)").strip()


def format_status(st: dict) -> str:
    """The text ``dcr-ray status`` prints for a ``status(detail=True)`` dict."""
    rec = st.get("commit_record") or {}
    ph = st.get("phase") or {}
    lines = [f"committed version {st['version']} (transfer {rec.get('transfer')}, epoch {st.get('epoch', 0)}, "
             f"{len(st['required'])}/{len(st['engines'])} engines required), transport {st['transport']}"]
    if ph.get("phase", "idle") != "idle":
        lines.append(f"refit in flight: v{ph.get('target')} attempt {ph.get('attempt')} in phase "
                     f"'{ph['phase']}' for {time.time() - ph.get('since', time.time()):.1f} s")
    else:
        lines.append("no refit in flight")
    lines += ["", f"{'engine':<20} {'cluster':<12} {'version':>7}  {'state':<14} {'standing':<12} receiver"]
    for e in st.get("engine_states", []):
        lines.append(f"{e['engine']:<20} {str(e.get('cluster')):<12} {str(e.get('version')):>7}  "
                     f"{e.get('phase', '?'):<14} "
                     f"{e.get('standing') or ('required' if e.get('required') else '-'):<12} "
                     f"{_receiver(e.get('receiver'))}")
    for c, w in sorted((st.get("capacity") or {}).items()):
        since = w.get("waiting_since") or time.time()
        lines += ["", f"cluster {c} is waiting for capacity since {time.strftime('%H:%M:%S', time.localtime(since))} "
                      f"({time.time() - since:.0f} s): no live node offers {w.get('needs')}; refits commit without it "
                      f"and its engines heal when a node with those resources joins"]
    healing, healed = st.get("healing") or {}, st.get("healed") or []
    if healing or healed:
        lines += ["", f"{'healing engine':<20} {'standing':<14} {'source':<14} {'for s':>6}  reason / error"]
        for e, h in sorted(healing.items()):
            lines.append(f"{e:<20} {h.get('standing', '?'):<14} {str(h.get('source') or '-'):<14} "
                         f"{time.time() - h.get('since', time.time()):>6.1f}  {h.get('error') or h.get('reason')}")
        for h in healed[-5:]:
            lines.append(f"{h['engine']:<20} {'healed v' + str(h['version']):<14} {str(h['source']):<14} "
                         f"{h['seconds']:>6.1f}  {h.get('reason')}")
    relays = st.get("relays") or {}
    if relays:
        lines += ["", "relays: " + "; ".join(f"{c}: {', '.join(sorted(r))}" for c, r in sorted(relays.items()))]
    lines += format_startup(st.get("startup") or {})
    refits = st.get("last_refits") or []
    if refits:
        lines += ["", f"{'version':>7} {'total s':>8} {'stream s':>8} {'commit s':>8} {'wire MB':>8} "
                      f"{'changed':>8} {'retries':>7}  link MB per cluster"]
        for r in refits:
            s = r.get("seconds", {})
            links = ", ".join(f"{c}: {b / 1e6:.2f}" for c, b in (r.get("link_bytes") or {}).items())
            lines.append(f"{r['version']:>7} {s.get('total', 0):>8.2f} {s.get('stream', 0):>8.2f} "
                         f"{s.get('commit', 0):>8.2f} {r.get('wire_bytes', 0) / 1e6:>8.2f} "
                         f"{100 * r.get('change_rate', 0):>7.2f}% {r.get('attempts', 1) - 1:>7}  {links}")
    return "\n".join(lines)


def format_startup(startup: dict) -> list[str]:
    """Lines of per-actor start-up seconds (:meth:`~dcr_ray.actors.coordinator.inspection.Inspection.startup`): the
    coordinator's phases, then one row per engine and relay (``worker``: process start, imports and
    arguments; ``backend``: the model built; ``kernels``: numba kernels loaded, on a thread beside)."""
    if not startup:
        return []
    coord = (startup.get("coordinator") or {}).get("seconds") or {}
    lines = ["", "start-up (s): coordinator " + ", ".join(f"{k} {v:.2f}" for k, v in coord.items())]
    rows = [("engine", e, v) for e, v in (startup.get("engines") or {}).items()]
    rows += [("relay", r, v) for r, v in (startup.get("relays") or {}).items()]
    if rows:
        lines.append(f"{'actor':<28} {'worker':>7} {'backend':>8} {'kernels':>8}")
        for kind, name, v in rows:
            sec = (v or {}).get("seconds") or {}
            cells = [f"{sec[k]:>{w}.2f}" if k in sec else f"{'-':>{w}}" for k, w in (("worker", 7), ("backend", 8),
                                                                                    ("kernels", 8))]
            lines.append(f"{kind + ' ' + name:<28} " + " ".join(cells))
    return lines
