"""NodeWatch's cost: Ray's node table is read when it changes (and at each sweep), never at every poll,
and only the nodes of actors a call waits on are probed, at most once a second each, never waited on.
A simulated node table of 100 nodes and a simulated clock (no Ray: the table, the probe and the change
counter are handed in; the wait loop is the one every stage runs, :func:`~dcr_ray.actors.fleet.calls.gather`'s
0.25 s poll)."""

from __future__ import annotations

import time

from dcr_ray.actors.fleet import nodes as nodes_mod
from dcr_ray.actors.fleet.nodes import NodeWatch, capacity


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Changes:
    seq = 0

    def close(self):
        pass


def _table(n: int) -> list[dict]:
    return [{"NodeID": f"node{i:03d}", "Alive": True, "Resources": {"CPU": 8.0, f"cluster-{i % 4}": 10.0},
             "NodeManagerAddress": "10.0.0.1", "NodeManagerPort": 1000 + i} for i in range(n)]


def _watch(n: int, down: set[int] = frozenset()):
    clock, changes, reads, probes = _Clock(), _Changes(), [], []

    def table():
        reads.append(clock.t)
        return _table(n)

    def probe(address):
        probes.append(address[1] - 1000)
        return address[1] - 1000 not in down

    watch = NodeWatch(table=table, probe=probe, changes=changes, clock=clock)
    # every actor's node is known at once (as after locate())
    watch.node_of = lambda key: f"node{int(key.split(':')[1]):03d}"
    return watch, clock, changes, reads, probes


def _stage(watch, clock, keys, seconds: float, poll: float = 0.25) -> None:
    """A stage waiting on ``keys`` for ``seconds``, asking lost() every poll as gather does."""
    end, since = clock.t + seconds, clock.t
    while clock.t < end:
        watch.lost(keys, since=since)
        time.sleep(0.001)  # the probe pool's threads answer
        clock.t += poll


def test_at_100_nodes_a_quiet_stage_reads_the_table_once_and_probes_only_the_nodes_it_waits_on_past_a_second():
    watch, clock, changes, reads, probes = _watch(100)
    watch.live(fresh=True)  # the sweep before the attempt
    assert len(reads) == 1
    _stage(watch, clock, [f"engine:{i}" for i in range(100)], 0.75)  # every engine answers within 1 s
    assert (len(reads), probes) == (1, [])
    _stage(watch, clock, ["owner:7", "owner:8"], 10.0)  # two owners stream for 10 s
    assert len(reads) == 1
    assert set(probes) == {7, 8} and len(probes) <= 2 * 10  # at most one probe a second each
    changes.seq += 1  # Ray published a change of its node table
    watch.lost(["owner:7"])
    assert len(reads) == 2
    watch.close()


def test_a_node_whose_raylet_does_not_answer_is_lost_without_any_wait_and_comes_back_when_it_answers():
    down = {3}
    watch, clock, _, _, probes = _watch(10, down)
    watch.live(fresh=True)
    t0 = time.monotonic()
    lost = []
    for _ in range(12):
        lost = watch.lost(["engine:3", "engine:4"])
        time.sleep(0.01)
        clock.t += 0.25
        if lost:
            break
    assert lost == ["engine:3"] and time.monotonic() - t0 < 1.0
    assert set(probes) == {3, 4}
    down.clear()  # a partition that healed: the node answers its next probe
    clock.t += nodes_mod.RECHECK_S
    watch.live()
    time.sleep(0.05)
    assert watch.lost(["engine:3"]) == []
    watch.close()


def test_capacity_counts_how_many_actors_the_nodes_hold_together():
    nodes = [{"cluster-b": 1.0, "CPU": 4.0}, {"cluster-b": 10.0, "CPU": 1.0}]
    assert capacity(nodes, {"cluster-b": 1.0}) == 11
    assert capacity(nodes, {"cluster-b": 1.0, "CPU": 2.0}) == 1  # 1 + 0: the second node lacks CPUs
    assert capacity(nodes, {"nowhere": 0.01}) == 0
