"""How payloads travel from owners to engines: one protocol, two implementations, chosen once.

A :class:`Transport` lives in the coordinator. For each stream it hands every owner a picklable
:class:`Sink` (owner side: ``send`` each finished frame while still diffing, ``drain`` at the end);
it gives each engine a :class:`PayloadReader` at start-up (engine side: turns what arrives into frame
bytes); it releases an attempt's copies when the coordinator ends it, keeps a committed attempt's in a
bounded catch-up window per cluster (:mod:`dcr_ray.relay.window`), and it reports the bytes that
crossed each cluster's boundary.

Implementations:

* :class:`~dcr_ray.relay.relay_tree.RelayTransport` (``"relay"``): Ray object store through a tree of
  relay actors per cluster; each payload crosses each cluster boundary once.
* :class:`~dcr_ray.relay.object_store.ObjectStoreTransport` (``"object_store"``): one object per
  payload in a directory or an fsspec store (``s3://...``); each engine reads its own copy.

A transport may also be wrapped (benchmarks wrap one to emulate slow links, see
:mod:`dcr_ray.testing.links`): the coordinator only ever talks to this protocol.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Protocol, runtime_checkable

from dcr_ray.codec import PayloadKey
from dcr_ray.relay.window import CommittedStep


@runtime_checkable
class Sink(Protocol):
    """Owner side of one stream (picklable; built by the coordinator, used in the owner's process)."""

    def send(self, frame: bytes, key: PayloadKey) -> None:
        """Hand one frame to the transport; blocks while too many are unacknowledged (backpressure)."""

    def drain(self) -> None:
        """Wait until every frame sent was acknowledged by the first hop."""


@runtime_checkable
class PayloadReader(Protocol):
    """Engine side (picklable; used in the engine's process): what arrived -> the frame's bytes.

    A reader whose reads cross something the engine should report (an emulated link in benchmarks)
    exposes it as ``crossing``; ``EngineActor.crossing()`` returns it."""

    def read(self, payload: Any) -> bytes:
        """The frame bytes of ``payload`` (bytes themselves, or a reference the transport resolves)."""


class Transport(Protocol):
    """Coordinator side: builds the transport's actors, makes sinks and readers, releases, accounts."""

    kind: str

    def reader(self, cluster: str) -> PayloadReader:
        """The reader an engine of ``cluster`` uses (given to the engine at creation)."""

    def build(self, clusters: list, engines: Mapping[str, Any], engine_cluster: Mapping[str, str]) -> None:
        """Create what the transport needs once engines exist (e.g. relay actors per cluster)."""

    def reconnect(self, clusters: list, engines: Mapping[str, Any], engine_cluster: Mapping[str, str]) -> None:
        """Find the transport's existing actors of ``clusters`` and route them to ``engines`` (a resumed
        coordinator, a re-created engine); create any that are gone."""

    def settle(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, until the actors that :meth:`build`, :meth:`reconnect`,
        :meth:`repair` or :meth:`resume` created or routed answered. Changes nothing, so it runs without
        the coordinator's lock; those four never wait themselves."""

    def install(self) -> list[str]:
        """Take what answered since those calls into service (never waits; under the coordinator's lock);
        returns the clusters that did not: what is still starting stays pending (a later call of those
        four reuses it, a later install takes it), what died is dropped (actors created for it killed)."""

    def repair(self, clusters: list, engines: Mapping[str, Any], engine_cluster: Mapping[str, str],
               timeout_s: float = 10.0, lost: Iterable[str] = (), later: Iterable[str] = ()) -> list[str]:
        """Re-create the transport's actors that died, and those in ``lost`` (ids of actors whose node is
        gone), re-planning around them; returns their ids. Never waits on an actor in ``lost``. Actors in
        ``later`` (gone, where no required engine is left) are dropped, and come back with the engines
        re-created there (:meth:`reconnect`)."""

    def place_with(self, near: Callable[[str], dict]) -> None:
        """``near(cluster)``: extra Ray options (a scheduling strategy) of the actors the transport creates
        in that cluster from now on (the coordinator keeps them off nodes that are gone)."""

    def suspend(self, cluster: str) -> list[str]:
        """Take ``cluster`` out while no live node can host it: its actors are killed and no sink, window,
        count or release reaches it until :meth:`resume`; returns the ids of the actors it had."""

    def resume(self, cluster, engines: Mapping[str, Any], engine_cluster: Mapping[str, str]) -> None:
        """``cluster`` (a :class:`~dcr_ray.config.ClusterSpec`) can be hosted again: what the transport
        needs there is created anew, routed to ``engines``."""

    def sink(self, targets: list[str] | None, required: list[str], *, every_cluster: bool = False) -> Sink:
        """A sink that reaches ``targets`` (engine ids), or every engine in ``required`` when None. With
        ``every_cluster`` (a refit's stream) the payloads also enter clusters none of ``targets`` is in,
        delivered to no engine there but kept for their catch-up windows after the commit, so a cluster
        whose engines are all healing or evicted can still catch up by deltas."""

    def release(self, transfer: str) -> None:
        """Drop every copy the transport holds of ``transfer``'s payloads (all its attempts)."""

    def keep(self, step: CommittedStep) -> None:
        """After ``step`` committed: keep its committed attempt's payloads in each cluster's catch-up
        window (bounded by ``TransportConfig.catchup_window_bytes``) and release everything else of the
        transfer, as :meth:`release` does."""

    def drop_windows(self) -> None:
        """Drop every payload the catch-up windows keep (the topology shuts down)."""

    def window(self, cluster: str, version: int, version_id: str | None) -> list[CommittedStep] | None:
        """The committed steps ``cluster`` keeps from content ``(version, version_id)`` to the newest
        commit, each with its payloads as the cluster's engines read them; None when the window does
        not reach back that far (see :mod:`dcr_ray.relay.window`)."""

    def link_bytes(self, transfer: str, acks: Mapping[str, dict]) -> dict[str, int]:
        """Bytes of ``transfer`` that crossed each cluster's boundary (``acks``: engine flush replies)."""

    def actors(self) -> dict[str, Any]:
        """The transport's own actors by id (relays), for inspection and shutdown."""

    def stats(self) -> list[dict]:
        """Per-actor statistics (relays: bytes and payloads in)."""


def make_transport(config) -> Transport:
    """The transport ``config.transport`` names."""
    if config.transport.kind == "relay":
        from dcr_ray.relay.relay_tree import RelayTransport

        return RelayTransport(config)
    from dcr_ray.relay.object_store import ObjectStoreTransport

    return ObjectStoreTransport(config)
