"""The engine factory engine actors call: one :class:`~dcr_ray.engines.vllm.VllmBackend` each."""

from __future__ import annotations

from dcr_ray.engines.vllm.backend import VllmBackend


class VllmEngine:
    """Engine factory: a :class:`VllmBackend` in each engine actor.

    ``model`` is a checkpoint directory visible to the engine's node, or a
    :class:`~dcr_ray.models.ModelSpec`, in which case each engine builds that model (with ``seed`` if
    given: the initial bits do not matter, the dense bootstrap replaces them) and writes it to a
    private temporary checkpoint before starting vLLM. ``backend_kwargs`` go to :class:`VllmBackend`.
    """

    def __init__(self, model, *, seed: int | None = None, **backend_kwargs):
        self.model = model
        self.seed = seed
        self.backend_kwargs = backend_kwargs

    def __call__(self) -> VllmBackend:
        directory = self.model
        if not isinstance(directory, str):
            import tempfile
            from dataclasses import replace

            from dcr_ray.models import build_model, save_checkpoint

            spec = self.model if self.seed is None else replace(self.model, seed=self.seed)
            directory = save_checkpoint(build_model(spec), tempfile.mkdtemp(prefix="dcr_vllm_ckpt_"))
        return VllmBackend(directory, **self.backend_kwargs)
