"""The worker-side half of the vLLM backend: :class:`DcrWorkerExtension`, run in every vLLM worker.

vLLM builds its worker class with :class:`DcrWorkerExtension` mixed in when the engine is created with
``worker_extension_cls=WORKER_EXTENSION``; the backend (:class:`~dcr_ray.engines.vllm.VllmBackend`)
reaches the methods below with ``llm.collective_rpc("dcr_...")``. All names start with ``dcr_`` so they
cannot collide with the worker's own attributes. Each method is a thin wrapper over this worker's model:
the mechanics live in :mod:`~dcr_ray.engines.vllm.groups` (fused-group reload),
:mod:`~dcr_ray.engines.vllm.capture` (loader capture) and :mod:`~dcr_ray.engines.vllm.storage`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dcr_ray.engines.vllm.capture import LoaderCapture
from dcr_ray.engines.vllm.checkpoint import iter_checkpoint
from dcr_ray.engines.vllm.groups import fused_groups, reload_groups
from dcr_ray.engines.vllm.storage import storage_digests
from dcr_ray.errors import BackendError

if TYPE_CHECKING:
    from dcr_ray.codec import DecodedItem

#: The worker extension vLLM mixes into its workers (a string: vLLM resolves it in each worker).
WORKER_EXTENSION = "dcr_ray.engines.vllm.worker.DcrWorkerExtension"


class DcrWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); called through ``collective_rpc``.

    Every method runs in each worker process (one per tensor-parallel rank) and returns plain data.
    """

    def dcr_fused_groups(self, names: list[str]) -> dict[str, Any]:
        """See :func:`~dcr_ray.engines.vllm.groups.fused_groups` (computed on this worker's model)."""
        return fused_groups(self.get_model(), names)

    def dcr_reload(self, items: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """Push whole fused groups of canonical tensors through vLLM's ``reload_weights``, then run the
        post-load steps a fresh start runs and the reload skips (fused experts, aliasing modules)."""
        return reload_groups(self.get_model(), self.vllm_config, items, reload=self.reload_weights)

    def dcr_storage_digests(self) -> dict[str, str]:
        """See :func:`~dcr_ray.engines.vllm.storage.storage_digests` (this worker's model)."""
        return storage_digests(self.get_model())

    def dcr_capture_prepare(self, files: list[str], names: list[str] | None = None) -> dict:
        """Classify the loader path of every checkpoint tensor (see :class:`LoaderCapture`).

        Must run while live storage holds the checkpoint's bits (right after start-up). Returns
        ``name -> (kind, reason)``.
        """
        from vllm.config import set_current_vllm_config

        cap = LoaderCapture(self.get_model(), context=lambda: set_current_vllm_config(self.vllm_config))
        for name, t in iter_checkpoint(files, names):
            cap.probe(name, t)
        cap.finish()
        self._dcr_capture = cap
        return cap.summary()

    def dcr_capture_apply(self, items: list[DecodedItem]) -> int:
        """Sparse XOR / OVERWRITE (and dense) writes of decoded frame items into live storage through the
        captured copies. Returns elements written."""
        cap = getattr(self, "_dcr_capture", None)
        if cap is None:
            raise BackendError("dcr_capture_apply before dcr_capture_prepare")
        n = cap.apply(items)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return n

    def dcr_capture_readback(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Canonical tensors as live storage holds them (CPU copies; for checks)."""
        cap = getattr(self, "_dcr_capture", None)
        if cap is None:
            raise BackendError("dcr_capture_readback before dcr_capture_prepare")
        return {n: cap.readback(n) for n in names}
