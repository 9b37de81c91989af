"""A multi-node Ray cluster on this machine for drills and benchmarks: a training node and one node per
rollout "cluster", each marked by a custom resource (``train``, ``cluster-<name>``), all on loopback."""

from __future__ import annotations

import os


def start_local_clusters(names=("a", "b")):
    """Start ``ray.cluster_utils.Cluster`` (a head node with resource ``train`` and one node per name with
    ``cluster-<name>``), connect this driver to it (any earlier Ray is shut down) and return it; call
    ``ray.shutdown()`` and its ``shutdown()`` when done."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"train": 10}})
    for c in names:
        cluster.add_node(num_cpus=1, resources={f"cluster-{c}": 10})
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    cluster.wait_for_nodes()
    return cluster


def stop_local_clusters(cluster, refit=None) -> None:
    """Shut down ``refit`` (if given), then this driver's Ray and ``cluster``, whatever fails first."""
    import ray

    try:
        if refit is not None:
            refit.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
