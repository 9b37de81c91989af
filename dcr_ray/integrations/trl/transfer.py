"""TRL's ``WeightTransferProtocol`` with dcr_ray's delta frames: the one argument a TRL user adds.

::

    from dcr_ray.integrations.trl import DcrWeightTransfer

    trainer = AsyncGRPOTrainer(model="/ckpt/policy-v0", reward_funcs=..., train_dataset=..., args=args,
                               weight_transfer=DcrWeightTransfer(checkpoint="/ckpt/policy-v0",
                                                                 server_url=args.vllm_server_base_url))

and the vLLM server runs with ``VLLM_SERVER_DEV_MODE=1`` (TRL needs it already) and
``--weight-transfer-config '{"backend": "dcr"}'`` instead of ``'{"backend": "nccl"}'``.

TRL 1.16 (``trl/experimental/async_grpo/async_grpo_trainer.py``) calls the protocol on the main process
only: ``init_weight_transfer()`` once at train begin, then per sync ``pause()``, ``send_weights(iterator)``
(the iterator yields ``(name, full tensor)`` for every trained parameter; other ranks drain their own copy,
which on FSDP2 runs the ``full_tensor()`` collectives) and ``resume()``; ``destroy()`` at train end, also
after a failure. The sender is :class:`~dcr_ray.integrations.vllm.trainer.DcrTrainerWeightTransferEngine`,
the trainer side of vLLM's ``dcr`` backend: one dcr_ray owner whose baseline starts as the checkpoint's
bits, fed the iterator's tensors cast to the checkpoint's dtype, diffing them and sending only the changed
elements (XOR / OVERWRITE frames, base64 in ``/update_weights`` requests) to every server; the servers'
workers validate each frame before writing it into their host mirror and reload the touched fused groups
at ``finish_weight_update``, so they serve exactly the bits a dense load of the trainer's tensors gives.

Generation pauses only for that apply (:mod:`~dcr_ray.integrations.trl.pause`). Failure semantics are
dcr_ray's: a refused frame or call abandons the sync on every server (they keep serving the version they
served, their mirrors get back the bits the sync replaced), the owner keeps its baseline, the servers
resume, and ``send_weights`` raises :class:`~dcr_ray.errors.BackendError`; the next sync diffs from the
same baseline. A sync in which no bit changed calls nothing (TRL's cold sync at train begin, when the
trainer loaded the checkpoint the servers serve).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator

import torch

from dcr_ray.errors import BackendError, ConfigError
from dcr_ray.integrations.trl.config import TrlDcrConfig
from dcr_ray.integrations.trl.pause import ApplyPause
from dcr_ray.integrations.trl.server_calls import TrlServerCalls
from dcr_ray.integrations.vllm.trainer import DcrTrainerInitInfo, DcrTrainerWeightTransferEngine

log = logging.getLogger(__name__)


class _DenseCount:
    """What TRL's NCCL path would broadcast for the same sync: every yielded tensor's bytes, as yielded."""

    def __init__(self):
        self.bytes = 0
        self.tensors = 0

    def add(self, tensor: torch.Tensor) -> None:
        self.bytes += tensor.numel() * tensor.element_size()
        self.tensors += 1


class DcrWeightTransfer:
    """TRL's ``WeightTransferProtocol`` (``AsyncGRPOTrainer(weight_transfer=...)``) sending delta frames.

    Build it from a :class:`~dcr_ray.integrations.trl.config.TrlDcrConfig` or from its fields as keywords
    (``DcrWeightTransfer(checkpoint=..., server_url=...)``). After each sync, :attr:`syncs` holds its
    summary: ``version``, ``changed`` elements, ``frames``, ``calls``, ``wire_bytes`` (frame bytes; base64
    makes the HTTP bodies 4/3 of that), ``dense_bytes`` (what TRL's NCCL path would broadcast: every
    yielded tensor's bytes in the trainer's dtype), ``tensors``, ``pause_s`` and ``seconds``.
    """

    def __init__(self, config: TrlDcrConfig | None = None, /, **settings: Any):
        if config is None:
            config = TrlDcrConfig(**settings)
        elif settings:
            raise ConfigError("DcrWeightTransfer takes a TrlDcrConfig or its fields as keywords, not both")
        elif not isinstance(config, TrlDcrConfig):
            raise ConfigError(f"DcrWeightTransfer takes a TrlDcrConfig, got {type(config).__name__}")
        self.config = config
        self.calls = TrlServerCalls(config.urls, config.timeout_s)
        self.pause_window = ApplyPause(self.calls)
        self.engine: DcrTrainerWeightTransferEngine | None = None
        self.syncs: list[dict[str, Any]] = []
        self._held_logged = False

    # -- TRL's WeightTransferProtocol ---------------------------------------------------------------
    def init_weight_transfer(self) -> None:
        """Wait for every server's ``/health``, initialise their ``dcr`` backend (checked on every worker)
        and take the checkpoint's bits as the owner's baseline. Idempotent."""
        if self.engine is not None:
            return
        self.calls.wait_ready(self.config.server_timeout_s)
        info = DcrTrainerInitInfo(checkpoint=self.config.checkpoint, rank=0, version=self.config.version,
                                  codec=self.config.codec, call_bytes=self.config.call_bytes,
                                  timeout_s=self.config.timeout_s)
        try:
            self.engine = DcrTrainerWeightTransferEngine.trainer_init(info, client=self.calls)
        except BackendError as e:
            raise BackendError(f"{e}. Start the vLLM server with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                               f"'{{\"backend\": \"dcr\"}}' from {self.config.checkpoint!r}") from e

    def pause(self) -> None:
        """Recorded only: generation pauses around the apply inside :meth:`send_weights`."""
        self.pause_window.request()

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Diff the iterator's tensors against the last synced bits and send only what changed (module
        docstring). Raises :class:`~dcr_ray.errors.BackendError` when a server refuses (the sync is then
        abandoned everywhere) and :class:`~dcr_ray.errors.ConfigError` for tensors the checkpoint does not
        hold (nothing is sent)."""
        if self.engine is None or self.engine.owner is None:
            raise ConfigError("send_weights before init_weight_transfer() (TRL calls it at train begin), or after "
                              "destroy()")
        base = self.engine.version
        dense = _DenseCount()
        try:
            summary = self.engine.send_weights(self._pairs(iterator, dense),
                                               apply_window=self.pause_window.around_apply)
        except BackendError as e:
            raise BackendError(f"TRL weight sync {base} -> {base + 1} failed and was abandoned: {e}. "
                               f"The trainer's baseline is version {self.engine.version}; the server(s) label "
                               f"their outputs {self._labels()}, and the next sync sends every change since "
                               f"version {self.engine.version}") from e
        summary.update(dense_bytes=dense.bytes, tensors=dense.tensors,
                       pause_s=self.pause_window.last_pause_s if summary["frames"] else 0.0)
        self.syncs.append(summary)
        log.info("dcr TRL sync: version %d, %d changed elements, %d frame bytes (TRL's NCCL path: %d bytes), "
                 "paused %.3f s, %.2f s", summary["version"], summary["changed"], summary["wire_bytes"],
                 dense.bytes, summary["pause_s"], summary["seconds"])

    def resume(self) -> None:
        """The sync ended: the servers already generate again unless an apply left them paused."""
        self.pause_window.release()

    def destroy(self) -> None:
        """Release any pause left behind and drop the owner's baseline (the servers keep serving)."""
        try:
            self.pause_window.release()
        finally:
            if self.engine is not None:
                self.engine.shutdown()
                self.engine = None

    # -- helpers --------------------------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        """The version the servers serve, as the trainer knows it (None before init)."""
        return None if self.engine is None else self.engine.version

    def _pairs(self, iterator: Iterable[tuple[str, torch.Tensor]], dense: _DenseCount
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """The iterator's pairs (counted), then the checkpoint tensors it did not yield at their synced bits:
        TRL never sends frozen parameters (they never change), and neither does this sync."""
        yielded = set()
        for name, tensor in iterator:
            dense.add(tensor)
            yielded.add(name)
            yield name, tensor
        held = sorted(set(self.engine.specs) - yielded)
        if held and not self._held_logged:
            log.info("dcr TRL sync: %d checkpoint tensor(s) not sent by the trainer keep their synced bits (e.g. %s)",
                     len(held), held[:4])
            self._held_logged = True
        for name in held:
            yield name, self.engine.owner.store.tensor(name)

    def _labels(self) -> str:
        """The servers' ``/weight_info`` labels, for error messages (best effort)."""
        try:
            return str(self.calls.get_weight_version())
        except BackendError as e:
            return f"(unreadable: {e})"


__all__ = ["DcrWeightTransfer"]
