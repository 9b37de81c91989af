"""What :class:`~dcr_ray.integrations.trl.transfer.DcrWeightTransfer` needs to know: one dataclass.

A TRL user already has every value: the directory the vLLM server was started from (``AsyncGRPOTrainer``'s
``model`` when it is a local path) and the server's URL (``AsyncGRPOConfig.vllm_server_base_url``). The
rest has defaults taken from TRL's own (its ``weight_sync_timeout`` and ``vllm_server_timeout``). Bad
values raise :class:`~dcr_ray.errors.ConfigError` saying how to fix them, before any call is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dcr_ray.config import CodecConfig
from dcr_ray.engines.vllm.sync import check_urls
from dcr_ray.errors import ConfigError

#: TRL's default ``AsyncGRPOConfig.vllm_server_base_url``.
DEFAULT_SERVER_URL = "http://localhost:8000"


@dataclass(kw_only=True, slots=True)
class TrlDcrConfig:
    """Settings of the ``dcr`` weight transfer for TRL's ``AsyncGRPOTrainer`` (only ``checkpoint`` is required)."""

    checkpoint: str
    """The local checkpoint directory the vLLM server(s) were started from: it holds the bits they serve at
    ``version`` (the first baseline the trainer's tensors are diffed against), and the servers' workers read
    it too. A hub id is not enough: download it first and start vLLM from the directory."""
    server_url: str | list[str] = DEFAULT_SERVER_URL
    """Base URL of the vLLM server TRL generates with (``AsyncGRPOConfig.vllm_server_base_url``), or a list
    of URLs of servers that all serve the policy: each gets the same frames, and a sync counts only when
    every one of them applied it."""
    version: int = 0
    """The version the servers serve now: 0 for servers started from ``checkpoint``. Each sync that changes
    any bit sends ``version + 1`` and becomes the servers' ``/weight_info`` label."""
    codec: CodecConfig = field(default_factory=CodecConfig)
    """Frame encoding (bucket size, coding, the frame key the servers check); dcr_ray's defaults."""
    call_bytes: int = 64 << 20
    """Frame bytes per ``/update_weights`` request, at most (one frame may exceed it alone)."""
    timeout_s: float = 1800.0
    """Bound on each HTTP call to a server, in seconds (TRL's ``weight_sync_timeout`` default)."""
    server_timeout_s: float = 240.0
    """How long ``init_weight_transfer()`` waits for every server to answer ``/health`` (TRL's
    ``vllm_server_timeout`` default)."""

    @property
    def urls(self) -> list[str]:
        """``server_url`` as a list."""
        return [self.server_url] if isinstance(self.server_url, str) else list(self.server_url)

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint, str) or not self.checkpoint:
            raise ConfigError("TrlDcrConfig.checkpoint must be the local directory the vLLM server was started "
                              "from, e.g. TrlDcrConfig(checkpoint='/ckpt/policy-v0')")
        try:
            check_urls(self.urls)
        except ConfigError as e:
            raise ConfigError(f"TrlDcrConfig.server_url: {e} (AsyncGRPOConfig.vllm_server_base_url)") from None
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ConfigError(f"TrlDcrConfig.version must be an integer >= 0 (the version the servers serve; 0 "
                              f"when they were started from the checkpoint), got {self.version!r}")
        if not isinstance(self.codec, CodecConfig):
            raise ConfigError(f"TrlDcrConfig.codec must be a dcr_ray.CodecConfig, got {type(self.codec).__name__}")
        if isinstance(self.call_bytes, bool) or not isinstance(self.call_bytes, int) or self.call_bytes <= 0:
            raise ConfigError(f"TrlDcrConfig.call_bytes must be a positive integer, got {self.call_bytes!r}")
        for name in ("timeout_s", "server_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"TrlDcrConfig.{name} must be a number of seconds > 0, got {value!r}")


__all__ = ["DEFAULT_SERVER_URL", "TrlDcrConfig"]
