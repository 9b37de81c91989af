"""Where the engines dcr_ray starts run: per-engine GPUs/CPUs and one Ray placement group per cluster.

A cluster with ``ClusterSpec.placement`` gets a placement group of one bundle per started engine
(``{"GPU": gpus_per_engine, "CPU": cpus_per_engine, **resources}``); engine ``i`` is scheduled into
bundle ``i`` with ``placement_group_capture_child_tasks``, so the workers a vLLM engine starts for
tensor parallelism land in the same bundle. Without it, each engine actor asks Ray for its GPUs and
CPUs directly.
"""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dcr_ray.config import ClusterSpec
from dcr_ray.errors import ConfigError


def bundle(c: ClusterSpec) -> dict[str, float]:
    """What one started engine of ``c`` asks of a node (one placement bundle)."""
    b = dict(c.resources)
    if c.gpus_per_engine:
        b["GPU"] = c.gpus_per_engine
    if c.cpus_per_engine:
        b["CPU"] = c.cpus_per_engine
    return b


def pg_name(c: ClusterSpec, namespace: str) -> str:
    """The name of cluster ``c``'s placement group in the topology of ``namespace`` (a resumed coordinator
    finds it by name; two topologies' clusters of one name do not collide)."""
    return f"dcr_cluster:{namespace}/{c.name}"


def find(c: ClusterSpec, namespace: str):
    """Cluster ``c``'s existing placement group, or None."""
    if c.placement is None or not c.started:
        return None
    try:
        return ray.util.get_placement_group(pg_name(c, namespace))
    except ValueError:
        return None


def reserve(c: ClusterSpec, timeout_s: float, namespace: str):
    """The ready placement group of cluster ``c`` (None when it asks for none)."""
    if c.placement is None or not c.started:
        return None
    pg = ray.util.placement_group([bundle(c)] * c.started, strategy=c.placement, name=pg_name(c, namespace),
                                  lifetime="detached")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise ConfigError(f"cluster {c.name!r}: Ray could not place {c.started} bundles of {bundle(c)} with "
                          f"strategy {c.placement} within {timeout_s:.0f} s; lower gpus_per_engine / "
                          f"cpus_per_engine, add nodes, or relax the strategy") from None
    return pg


def engine_options(c: ClusterSpec, pg, index: int | None) -> dict:
    """Ray options (beyond :func:`~dcr_ray.options.actor_options`) of an engine of cluster ``c``.

    ``index``: the engine's bundle, or None for a proxy of an adopted engine (it reserves nothing).
    """
    if index is None:
        return {"resources": c.resources}
    opts = {"resources": c.resources, "num_gpus": c.gpus_per_engine, "num_cpus": c.cpus_per_engine}
    if pg is not None:
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=True)
    return opts
