"""Engine backends: what a rollout engine actor wraps (a ``transformers`` model, vLLM, ...), and the
engine factories ``launch(engine=...)`` takes, from one namespace:

- :class:`HFEngine`: a ``transformers`` model in each engine actor (the embedded default);
- :class:`VllmEngine`: a vLLM engine in each engine actor (imported on first use: importing
  ``dcr_ray.engines`` does not import vLLM); vLLM engines dcr_ray did not start join through
  ``ClusterSpec(adopt=[AdoptedVllmEngine(...)])`` (:mod:`dcr_ray.engines.vllm`).
"""

from typing import TYPE_CHECKING

from dcr_ray.lazy import exports

#: Public name -> the submodule that defines it, imported on first use (vLLM, transformers and torch only
#: where an engine is built).
_EXPORTS = {"EngineBackend": "base", "canonical_state_dict": "base", "HFEngine": "hf", "TransformersBackend": "hf",
            "VllmEngine": "vllm"}
__all__ = ["EngineBackend", "HFEngine", "TransformersBackend", "VllmEngine", "canonical_state_dict"]
__getattr__, __dir__ = exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what static tools see
    from dcr_ray.engines.base import EngineBackend, canonical_state_dict
    from dcr_ray.engines.hf import HFEngine, TransformersBackend
    from dcr_ray.engines.vllm import VllmEngine
