"""Engine backends: what a rollout engine actor wraps (a ``transformers`` model, vLLM, ...), and the
engine factories ``launch(engine=...)`` takes, from one namespace:

- :class:`HFEngine`: a ``transformers`` model in each engine actor (the embedded default);
- :class:`VllmEngine`: a vLLM engine in each engine actor (imported on first use: importing
  ``dcr_ray.engines`` does not import vLLM); vLLM engines dcr_ray did not start join through
  ``ClusterSpec(adopt=[AdoptedVllmEngine(...)])`` (:mod:`dcr_ray.engines.vllm`).
"""

from dcr_ray.engines.base import EngineBackend, canonical_state_dict
from dcr_ray.engines.hf import HFEngine, TransformersBackend

__all__ = ["EngineBackend", "HFEngine", "TransformersBackend", "VllmEngine", "canonical_state_dict"]


def __getattr__(name: str):
    if name == "VllmEngine":
        from dcr_ray.engines.vllm import VllmEngine

        return VllmEngine
    raise AttributeError(f"module 'dcr_ray.engines' has no attribute {name!r}")
