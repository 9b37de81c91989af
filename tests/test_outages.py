"""Real node faults on a multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``): a node
killed mid-refit (its raylet, store and workers at once), a whole rollout cluster lost between refits
and its capacity back, and the owners' node lost. Clusters are pinned by ``ClusterSpec.resources``.

What must hold: a lost node costs at most one retry; a lost cluster waits for capacity while the others
commit and serve; capacity that returns heals it from a peer of another cluster (one crossing of its
link) and then inside it; a lost owner fails the refit at once, naming ``Refit.replace_owner``. Every
test ends with the wrong-bits sweep: every alive engine equals the committed version on integer views.
"""

from __future__ import annotations

import raytools  # noqa: F401  (loopback environment before ray is imported)

import threading
import time

import pytest
import ray

import dcr_ray
from dcr_ray.errors import ConfigError
from dcr_ray.status import format_status
from dcr_ray.testing.clusters import LocalClusters
from dcr_ray.testing.models import ModelSpec
from dcr_ray.testing.trainer import TinyTrainer
from raytools import assert_no_wrong_bits

pytestmark = pytest.mark.slow

SPEC = ModelSpec(size="tiny")


def _launch(nodes: LocalClusters, *, owner_resources=None, timeout_s: float = 60.0):
    Trainer = ray.remote(num_cpus=0, resources=owner_resources or {"train": 0.01})(TinyTrainer)
    trainers = [Trainer.remote(SPEC, lr=1e-4, rank=r, world=2) for r in range(2)]
    clusters = [dcr_ray.ClusterSpec(name=c, engines=2, resources=nodes.resources(c)) for c in ("a", "b")]
    config = dcr_ray.RefitConfig(commit=dcr_ray.CommitConfig(timeout_s=timeout_s),
                                 actor_options={"coordinator": {"resources": LocalClusters.HEAD}})
    refit = dcr_ray.launch(owners=trainers, clusters=clusters, engine=dcr_ray.HFEngine(SPEC.with_seed(9)),
                           config=config)
    return refit, trainers


def _step(trainers, seed: int) -> None:
    ray.get([t.step.remote(seed=seed) for t in trainers])


def _committed(trainers) -> dict:
    """The committed bits, from the owners (the two data-parallel replicas hold the same weights)."""
    return ray.get(trainers[0].rollout_state.remote())


def _wait_phase(refit, phases, limit_s: float = 60.0) -> str:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        p = refit.status()["phase"]["phase"]
        if p in phases:
            return p
        time.sleep(0.01)
    raise AssertionError(f"the refit never reached {phases}")


def test_a_node_lost_mid_refit_costs_one_retry_and_a_lost_cluster_waits_for_capacity_while_the_other_commits():
    nodes = LocalClusters(("a", "b"))
    refit = None
    try:
        refit, trainers = _launch(nodes)
        a2 = nodes.add("a")  # cluster a spans two nodes; both its engines and its head relay sit on the first
        _step(trainers, 0)
        refit.run()

        # a node dies while the owners stream: the refit retries once without its engines and commits
        _step(trainers, 1)
        pending = refit.remote()
        _wait_phase(refit, ("stream", "flush"))
        nodes.kill(nodes.nodes["a"][0])
        report = ray.get(pending, timeout=120)
        assert report.version == 2 and report.attempts <= 2, report
        assert any("node is gone" in w for w in report.warnings), report.warnings
        refit.wait_healed(timeout=180)  # re-created on a's other node, healed from a peer
        st = refit.status()
        assert sorted(st["required"]) == ["a/e0", "a/e1", "b/e0", "b/e1"], st["standings"]
        assert all(ray.get(e.info.remote())["node"] == a2.node_id
                   for eid, e in refit.engines().items() if eid.startswith("a/"))
        assert_no_wrong_bits(refit, _committed(trainers), 2)

        # every node of cluster b dies between refits: the next refits commit for a, once each, and a serves
        nodes.lose("b")
        for v in (3, 4):
            _step(trainers, v)
            report = refit.run(timeout=120)
            assert report.version == v and report.attempts == 1, report
            out = ray.get(refit.engines()["a/e0"].generate.remote([[1, 2, 3]], 2), timeout=30)
            assert out["version"] == v
        st = refit.status()
        assert list(st["capacity"]) == ["b"] and st["capacity"]["b"]["waiting_since"] > 0, st["capacity"]
        assert {e: r["standing"] for e, r in st["healing"].items()} == {"b/e0": "waiting for capacity",
                                                                      "b/e1": "waiting for capacity"}, (
            st["healing"], report.warnings)
        assert sorted(st["required"]) == ["a/e0", "a/e1"]
        assert any("waiting for capacity" in w for w in report.warnings), report.warnings
        assert "cluster b is waiting for capacity since" in format_status(refit.status(detail=True))

        # capacity returns: b heals from a peer of a (one crossing), then inside b, and takes part again
        nodes.add("b")
        refit.wait_healed(timeout=240)
        healed = {h["engine"]: h for h in refit.status()["healed"][-2:]}
        first, second = sorted(healed, key=lambda e: healed[e]["at"])
        assert healed[first]["sources"][0].startswith("a/") and healed[first]["cross_bytes"] > 0
        assert healed[second]["sources"][0] == first and healed[second]["cross_bytes"] == 0
        _step(trainers, 5)
        report = refit.run(timeout=120)
        assert report.version == 5 and sorted(report.engine_versions) == ["a/e0", "a/e1", "b/e0", "b/e1"]
        assert refit.status()["capacity"] == {}
        assert_no_wrong_bits(refit, _committed(trainers), 5)
    finally:
        nodes.shutdown(refit)


