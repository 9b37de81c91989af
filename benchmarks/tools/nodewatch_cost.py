"""What watching the nodes costs the coordinator per refit, at N nodes: Ray node-table reads and raylet
probes, simulated (no Ray, no sockets).

The real :class:`~dcr_ray.actors.fleet.nodes.NodeWatch` runs on a simulated node table of ``--nodes``
nodes (one engine each, the owners on ``--owners`` of them) and a simulated clock; each stage of one
refit waits as :func:`~dcr_ray.actors.fleet.calls.gather` does (it asks ``lost()`` of the outstanding
calls every 0.25 s) for as long as its slowest actor takes: prepare, stream (the owners), flush, activate.
Every engine answers a stage within ``--answer-s``; the owners stream for ``--stream-s``. The sweep before
the attempt reads the table once and probes the nodes the attempt will call; Ray publishes no node change
during the refit (a quiet fleet).

Beside it, the cost of the earlier NodeWatch on the same timeline, counted from its rule (every ``lost()``
more than 0.25 s after its last refresh read the whole table and probed every raylet, 1 s timeout, 8 at a
time).

    python -m benchmarks.tools.nodewatch_cost --nodes 100 --owners 8 --stream-s 30 --json out/nodewatch.json
"""

from __future__ import annotations

import argparse
import json
import time

from dcr_ray.actors.fleet.nodes import NodeWatch

#: gather's poll, and the earlier NodeWatch's refresh period.
POLL_S = 0.25


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _NoChanges:
    """Ray publishes no change of its node table during the refit."""

    seq = 0

    def close(self) -> None:
        pass


def simulate(nodes: int, owners: int, stream_s: float, answer_s: float) -> dict:
    """One refit's node-table reads and raylet probes, by the current NodeWatch and by the earlier rule."""
    clock = _Clock()
    table = [{"NodeID": f"n{i:04d}", "Alive": True, "Resources": {"CPU": 8.0}, "NodeManagerAddress": "10.0.0.1",
              "NodeManagerPort": 1000 + i} for i in range(nodes)]
    reads, probes = [0], [0]

    def read():
        reads[0] += 1
        return table

    def probe(_address) -> bool:
        probes[0] += 1
        return True

    watch = NodeWatch(table=read, probe=probe, changes=_NoChanges(), clock=clock)
    watch.node_of = lambda key: f"n{int(key.split(':')[1]):04d}"  # every actor located, one engine per node
    engines = [f"engine:{i}" for i in range(nodes)]
    stages = [("prepare", engines, answer_s), ("stream", [f"owner:{i}" for i in range(owners)], stream_s),
              ("flush", engines, answer_s), ("activate", engines, answer_s)]
    old_polls = 0
    watch.live(fresh=True)  # the sweep before the attempt: the table, and the nodes it will call probed
    watch.confirm([f"owner:{i}" for i in range(owners)] + engines)
    for _name, keys, seconds in stages:
        end, since = clock.t + seconds, clock.t  # gather's lost(): each stage's wait begins now
        while clock.t < end:
            watch.lost(keys, since=since)
            time.sleep(0.0005)  # the probe pool answers
            clock.t += POLL_S
            old_polls += 1
    watch.close()
    seconds = clock.t
    return {"nodes": nodes, "owners": owners, "stream_s": stream_s, "answer_s": answer_s, "refit_s": seconds,
            "table_reads": reads[0], "raylet_probes": probes[0],
            "earlier_table_reads": 1 + old_polls, "earlier_raylet_probes": nodes * (1 + old_polls)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--owners", type=int, default=8)
    p.add_argument("--stream-s", type=float, default=30.0)
    p.add_argument("--answer-s", type=float, default=0.75)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    rows = [simulate(n, args.owners, args.stream_s, args.answer_s) for n in args.nodes]
    print(f"{'nodes':>6} {'refit s':>8} {'table reads':>12} {'probes':>8} | {'earlier reads':>13} {'earlier probes':>15}")
    for r in rows:
        print(f"{r['nodes']:>6} {r['refit_s']:>8.1f} {r['table_reads']:>12} {r['raylet_probes']:>8} | "
              f"{r['earlier_table_reads']:>13} {r['earlier_raylet_probes']:>15}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
