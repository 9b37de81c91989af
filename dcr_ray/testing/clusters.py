"""A multi-node Ray cluster on this machine for drills and benchmarks: a training node and one node per
rollout "cluster", each marked by a custom resource (``train``, ``cluster-<name>``), all on loopback.

Node faults are real node faults: :meth:`LocalClusters.kill` stops a node's raylet, object store and
workers at once (``Cluster.remove_node(node, allow_graceful=False)``), as a host that loses power does;
:meth:`LocalClusters.lose` does it to every node of one rollout cluster (a region outage), and
:meth:`LocalClusters.add` starts a node for a cluster (capacity that returns).
"""

from __future__ import annotations

import os


def _env() -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


class LocalClusters:
    """``ray.cluster_utils.Cluster`` with named rollout clusters of nodes; this driver is connected to it.

    The head node offers ``head`` (pin the coordinator there: ``RefitConfig(actor_options={"coordinator":
    {"resources": LocalClusters.HEAD}})``) and, with ``head_train``, ``train`` (owners land there); without
    it, :meth:`add_train` adds worker nodes for the owners (the head node of ``Cluster`` cannot be
    removed, so a drill that loses the owners' node puts them on one of those)."""

    #: What pins an actor to the head node.
    HEAD = {"head": 0.01}

    def __init__(self, names=("a", "b"), *, per_cluster: int = 1, head_train: bool = True):
        _env()
        import ray
        from ray.cluster_utils import Cluster

        if ray.is_initialized():
            ray.shutdown()
        head = {"num_cpus": 1, "resources": {"head": 10, **({"train": 10} if head_train else {})}}
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self.nodes: dict[str, list] = {}
        self.train_nodes: list = []
        for c in names:
            for _ in range(per_cluster):
                self.add(c, wait=False)
        ray.init(address=self.cluster.address, logging_level="ERROR", log_to_driver=False)
        self.cluster.wait_for_nodes()

    @staticmethod
    def resources(cluster: str) -> dict[str, float]:
        """What pins an actor to ``cluster``'s nodes (``ClusterSpec(resources=...)``)."""
        return {f"cluster-{cluster}": 0.01}

    def add(self, cluster: str, wait: bool = True):
        """Start one more node of ``cluster`` (returns it)."""
        node = self.cluster.add_node(num_cpus=1, resources={f"cluster-{cluster}": 10})
        self.nodes.setdefault(cluster, []).append(node)
        if wait:
            self.cluster.wait_for_nodes()
        return node

    def add_train(self):
        """Start a worker node that offers ``train`` (owners placed there can lose their node)."""
        node = self.cluster.add_node(num_cpus=1, resources={"train": 10})
        self.train_nodes.append(node)
        self.cluster.wait_for_nodes()
        return node

    def kill(self, node) -> None:
        """The node dies at once, with every process and object on it."""
        for ns in (*self.nodes.values(), self.train_nodes):
            if node in ns:
                ns.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)

    def lose(self, cluster: str) -> int:
        """Every node of ``cluster`` dies (a region outage); returns how many."""
        gone = list(self.nodes.get(cluster, ()))
        for node in gone:
            self.kill(node)
        return len(gone)

    def node_of(self, actor) -> object:
        """The ``Cluster`` node an actor runs on."""
        import ray

        node_id = ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))
        for node in (*[n for ns in self.nodes.values() for n in ns], *self.train_nodes):
            if node.node_id == node_id:
                return node
        raise LookupError(f"actor runs on node {node_id}, which is not one of this cluster's worker nodes")

    def shutdown(self, refit=None) -> None:
        """Shut down ``refit`` (if given), then this driver's Ray and the cluster, whatever fails first."""
        import ray

        try:
            if refit is not None:
                refit.shutdown()
        finally:
            ray.shutdown()
            self.cluster.shutdown()


def start_local_clusters(names=("a", "b")):
    """Start ``ray.cluster_utils.Cluster`` (a head node with resource ``train`` and one node per name with
    ``cluster-<name>``), connect this driver to it (any earlier Ray is shut down) and return it; call
    ``ray.shutdown()`` and its ``shutdown()`` when done."""
    return LocalClusters(names).cluster


def stop_local_clusters(cluster, refit=None) -> None:
    """Shut down ``refit`` (if given), then this driver's Ray and ``cluster``, whatever fails first."""
    import ray

    try:
        if refit is not None:
            refit.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
