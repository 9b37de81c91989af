"""Engine backends: what a rollout engine actor wraps (a ``transformers`` model, vLLM, ...), and the
engine factories ``launch(engine=...)`` takes, from one namespace:

- :class:`HFEngine`: a ``transformers`` model in each engine actor (the embedded default);
- :class:`VllmEngine`: a vLLM engine in each engine actor (imported on first use: importing
  ``dcr_ray.engines`` does not import vLLM); vLLM engines dcr_ray did not start join through
  ``ClusterSpec(adopt=[AdoptedVllmEngine(...)])`` (:mod:`dcr_ray.engines.vllm`).

Modules:

- :mod:`~dcr_ray.engines.base`     the backend contract (:class:`EngineBackend`): canonical tensors in, validated
  frames applied, ``flush`` leaves what a dense load gives; :func:`~dcr_ray.checkpoint_state_dict`
- :mod:`~dcr_ray.engines.hf`       the embedded default: a ``transformers`` model, frames written in place
- :mod:`~dcr_ray.engines.sampling` how an engine samples its rollouts (one value object every backend reads)
- :mod:`~dcr_ray.engines.steps`    decoding steps and the version each reads: the gate an in-flight switch
  waits at, and the version spans every answer carries
- :mod:`~dcr_ray.engines.vllm`     vLLM engines, started by dcr_ray or adopted
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
