"""The ``dcr`` backend's settings: ``actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.dcr``.

veRL passes ``engine_kwargs[<backend>]`` to every checkpoint engine it builds (trainer ranks and rollout
workers) and the manager reads the same dict, so one dataclass holds both sides' keys. Unknown keys and
bad values raise :class:`~dcr_ray.errors.ConfigError` naming the fix, before anything is spawned.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from dcr_ray.config import CODINGS
from dcr_ray.errors import ConfigError

#: What ``transport`` may name (see :class:`dcr_ray.TransportConfig`).
TRANSPORTS = ("relay", "object_store")


@dataclass(kw_only=True, slots=True)
class VerlDcrSettings:
    """``engine_kwargs.dcr`` of veRL's checkpoint-engine config (every key optional)."""

    clusters: dict[str, list[int]] = field(default_factory=dict)
    """Cluster name -> replica ranks (``RolloutReplica.replica_rank``) in it; each cluster's payloads cross
    into it once. Default: every replica in one cluster named ``rollout``."""
    checkpoint: str | None = None
    """The HF checkpoint directory the vLLM servers were started from (read by dcr_ray's proxies and the
    servers' workers). Default: the replicas' ``model_config.local_path``."""
    dtype: str = "bfloat16"
    """The dtype the rollout holds: floating tensors the trainer exports in another dtype are cast to it
    (a local cast on each rank; veRL's FSDP shard export is already BF16)."""
    transport: str = "relay"
    """``relay`` (relay tree over the Ray object store) or ``object_store`` (a directory / S3)."""
    coding: str = "auto"
    """Position/value coding of first attempts (:class:`dcr_ray.CodecConfig` ``coding``): ``auto`` (the
    library's default: each refit picks from the measured link and codec throughput), ``plain`` (cheapest
    to apply) or ``context`` (fewer wire bytes, more receiver CPU: for link-bound refits)."""
    link_mbps: float | dict[str, float] | None = None
    """The rollout clusters' link throughput in Mbit/s for ``coding: auto`` (one figure, or one per cluster
    name of ``clusters``); default: measured over recent syncs (:class:`dcr_ray.CodecConfig` ``link_mbps``)."""
    timeout_s: float = 600.0
    """Bound on one refit (and on launch with its first dense bootstrap) in seconds."""
    release_kv_cache: bool = True
    """Call veRL's ``release_kv_cache_replicas`` before each sync and ``resume_kv_cache_replicas`` after, as
    veRL's own manager does (KV-cache memory is free during the sync). veRL 0.9.1 releases with a level-2
    sleep, which on GPU discards the served weights too: each released replica is checked by digest
    before the sync, and one whose bits are gone fails the sync (nothing is sent). Set False (or
    ``rollout.free_cache_engine: false``) where that happens: GPU replicas with ``free_cache_engine``."""

    def codec(self):
        """The :class:`dcr_ray.CodecConfig` these settings give."""
        from dcr_ray.config import CodecConfig

        return CodecConfig(coding=self.coding, link_mbps=self.link_mbps)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any] | None) -> "VerlDcrSettings":
        """Parse ``engine_kwargs.dcr`` (a dict or an OmegaConf node); refuse unknown keys."""
        raw = dict(kwargs or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"checkpoint_engine.engine_kwargs.dcr has unknown keys {unknown}; "
                              f"known: {sorted(known)}")
        if isinstance(raw.get("link_mbps"), Mapping):  # an OmegaConf node: a plain dict for CodecConfig
            raw["link_mbps"] = {str(k): v for k, v in dict(raw["link_mbps"]).items()}
        if "clusters" in raw:
            raw["clusters"] = {str(k): [int(r) for r in v] for k, v in dict(raw["clusters"]).items()}
        return cls(**raw)

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"engine_kwargs.dcr.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.coding not in CODINGS:
            raise ConfigError(f"engine_kwargs.dcr.coding must be one of {CODINGS}, got {self.coding!r}")
        try:
            self.codec()
        except ConfigError as e:
            raise ConfigError(f"engine_kwargs.dcr: {e}") from None
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"engine_kwargs.dcr.dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if not isinstance(self.release_kv_cache, bool):
            raise ConfigError(f"engine_kwargs.dcr.release_kv_cache must be true or false, got "
                              f"{self.release_kv_cache!r}")
        if not self.timeout_s > 0:
            raise ConfigError(f"engine_kwargs.dcr.timeout_s must be > 0, got {self.timeout_s!r}")
        seen: dict[int, str] = {}
        for name, ranks in self.clusters.items():
            if not ranks:
                raise ConfigError(f"engine_kwargs.dcr.clusters[{name!r}] lists no replica ranks")
            for r in ranks:
                if r in seen:
                    raise ConfigError(f"replica {r} is in clusters {seen[r]!r} and {name!r}: give each replica "
                                      f"one cluster")
                seen[r] = name


__all__ = ["TRANSPORTS", "VerlDcrSettings"]
