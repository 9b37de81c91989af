"""A multi-node Ray cluster on this machine for drills and benchmarks: a training node and one node per
rollout "cluster", each marked by a custom resource (``train``, ``cluster-<name>``), all on loopback.

Node faults are real node faults: :meth:`LocalClusters.kill` stops a node's raylet, object store and
workers at once (``Cluster.remove_node(node, allow_graceful=False)``), as a host that loses power does;
:meth:`LocalClusters.lose` does it to every node of one rollout cluster (a region outage), and
:meth:`LocalClusters.add` starts a node for a cluster (capacity that returns).

A failpoint's ``kill_node`` action (:mod:`dcr_ray.failpoints.actions`) asks for its own node's death from inside
an actor: :meth:`LocalClusters.serve_node_faults` starts the :class:`NodeKiller` it asks (a small actor on
the head node) and a thread of this driver that removes each node it names.
"""

from __future__ import annotations

import os
import threading


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
            self._allow()
        return node

    def add_train(self):
        """Start a worker node that offers ``train`` (owners placed there can lose their node)."""
        node = self.cluster.add_node(num_cpus=1, resources={"train": 10})
        self.train_nodes.append(node)
        self.cluster.wait_for_nodes()
        self._allow()
        return node

    def kill(self, node) -> None:
        """The node dies at once, with every process and object on it."""
        for ns in (*self.nodes.values(), self.train_nodes):
            if node in ns:
                ns.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)
        self._allow()

    def lose(self, cluster: str) -> int:
        """Every node of ``cluster`` dies (a region outage); returns how many."""
        gone = list(self.nodes.get(cluster, ()))
        for node in gone:
            self.kill(node)
        return len(gone)

    def worker_nodes(self) -> list:
        """Every node this driver may remove (the head node cannot be)."""
        return [*[n for ns in self.nodes.values() for n in ns], *self.train_nodes]

    def serve_node_faults(self, namespace: str) -> None:
        """Start a :class:`NodeKiller` in ``namespace`` and a thread that removes each node it is asked for:
        failpoints armed with ``kill_node`` then remove their own node. :attr:`killed` lists
        ``(cluster or "train", node id)`` as they go."""
        import ray

        from dcr_ray.failpoints.actions import NODE_KILLER

        self.killed: list[tuple[str, str]] = []
        self._killer = ray.remote(NodeKiller).options(name=NODE_KILLER, namespace=namespace, num_cpus=0,
                                                      max_concurrency=4, resources=self.HEAD).remote()
        self._allow()
        self._serving = True
        self._server = threading.Thread(target=self._serve_node_faults, name="dcr-node-faults", daemon=True)
        self._server.start()

    def _allow(self) -> None:
        import ray

        if getattr(self, "_killer", None) is not None:
            ray.get(self._killer.allow.remote([n.node_id for n in self.worker_nodes()]))

    def _serve_node_faults(self) -> None:
        import ray

        while self._serving:
            try:
                node_id = ray.get(self._killer.next.remote(1.0))
            except Exception:  # the driver is shutting down
                return
            if node_id is None:
                continue
            for cluster, ns in [*self.nodes.items(), ("train", self.train_nodes)]:
                node = next((n for n in ns if n.node_id == node_id), None)
                if node is not None:
                    self.kill(node)
                    self.killed.append((cluster, node_id))
                    break

    def stop_node_faults(self) -> None:
        """Stop removing nodes on request (the :class:`NodeKiller` is killed)."""
        import ray

        self._serving = False
        if getattr(self, "_killer", None) is not None:
            self._server.join(timeout=5)
            ray.kill(self._killer)
            self._killer = None

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
            if getattr(self, "_killer", None) is not None:
                self.stop_node_faults()
            if refit is not None:
                refit.shutdown()
        finally:
            ray.shutdown()
            self.cluster.shutdown()


class NodeKiller:
    """The harness a failpoint's ``kill_node`` asks (as the actor named
    :data:`~dcr_ray.failpoints.actions.NODE_KILLER`): :meth:`kill_node` queues a node the driver may remove and
    answers whether it will; the driver's thread takes each with :meth:`next` and removes it."""

    def __init__(self):
        self._removable: set[str] = set()
        self._queue: list[str] = []
        self._cv = threading.Condition()

    def allow(self, node_ids: list[str]) -> None:
        with self._cv:
            self._removable = set(node_ids)

    def kill_node(self, node_id: str) -> bool:
        with self._cv:
            if node_id not in self._removable:
                return False
            self._queue.append(node_id)
            self._cv.notify_all()
            return True

    def next(self, timeout_s: float) -> str | None:
        with self._cv:
            if not self._queue:
                self._cv.wait(timeout_s)
            return self._queue.pop(0) if self._queue else None


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
