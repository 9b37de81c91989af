"""Engine backends: what a rollout engine actor wraps (a ``transformers`` model, vLLM, ...)."""

from dcr_ray.engines.base import EngineBackend, canonical_state_dict
from dcr_ray.engines.hf import TransformersBackend

__all__ = ["EngineBackend", "TransformersBackend", "canonical_state_dict"]
