"""Owner-side transports: where an owner puts each finished frame while it keeps diffing.

``make_sink(desc, config)`` builds one from a picklable description the coordinator hands the owner:

``{"kind": "relay", "heads": [relay handles], "targets": None | [engine ids]}``
    ``ray.put`` the frame (the owner's process owns it) and push its ref, *nested in a list* so Ray
    does not resolve it, to every cluster's head relay. At most ``max_inflight_payloads`` pushes per
    head wait for their hop ACK (the head has pulled and re-put the payload); then ``send`` blocks:
    backpressure keeps the owner's memory bounded however large the model.

``{"kind": "object_store", "url": root, "engines": [engine handles], "targets": ...}``
    Write the frame as one object ``<root>/<transfer>/a<attempt>/<producer>/<payload>.dcrf`` through
    fsspec (a local directory or ``s3://``), then tell each engine its path; ``drain`` writes the
    owner's manifest. The coordinator writes the completion marker and deletes the prefix after commit.
"""

from __future__ import annotations

import json

import ray

from dcr_ray.config import RefitConfig
from dcr_ray.errors import RefitTimeoutError


def _wait_bounded(pending: list, bound: int, timeout: float) -> list:
    while len(pending) > bound:
        ready, pending = ray.wait(pending, num_returns=len(pending) - bound, timeout=timeout)
        if not ready:
            raise RefitTimeoutError(f"no hop acknowledgement within {timeout:.0f} s (stage_timeout_s)")
        ray.get(ready)  # surface errors of the hop
    return pending


class RelaySink:
    def __init__(self, heads: list, config: RefitConfig, targets: list[str] | None = None):
        self.heads = heads
        self.targets = targets
        self.bound = config.max_inflight_payloads * max(1, len(heads))
        self.timeout = config.stage_timeout_s
        self._acks: list = []
        self._refs: list = []

    def send(self, frame: bytes, key: tuple) -> None:
        ref = ray.put(frame)
        self._refs.append(ref)  # the owner keeps the object alive until every head holds a copy
        for h in self.heads:
            self._acks.append(h.push.remote(key, [ref], self.targets))
        self._acks = _wait_bounded(self._acks, self.bound, self.timeout)

    def drain(self) -> None:
        _wait_bounded(self._acks, 0, self.timeout)
        self._acks, self._refs = [], []


def storage_fs(url: str, options: dict | None = None):
    """(fsspec filesystem, root path) for a storage URL or local directory."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    return fs, root.rstrip("/")


def attempt_prefix(root: str, transfer: str, attempt: int) -> str:
    return f"{root}/{transfer}/a{attempt}"


class ObjectStoreSink:
    def __init__(self, url: str, engines: list, config: RefitConfig, targets: list[str] | None = None):
        self.fs, self.root = storage_fs(url, config.storage_options)
        self.engines = engines
        self.targets = targets
        self.bound = config.max_inflight_payloads * max(1, len(engines))
        self.timeout = config.stage_timeout_s
        self._acks: list = []
        self._written: list[str] = []
        self._prefix: str | None = None

    def send(self, frame: bytes, key: tuple) -> None:
        transfer, attempt, producer, pid = key
        prefix = f"{attempt_prefix(self.root, transfer, attempt)}/{producer}"
        if prefix != self._prefix:
            self.fs.makedirs(prefix, exist_ok=True)
            self._prefix = prefix
        path = f"{self._prefix}/{pid:06d}.dcrf"
        self.fs.pipe_file(path, frame)
        self._written.append(path)
        for e in self.engines:
            self._acks.append(e.deliver_object.remote(path, self.targets))
        self._acks = _wait_bounded(self._acks, self.bound, self.timeout)

    def drain(self) -> None:
        _wait_bounded(self._acks, 0, self.timeout)
        if self._prefix is not None:
            self.fs.pipe_file(f"{self._prefix}.manifest.json", json.dumps(self._written).encode())
        self._acks = []


def make_sink(desc: dict, config: RefitConfig):
    if desc["kind"] == "relay":
        return RelaySink(desc["heads"], config, desc.get("targets"))
    if desc["kind"] == "object_store":
        return ObjectStoreSink(desc["url"], desc["engines"], config, desc.get("targets"))
    raise ValueError(f"unknown sink kind {desc['kind']!r}")
