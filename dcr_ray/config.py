"""Configuration of a refit topology. Every field is documented; invalid settings fail fast with a
message that says how to fix them. No hidden environment variables: everything is here."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

from dcr_ray.errors import ConfigError

TRANSPORTS = ("relay", "object_store")


@dataclass(kw_only=True, slots=True)
class ClusterSpec:
    """A group of rollout engines behind one cluster boundary (e.g. one region)."""

    name: str
    """Cluster name, e.g. ``"us-east"``; appears in reports (wire bytes per cluster link) and actor names."""
    engines: int = 1
    """Number of engine actors in this cluster."""
    resources: dict[str, float] = field(default_factory=dict)
    """Ray custom resources that pin this cluster's relays and engines to its nodes, e.g.
    ``{"cluster-us-east": 0.001}`` when nodes were started with ``--resources='{"cluster-us-east": 100}'``.
    Empty: no pinning (a single-machine run)."""
    fanout: int = 4
    """How many children (engines or sub-relays) one relay forwards to inside the cluster."""
    link_mbps: float | None = None
    """Emulated bandwidth of this cluster's boundary link in Mbit/s (benchmarks); ``None``: no emulation."""
    link_latency_s: float = 0.0
    """Emulated one-way latency added per payload crossing the boundary (benchmarks)."""

    def __post_init__(self):
        if not self.name or any(c in self.name for c in "/\\ "):
            raise ConfigError(f"ClusterSpec.name {self.name!r} must be non-empty without '/', '\\' or spaces")
        if self.engines < 1:
            raise ConfigError(f"ClusterSpec({self.name}).engines must be >= 1, got {self.engines}")
        if self.fanout < 2:
            raise ConfigError(f"ClusterSpec({self.name}).fanout must be >= 2, got {self.fanout}")
        if self.link_mbps is not None and self.link_mbps <= 0:
            raise ConfigError(f"ClusterSpec({self.name}).link_mbps must be > 0 or None, got {self.link_mbps}")


@dataclass(kw_only=True, slots=True)
class RefitConfig:
    """How refits are encoded, moved and committed."""

    transport: str = "relay"
    """``"relay"`` (Ray object store through a relay tree; the default) or ``"object_store"`` (fsspec)."""
    storage_url: str | None = None
    """Object-storage root for ``transport="object_store"``: a local directory (default: a fresh temp
    directory) or an fsspec URL such as ``s3://bucket/prefix``."""
    storage_options: dict = field(default_factory=dict)
    """Extra fsspec options for ``storage_url`` (e.g. ``{"client_kwargs": {"endpoint_url": ...}}``)."""
    commit_dir: str | None = None
    """Directory of the durable commit record (default: a fresh temp directory)."""
    bucket_bytes: int = 16 << 20
    """Upper bound (raw, before compression) of one payload frame. 16 MiB by default: at a 3% change
    rate one BF16 frame then covers ~0.25 B elements, so payloads of models from ~1 B parameters up
    stream while the owner still diffs (``dcr-ray bench refit`` uses 2 MiB on its 0.6 B model)."""
    chunk_elems: int = 1 << 20
    """Elements per diff chunk (and per frame item); a chunk is DENSE or sparse as a whole. Must satisfy
    ``chunk_elems * 8 <= bucket_bytes``."""
    zstd_level: int = 1
    """zstd level of frame sections (see ``dcr-ray bench codec`` for the measured trade-off)."""
    key: bytes | None = None
    """Shared secret for keyed BLAKE2b frame digests; receivers reject frames not signed with it."""
    max_inflight_payloads: int = 8
    """Payloads an owner may have pushed but not yet acknowledged by the first hop (backpressure)."""
    stage_timeout_s: float = 300.0
    """Timeout of every wait in a refit (prepare, stream, flush, commit); exceeded -> RefitTimeoutError."""
    max_attempts: int = 3
    """Attempts per refit; every retry sends OVERWRITE payloads of the complete changed set."""
    xor: bool = True
    """Use XOR masks where allowed (mixed mode). ``False`` sends OVERWRITE only."""
    background_promote: bool = True
    """Owners fold the committed changed set into their baselines in a background thread, so the
    refit returns without waiting for it; their next diff, bootstrap or version read waits for it
    (and a failed promote fails that call with ``BaselineError``). ``False`` promotes inside the
    commit stage."""
    stage_payloads: bool = False
    """Async RL: engines validate and *stage* arriving payloads (compressed, in host RAM) while they
    keep serving the current version, and apply them all at flush. ``False`` (default, synchronous
    RL): payloads are applied in place as they arrive and generation pauses until the new version
    is active."""

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"RefitConfig.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.chunk_elems < 1 or self.chunk_elems > (1 << 31):
            raise ConfigError(f"RefitConfig.chunk_elems must be in 1..2**31, got {self.chunk_elems}")
        if self.chunk_elems * 8 > self.bucket_bytes:
            raise ConfigError(
                f"RefitConfig.chunk_elems * 8 ({self.chunk_elems * 8}) must not exceed bucket_bytes "
                f"({self.bucket_bytes}): lower chunk_elems or raise bucket_bytes"
            )
        if not 1 <= self.max_inflight_payloads <= 1024:
            raise ConfigError("RefitConfig.max_inflight_payloads must be in 1..1024")
        if self.stage_timeout_s <= 0:
            raise ConfigError("RefitConfig.stage_timeout_s must be > 0 seconds")
        if self.max_attempts < 1:
            raise ConfigError("RefitConfig.max_attempts must be >= 1")
        if self.key is not None and not (isinstance(self.key, bytes) and 1 <= len(self.key) <= 64):
            raise ConfigError("RefitConfig.key must be bytes of length 1..64 (a BLAKE2b key) or None")
        if self.transport == "object_store" and self.storage_url is None:
            self.storage_url = tempfile.mkdtemp(prefix="dcr_objstore_")
        if self.commit_dir is None:
            self.commit_dir = tempfile.mkdtemp(prefix="dcr_commit_")
        os.makedirs(self.commit_dir, exist_ok=True)
