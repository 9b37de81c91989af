"""A multi-node Ray cluster on one machine: one training node and two rollout "clusters" of nodes.

The rollout clusters are marked by custom node resources (``cluster-us``, ``cluster-eu``), as a
deployment would mark regions. The test proves that each payload's bytes enter each rollout cluster
exactly once (counted by the cluster's head relay, which pulls the owner's object and re-owns it), that
engines land on their cluster's nodes, and that every engine is bit-exact after several refits.
"""

from __future__ import annotations

import raytools  # noqa: F401

import pytest
import ray
import torch

import dcr_ray
from dcr_ray.testing.models import ModelSpec
from dcr_ray.testing.trainer import TinyTrainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def three_cluster_ray():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"train": 10}})
    nodes = {"us": [cluster.add_node(num_cpus=1, resources={"cluster-us": 10})],
             "eu": [cluster.add_node(num_cpus=1, resources={"cluster-eu": 10}) for _ in range(2)]}
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


def test_each_payload_enters_each_cluster_exactly_once_and_engines_stay_bit_exact(three_cluster_ray):
    cluster, nodes = three_cluster_ray
    spec = ModelSpec(size="tiny")
    Trainer = ray.remote(num_cpus=0, resources={"train": 0.01})(TinyTrainer)
    trainers = [Trainer.remote(spec, lr=1e-4, rank=r, world=2) for r in range(2)]
    clusters = [
        dcr_ray.ClusterSpec(name="us", engines=1, resources={"cluster-us": 0.01}),
        dcr_ray.ClusterSpec(name="eu", engines=3, fanout=2, resources={"cluster-eu": 0.01}),
    ]
    refit = dcr_ray.launch(owners=trainers, clusters=clusters, engine=dcr_ray.HFEngine(spec.with_seed(9)),
                           config=dcr_ray.RefitConfig(codec=dcr_ray.CodecConfig(bucket_bytes=1 << 20, chunk_elems=1 << 16),
                                                      actor_options={"coordinator": {"resources": {"train": 0.01}}}))
    try:
        node_ids = {c: {n.node_id for n in ns} for c, ns in nodes.items()}
        for eid, eng in refit.engines().items():
            info = ray.get(eng.info.remote())
            assert info["node"] in node_ids[info["cluster"]], eid
        wire_total = 0
        for step in range(3):
            ray.get([t.step.remote(seed=step) for t in trainers])
            report = refit.run()
            assert report.payloads >= 2  # small buckets: several payloads per owner
            assert report.link_bytes == {"us": report.wire_bytes, "eu": report.wire_bytes}
            wire_total += report.wire_bytes
        stats = {s["relay"]: s for s in refit.relay_stats()}
        # only the head relays pulled across the boundary; each head counted every payload once
        for c in ("us", "eu"):
            head = stats[f"{c}/head"]
            assert head["head"]
            assert sum(v for t, v in head["bytes_in"].items() if t.startswith("v")) == wire_total
        assert any(not s["head"] for s in stats.values())  # eu has a sub-relay (3 engines, fanout 2)
        want = ray.get(trainers[0].rollout_state.remote())
        for eid, eng in refit.engines().items():
            got = ray.get(eng.tensors.remote())
            for n in want:
                assert torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)), (eid, n)
    finally:
        refit.shutdown()
