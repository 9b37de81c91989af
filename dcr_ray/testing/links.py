"""Emulated cross-cluster links for benchmarks and tests: a link model and a transport wrapper.

The emulation is a streaming pipe: a payload of ``n`` bytes *serialises* onto the link for
``n * 8 / (mbps * 1e6)`` seconds, one payload at a time, and arrives ``latency_s`` (one-way
propagation) after its serialisation ends. Propagation of one payload overlaps the serialisation of the
next (a long-lived connection keeps the pipe full), so ``k`` back-to-back payloads of ``N`` bytes in
all take ``N * 8 / bw + latency_s``, however the bytes are split. dcr_ray's relay heads and
object-storage readers, and the benchmark's full-checkpoint reference, use the same model, so their
times compare on equal terms. ``busy_s`` is the link's serialisation time: ``busy_s + latency_s`` is
the transport lower bound of everything that crossed it.
"""

from __future__ import annotations

import threading
import time


class LinkModel:
    """Serialises crossings and sleeps for their modelled duration (``mbps=None``: no delay)."""

    def __init__(self, mbps: float | None = None, latency_s: float = 0.0):
        self.mbps = mbps
        self.latency_s = latency_s if mbps is not None else 0.0
        self._lock = threading.Lock()
        self.busy_s = 0.0
        self.bytes = 0

    def set(self, mbps: float | None, latency_s: float = 0.0) -> None:
        """Change the link (``mbps=None``: no emulation); counters keep running."""
        self.mbps = mbps
        self.latency_s = latency_s if mbps is not None else 0.0

    def __getstate__(self) -> dict:  # shipped to an actor: each process gets its own lock
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __call__(self, nbytes: int) -> None:
        """A crossing observer (see :class:`~dcr_ray.relay.relay.RelayActor`): :meth:`cross`."""
        self.cross(nbytes)

    def serialise_s(self, nbytes: int) -> float:
        """Time ``nbytes`` occupy the link (no latency)."""
        if self.mbps is None:
            return 0.0
        return nbytes * 8 / (self.mbps * 1e6)

    def seconds(self, nbytes: int) -> float:
        """Modelled time of one isolated crossing of ``nbytes`` (serialisation + latency)."""
        if self.mbps is None:
            return 0.0
        return self.serialise_s(nbytes) + self.latency_s

    def cross(self, nbytes: int) -> None:
        """Account (and wait out) one crossing of ``nbytes`` that are ready to send.

        The local copy that made the bytes available (a Ray object pull, a file read) happened before
        and is not subtracted: with several payloads in flight it overlaps other payloads'
        serialisation, so subtracting it would let the emulated link run faster than its bandwidth.
        """
        with self._lock:  # one payload serialises at a time
            d = self.serialise_s(nbytes)
            if d > 0:
                time.sleep(d)
            self.busy_s += d
            self.bytes += nbytes
        if self.latency_s > 0:  # propagation: overlaps the next payload's serialisation
            time.sleep(self.latency_s)


class LinkReader:
    """Engine-side reader of a wrapped transport whose every read crosses an emulated link
    (``crossing``, which the engine reports through ``EngineActor.crossing()``)."""

    def __init__(self, inner, link: LinkModel):
        self.inner = inner
        self.link = link

    @property
    def crossing(self) -> LinkModel:
        return self.link

    def read(self, payload) -> bytes:
        data = self.inner.read(payload)
        self.link.cross(len(data))
        return data


class EmulatedLinks:
    """A transport wrapped so that what crosses each cluster's boundary pays an emulated link.

    ``links`` maps a cluster name to ``(mbps, latency_s)``. Relay trees: each head relay gets its own
    :class:`LinkModel` as its crossing observer. Object storage: each engine's reads cross its own
    link (every engine reads its copy across the boundary). Everything else is the inner transport's.
    Each actor holds its own copy of the model; ``link_of(actor)`` reaches it (e.g. to change the
    link between benchmark cases with ``actor.__ray_call__``).
    """

    def __init__(self, config, links: dict[str, tuple[float | None, float]]):
        from dcr_ray.relay.transport import make_transport

        self.links = {c: LinkModel(m, lat) for c, (m, lat) in links.items()}
        inner = make_transport(config)
        if inner.kind == "relay":
            from dcr_ray.relay.relay_tree import RelayTransport

            inner = RelayTransport(config, on_cross=self.links)
        self.inner = inner
        self.kind = inner.kind

    def reader(self, cluster: str):
        r = self.inner.reader(cluster)
        if self.kind == "object_store" and cluster in self.links:
            m = self.links[cluster]
            return LinkReader(r, LinkModel(m.mbps, m.latency_s))
        return r

    def build(self, clusters, engines, engine_cluster) -> None:
        self.inner.build(clusters, engines, engine_cluster)

    def reconnect(self, clusters, engines, engine_cluster) -> None:
        self.inner.reconnect(clusters, engines, engine_cluster)

    def repair(self, clusters, engines, engine_cluster, timeout_s: float = 10.0, lost=(), later=()) -> list[str]:
        return self.inner.repair(clusters, engines, engine_cluster, timeout_s, lost, later)

    def settle(self, timeout_s: float) -> None:
        self.inner.settle(timeout_s)

    def install(self) -> list[str]:
        return self.inner.install()

    def place_with(self, near) -> None:
        self.inner.place_with(near)

    def suspend(self, cluster: str) -> list[str]:
        return self.inner.suspend(cluster)

    def resume(self, cluster, engines, engine_cluster) -> None:
        self.inner.resume(cluster, engines, engine_cluster)

    def sink(self, targets, required, *, every_cluster: bool = False):
        return self.inner.sink(targets, required, every_cluster=every_cluster)

    def release(self, transfer: str) -> None:
        self.inner.release(transfer)

    def keep(self, step) -> None:
        self.inner.keep(step)

    def drop_windows(self) -> None:
        self.inner.drop_windows()

    def window(self, cluster: str, version: int, version_id):
        return self.inner.window(cluster, version, version_id)

    def link_bytes(self, transfer: str, acks) -> dict[str, int]:
        return self.inner.link_bytes(transfer, acks)

    def actors(self) -> dict:
        return self.inner.actors()

    def stats(self) -> list[dict]:
        return self.inner.stats()


def link_of(actor_self) -> LinkModel:
    """The link model inside a relay or engine actor (call through ``actor.__ray_call__``), from the
    actor's public ``crossing()``. An actor that holds none is an error, not a None: a benchmark that
    sets or reads a link its actors do not hold measures nothing."""
    cross = actor_self.crossing()
    if not isinstance(cross, LinkModel):
        raise TypeError(f"{actor_self!r} holds no emulated link (crossing() gave {type(cross).__name__}): wrap "
                        f"the transport in dcr_ray.testing.links.EmulatedLinks and name this actor's cluster")
    return cross


def set_link(actor_self, mbps: float | None, latency_s: float) -> None:
    """(Run in a relay or engine actor through ``actor.__ray_call__``.) Its emulated link from now on: ``mbps``
    (None: no delay) and one-way latency. Defined here, in a module that imports nothing heavy, so that the
    relay it runs in does not import a benchmark's modules (and torch) to run it."""
    link_of(actor_self).set(mbps, latency_s)


def link_busy(actor_self) -> tuple[float, int]:
    """(Run in a relay or engine actor through ``actor.__ray_call__``.) Its link's serialisation seconds and
    bytes so far."""
    link = link_of(actor_self)
    return link.busy_s, link.bytes