def test_a_refit_whose_owners_node_is_lost_fails_at_once_naming_replace_owner_and_engines_keep_serving():
    nodes = LocalClusters(("a", "b"), head_train=False)
    refit = None
    try:
        train = nodes.add_train()  # owners on a worker node (the head node cannot be removed)
        refit, trainers = _launch(nodes, owner_resources={"train": 0.01}, timeout_s=120.0)
        _step(trainers, 0)
        refit.run()
        committed = _committed(trainers)
        nodes.kill(train)
        failed = {}

        def call():
            t = time.perf_counter()
            try:
                refit.run(timeout=300)
            except Exception as e:  # noqa: BLE001 - the error is what the test reads
                failed["error"] = e
            failed["seconds"] = time.perf_counter() - t

        th = threading.Thread(target=call)
        th.start()
        th.join(timeout=300)
        assert isinstance(failed.get("error"), dcr_ray.RefitError), failed
        assert "Refit.replace_owner" in str(failed["error"])
        assert failed["seconds"] < 60.0, failed  # not a stage timeout (120 s): the lost node was seen at once
        for eid, eng in refit.engines().items():  # still serving the committed version
            assert ray.get(eng.generate.remote([[1, 2, 3]], 2), timeout=30)["version"] == 1, eid
        assert_no_wrong_bits(refit, committed, 1)
    finally:
        nodes.shutdown(refit)


def _node(nodes: LocalClusters, cluster: str, relays: bool = True):
    """A node of ``cluster``; with ``relays``, it also offers the resource the relays ask (``relay-slot``)."""
    node = nodes.cluster.add_node(num_cpus=1, resources={f"cluster-{cluster}": 10, **({"relay-slot": 10} if relays else {})})
    nodes.nodes.setdefault(cluster, []).append(node)
    nodes.cluster.wait_for_nodes()
    return node


@pytest.mark.timeout(600)
def test_relays_that_cannot_start_and_a_coordinator_restart_while_a_cluster_waits_hold_no_refit_up():
    nodes = LocalClusters(())
    refit = None
    try:
        _node(nodes, "a")
        _node(nodes, "b")
        Trainer = ray.remote(num_cpus=0, resources={"train": 0.01})(TinyTrainer)
        trainers = [Trainer.remote(SPEC, lr=1e-4, rank=r, world=2) for r in range(2)]
        clusters = [dcr_ray.ClusterSpec(name=c, engines=2, resources=nodes.resources(c)) for c in ("a", "b")]
        # a commit directory left to its default lives on this machine: refused unless the coordinator is pinned here
        with pytest.raises(ConfigError, match="CommitConfig.dir defaults to a temporary directory"):
            dcr_ray.launch(owners=trainers, clusters=clusters, engine=dcr_ray.HFEngine(SPEC.with_seed(9)))
        config = dcr_ray.RefitConfig(commit=dcr_ray.CommitConfig(timeout_s=20.0, start_timeout_s=120.0),
                                     actor_options={"coordinator": {"resources": LocalClusters.HEAD},
                                                    "relay": {"resources": {"relay-slot": 0.01}}})
        refit = dcr_ray.launch(owners=trainers, clusters=clusters, engine=dcr_ray.HFEngine(SPEC.with_seed(9)),
                               config=config)
        _step(trainers, 0)
        refit.run(timeout=120)
        nodes.lose("b")
        _step(trainers, 1)
        assert refit.run(timeout=120).version == 2
        assert list(refit.status()["capacity"]) == ["b"]

        # the coordinator restarts while b waits for capacity: it resumes at once, nothing waits for b
        epoch = refit.status()["epoch"]
        ray.kill(refit.actor, no_restart=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if refit.status()["commit_record"]["epoch"] > epoch:
                    break
            except ray.exceptions.RayActorError:
                pass
            time.sleep(0.2)
        _step(trainers, 2)
        report = refit.run(timeout=60)
        assert report.version == 3 and sorted(report.engine_versions) == ["a/e0", "a/e1"], report
        assert list(refit.status()["capacity"]) == ["b"]

        # a node of b joins whose relays cannot start there (it lacks relay-slot): b's engines could be
        # placed, its relays never answer; the heal waits for them without the coordinator's lock
        bad = _node(nodes, "b", relays=False)
        time.sleep(3.0)  # the healing worker looks every second
        _step(trainers, 3)
        t0 = time.monotonic()
        assert refit.run(timeout=60).version == 4
        assert time.monotonic() - t0 < 30.0  # no wait for b's relays (20 s, the stage timeout) on the refit's path
        assert list(refit.status()["capacity"]) == ["b"]

        # a node that can host b's relays: b heals, and takes part again
        nodes.kill(bad)
        _node(nodes, "b")
        deadline = time.monotonic() + 240
        while sorted(refit.status()["required"]) != ["a/e0", "a/e1", "b/e0", "b/e1"]:
            assert time.monotonic() < deadline, refit.status()
            time.sleep(0.5)
        refit.wait_healed(timeout=240)
        _step(trainers, 4)
        report = refit.run(timeout=120)
        assert report.version == 5 and sorted(report.engine_versions) == ["a/e0", "a/e1", "b/e0", "b/e1"], (
            report.warnings)
        assert_no_wrong_bits(refit, _committed(trainers), 5)
    finally:
        nodes.shutdown(refit)
