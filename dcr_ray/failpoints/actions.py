"""What a fired failpoint does (see :data:`~dcr_ray.failpoints.plan.ACTIONS`).

* ``raise``: :class:`FailpointError`, a ``RuntimeError`` and not a :class:`~dcr_ray.errors.DcrError`: it stands
  for any failure the library did not foresee (a backend's, the runtime's), which the protocol must still
  turn into a failed attempt;
* ``stall``: the calling thread sleeps ``stall_s`` (with whatever lock it holds, as a hung call would);
* ``exit``: the process exits at once (``os._exit``), as one that crashed: Ray sees its actor die;
* ``kill_node``: the process's node is removed by a harness: the actor named :data:`NODE_KILLER` in the
  topology's namespace (``dcr_ray.testing.clusters.NodeKiller`` on a ``ray.cluster_utils.Cluster``) is asked to
  remove it, and the process waits for its end; a node the harness cannot remove (the head node) raises
  :class:`FailpointError` instead;
* ``restart_coordinator``: the topology's coordinator dies and Ray restarts it (from the coordinator
  itself: ``exit``).
"""

from __future__ import annotations

import os
import sys
import time

from dcr_ray.failpoints.plan import Fault

#: The name of the harness actor that removes nodes for ``kill_node`` (in the topology's namespace).
NODE_KILLER = "dcr_failpoints:node_killer"
#: How long a process whose node is being removed waits for it before it exits by itself.
NODE_DEATH_WAIT_S = 60.0
#: The exit status of a process a failpoint ended.
EXIT_STATUS = 77


class FailpointError(RuntimeError):
    """The failure a failpoint injects (``raise``)."""


def fire(fault: Fault, hit: int) -> None:
    """Do what ``fault`` says, at hit ``hit`` of its point."""
    where = f"failpoint {fault.point} (hit {hit})"
    if fault.action == "raise":
        raise FailpointError(f"{where}: injected failure")
    if fault.action == "stall":
        time.sleep(fault.stall_s)
    elif fault.action == "exit":
        exit_now()
    elif fault.action == "kill_node":
        _kill_node(fault, where)
    elif fault.action == "restart_coordinator":
        _restart_coordinator(fault)


def exit_now() -> None:
    """End this process at once, as a crash does (no cleanup, no ``finally``)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(EXIT_STATUS)


def _namespace(fault: Fault) -> str:
    import ray

    return fault.namespace or ray.get_runtime_context().namespace


def _kill_node(fault: Fault, where: str) -> None:
    import ray

    try:
        killer = ray.get_actor(NODE_KILLER, namespace=_namespace(fault))
    except ValueError:
        raise FailpointError(f"{where}: kill_node needs a harness actor named {NODE_KILLER!r} in the topology's "
                             f"namespace (dcr_ray.testing.clusters.NodeKiller)") from None
    node = ray.get_runtime_context().get_node_id()
    if not ray.get(killer.kill_node.remote(node), timeout=NODE_DEATH_WAIT_S):
        raise FailpointError(f"{where}: the harness cannot remove node {node} (the head node)")
    time.sleep(NODE_DEATH_WAIT_S)  # the node dies around this process
    exit_now()


def _restart_coordinator(fault: Fault) -> None:
    import ray

    from dcr_ray.options import COORDINATOR_NAME

    if ray.get_runtime_context().get_actor_name() == COORDINATOR_NAME:
        exit_now()
    ray.kill(ray.get_actor(COORDINATOR_NAME, namespace=_namespace(fault)), no_restart=False)
