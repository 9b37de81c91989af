"""A topology's actors and placement groups, found and removed by name.

A coordinator names everything it starts in its topology's namespace (:mod:`dcr_ray.options`): engines
``dcr_engine:<cluster>/eN``, relays ``dcr_relay:<cluster>/head``, owners made by
``launch(owner_tensors=...)`` ``dcr_owner:<id>``, placement groups ``dcr_cluster:<namespace>/...``. A
shutdown whose coordinator cannot tear down, and a launch that failed part way, remove them by these
names: the coordinator's own records may be gone with it.
"""

from __future__ import annotations

import ray

from dcr_ray.options import COORDINATOR_NAME, NAMESPACE

#: Name prefixes of the actors a coordinator starts (engines and relays).
TOPOLOGY_PREFIXES = ("dcr_engine:", "dcr_relay:")


def named(prefixes: tuple[str, ...], namespace: str = NAMESPACE) -> set[str]:
    """Names of the live actors of ``namespace`` that start with one of ``prefixes``."""
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == namespace and a["name"].startswith(prefixes)}


def kill_named(prefixes: tuple[str, ...], keep: set[str] = frozenset(), namespace: str = NAMESPACE) -> None:
    """Kill every actor of ``namespace`` whose name starts with one of ``prefixes``, except ``keep``."""
    for name in named(prefixes, namespace) - set(keep):
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except (ValueError, ray.exceptions.RayActorError):
            pass  # died meanwhile


def remove_placement_groups(namespace: str) -> None:
    """Remove the placement groups of the topology of ``namespace`` (named ``dcr_cluster:<namespace>/...``,
    see :mod:`~dcr_ray.actors.fleet.placement`) that this driver can reach by name."""
    for info in ray.util.placement_group_table().values():
        name = str(info.get("name") or "")
        if name.startswith(f"dcr_cluster:{namespace}/") and info.get("state") != "REMOVED":
            try:
                ray.util.remove_placement_group(ray.util.get_placement_group(name))
            except Exception:  # another job's namespace, or removed meanwhile
                pass


def coordinator_exists(namespace: str = NAMESPACE) -> bool:
    """Whether a coordinator runs in ``namespace``."""
    try:
        ray.get_actor(COORDINATOR_NAME, namespace=namespace)
    except ValueError:
        return False
    return True


__all__ = ["TOPOLOGY_PREFIXES", "coordinator_exists", "kill_named", "named", "remove_placement_groups"]
