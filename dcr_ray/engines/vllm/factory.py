"""The engine factory engine actors call: one :class:`~dcr_ray.engines.vllm.VllmBackend` each."""

from __future__ import annotations

from typing import Callable

import torch

from dcr_ray.engines.vllm.backend import VllmBackend


class VllmEngine:
    """Engine factory: a :class:`VllmBackend` in each engine actor.

    ``model`` is a checkpoint directory visible to the engine's node, or a picklable zero-argument
    callable that returns a ``transformers`` model (e.g. :class:`dcr_ray.testing.models.ModelSpec`);
    each engine then builds it and writes it to a private temporary checkpoint before starting vLLM
    (its initial bits do not matter: the dense bootstrap replaces them). ``backend_kwargs`` go to
    :class:`VllmBackend`.
    """

    def __init__(self, model: str | Callable[[], torch.nn.Module], **backend_kwargs):
        self.model = model
        self.backend_kwargs = backend_kwargs

    def __call__(self) -> VllmBackend:
        directory = self.model
        if not isinstance(directory, str):
            import tempfile

            directory = tempfile.mkdtemp(prefix="dcr_vllm_ckpt_")
            self.model().save_pretrained(directory, safe_serialization=True)
        return VllmBackend(directory, **self.backend_kwargs)
