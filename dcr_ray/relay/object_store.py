"""The object-storage transport: one object per payload in a directory or an fsspec store.

An owner writes each frame as ``<root>/<transfer>/a<attempt>/<producer>/<payload>.dcrf`` and tells each
targeted engine its path; the engine reads it (every engine reads its own copy, so each read crosses
that engine's boundary). The coordinator deletes ``<root>/<transfer>`` when the transfer ends; after a
commit the committed attempt's objects stay, in a catch-up window bounded in bytes
(:mod:`dcr_ray.relay.window`), until newer commits push them out. The window's index lives with the
coordinator: a restarted coordinator starts with an empty one (the old prefixes are then never
replayed; delete them from the store at will).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from dcr_ray.codec import PayloadKey
from dcr_ray.errors import ConfigError
from dcr_ray.failpoints import failpoint
from dcr_ray.relay.backpressure import wait_bounded
from dcr_ray.relay.window import CatchUpWindow, CommittedStep


def storage_fs(url: str, options: dict | None = None):
    """(fsspec filesystem, root path) for a storage URL or local directory."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    return fs, root.rstrip("/")


class StoredFrame(str):
    """The path of a frame in object storage (what an object-storage engine is delivered)."""


class ObjectStoreSink:
    """Owner side: write each frame as one object, then deliver its path to each targeted engine."""

    def __init__(self, url: str, options: dict, engines: list, targets: list[str] | None, *,
                 max_inflight: int, timeout_s: float):
        self.url, self.options = url, options
        self.engines = engines
        self.targets = targets
        self.bound = max_inflight * max(1, len(engines))
        self.timeout = timeout_s
        self._fs = None
        self._acks: list = []
        self._made: set[str] = set()

    def send(self, frame: bytes, key: PayloadKey) -> None:
        if self._fs is None:
            self._fs, self._root = storage_fs(self.url, self.options)
        transfer, attempt, producer, pid = key
        prefix = f"{self._root}/{transfer}/a{attempt}/{producer}"
        if prefix not in self._made:
            self._fs.makedirs(prefix, exist_ok=True)
            self._made.add(prefix)
        path = StoredFrame(f"{prefix}/{pid:06d}.dcrf")
        failpoint("objstore.put")
        self._fs.pipe_file(path, frame)
        for e in self.engines:
            self._acks.append(e.deliver.remote(path, self.targets))
        self._acks = wait_bounded(self._acks, self.bound, self.timeout)

    def drain(self) -> None:
        wait_bounded(self._acks, 0, self.timeout)
        self._acks = []


class ObjectReader:
    """Engine side: read a delivered path from the store (the filesystem opens on first use)."""

    def __init__(self, url: str, options: dict):
        self.url, self.options = url, options
        self._fs = None

    def read(self, payload: Any) -> bytes:
        failpoint("objstore.read")
        if self._fs is None:
            self._fs = storage_fs(self.url, self.options)[0]
        return self._fs.cat_file(str(payload))


class ObjectStoreTransport:
    """Owners write, engines read, the coordinator deletes each transfer's prefix when it ends."""

    kind = "object_store"

    def __init__(self, config):
        if config.transport.storage_url is None:
            raise ConfigError("the object_store transport needs TransportConfig.storage_url (launch() sets a default)")
        self.config = config
        self.url = config.transport.storage_url
        self.options = dict(config.transport.storage_options)
        self._engines: dict[str, Any] = {}
        self._engine_cluster: dict[str, str] = {}
        self._window = CatchUpWindow(config.transport.catchup_window_bytes,
                                     on_drop=lambda step: self.release(step.transfer))

    def reader(self, cluster: str) -> ObjectReader:
        return ObjectReader(self.url, self.options)

    def build(self, clusters: list, engines: Mapping[str, Any], engine_cluster: Mapping[str, str]) -> None:
        self._engines = dict(engines)
        self._engine_cluster = dict(engine_cluster)

    def reconnect(self, clusters: list, engines: Mapping[str, Any], engine_cluster: Mapping[str, str]) -> None:
        self.build(clusters, engines, engine_cluster)

    def repair(self, clusters: list, engines: Mapping[str, Any], engine_cluster: Mapping[str, str],
               timeout_s: float = 10.0, lost: Iterable[str] = (), later: Iterable[str] = ()) -> list[str]:
        return []  # no actors of its own

    def settle(self, timeout_s: float) -> None:
        pass  # no actors to wait for

    def install(self) -> list[str]:
        return []  # nothing routed: every change took effect at once

    def place_with(self, near) -> None:
        pass  # no actors to place

    def suspend(self, cluster: str) -> list[str]:
        return []  # engines read the store themselves: nothing to take out

    def resume(self, cluster, engines: Mapping[str, Any], engine_cluster: Mapping[str, str]) -> None:
        self.build([], engines, engine_cluster)

    def sink(self, targets: list[str] | None, required: list[str], *, every_cluster: bool = False) -> ObjectStoreSink:
        # one store for every cluster: what is written stays for the window whoever reads it
        engines = [self._engines[e] for e in (targets if targets is not None else required)]
        return ObjectStoreSink(self.url, self.options, engines, targets,
                               max_inflight=self.config.transport.max_inflight_payloads,
                               timeout_s=self.config.commit.timeout_s)

    def release(self, transfer: str) -> None:
        fs, root = storage_fs(self.url, self.options)
        try:
            fs.rm(f"{root}/{transfer}", recursive=True)
        except FileNotFoundError:
            pass

    def keep(self, step: CommittedStep) -> None:
        failpoint("objstore.keep")
        fs, root = storage_fs(self.url, self.options)
        for d in fs.ls(f"{root}/{step.transfer}", detail=False) if fs.exists(f"{root}/{step.transfer}") else []:
            if d.rstrip("/").rsplit("/", 1)[-1] != f"a{step.attempt}":
                fs.rm(d, recursive=True)  # the attempts that did not commit
        keys = sorted(tuple(k) for k in step.keys)
        paths = [StoredFrame(f"{root}/{t}/a{a}/{p}/{i:06d}.dcrf") for t, a, p, i in keys]
        try:
            sizes = [fs.size(p) for p in paths]
        except FileNotFoundError:  # not whole: never replayed
            self.release(step.transfer)
            return
        self._window.add(CommittedStep(transfer=step.transfer, attempt=step.attempt, base=step.base,
                                       target=step.target, base_id=step.base_id, keys=keys, payloads=paths,
                                       nbytes=sum(sizes)))

    def drop_windows(self) -> None:
        self._window.clear()  # deletes each kept transfer's prefix

    def window(self, cluster: str, version: int, version_id: str | None) -> list[CommittedStep] | None:
        return self._window.since(version, version_id)

    def link_bytes(self, transfer: str, acks: Mapping[str, dict]) -> dict[str, int]:
        out = {c: 0 for c in dict.fromkeys(self._engine_cluster.values())}
        for a in acks.values():
            out[a["cluster"]] += a["bytes"]
        return out

    def actors(self) -> dict[str, Any]:
        return {}

    def stats(self) -> list[dict]:
        return []
