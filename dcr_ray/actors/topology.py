"""The topology: which engines exist, in which cluster, and the transport that reaches them.

The coordinator decides (:mod:`dcr_ray.actors.coordinator`); the topology only creates and holds.
It starts one engine actor per engine of each :class:`~dcr_ray.config.ClusterSpec` (pinned to the
cluster's nodes by its resources, named ``dcr_engine:<cluster>/e<i>`` in namespace ``dcr_ray``), gives
each engine its transport's reader, and lets the transport build what it needs (relay trees).
Engines dcr_ray did not start join through ``ClusterSpec.adopt``: each gets a proxy engine actor
(``dcr_engine:<cluster>/a<i>``) whose backend drives it through its own API.
"""

from __future__ import annotations

import copy
from typing import Any

import ray

from dcr_ray.actors import placement
from dcr_ray.actors.engine import EngineActor
from dcr_ray.config import ClusterSpec, RefitConfig
from dcr_ray.options import actor_options
from dcr_ray.relay.transport import Transport


def engine_name(engine_id: str) -> str:
    """The Ray actor name of engine ``engine_id`` (``<cluster>/e<i>``)."""
    return f"dcr_engine:{engine_id}"


def _keyed(factory, key: bytes | None):
    """An adopted engine's factory with the refit's frame key (its workers check frames with it)."""
    if hasattr(factory, "key"):
        factory = copy.copy(factory)
        factory.key = key
    return factory


class Topology:
    """Engines per cluster, owners, and the transport between them (held by the coordinator)."""

    def __init__(self, clusters: list[ClusterSpec], owners: dict[str, Any], transport: Transport):
        self.clusters = {c.name: c for c in clusters}
        self.owners = dict(owners)
        self.transport = transport
        self.engines: dict[str, Any] = {}
        self.engine_cluster: dict[str, str] = {}

    def start(self, backend_factory, config: RefitConfig) -> None:
        """Create every engine actor, then the transport's own actors."""
        Engine = ray.remote(EngineActor)
        for c in self.clusters.values():
            reader = self.transport.reader(c.name)
            pg = placement.reserve(c, config.commit.timeout_s)
            made = [(f"{c.name}/e{i}", backend_factory, i) for i in range(c.started)]
            made += [(f"{c.name}/a{i}", _keyed(f, config.codec.key), None) for i, f in enumerate(c.adopt)]
            for eid, factory, bundle in made:
                self.engines[eid] = Engine.options(
                    **actor_options("engine", engine_name(eid), **placement.engine_options(c, pg, bundle))
                ).remote(eid, c.name, factory, config, reader)
                self.engine_cluster[eid] = c.name
        self.transport.build(list(self.clusters.values()), self.engines, self.engine_cluster)

    def handles(self) -> dict[str, dict[str, Any]]:
        """Actor handles: ``{"engines": {id: h}, "owners": {id: h}, "relays": {id: h}}``."""
        return {"engines": dict(self.engines), "owners": dict(self.owners), "relays": self.transport.actors()}

    def engine_specs(self, timeout_s: float) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Canonical name -> (wire dtype, shape) the engines hold (asked of one engine)."""
        specs = ray.get(next(iter(self.engines.values())).call_backend.remote("tensor_specs"), timeout=timeout_s)
        return {n: (s[0], tuple(s[1])) for n, s in specs.items()}
