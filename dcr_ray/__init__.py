"""dcr_ray: delta-compressed, bit-exact refits from trainer shards to rollout engines on Ray.

Entry points:

- :func:`launch` / :class:`Refit` - start a topology and run ``refit.remote()``
- :class:`RefitConfig` (grouped: :class:`CodecConfig`, :class:`TransportConfig`, :class:`CommitConfig`,
  :class:`EngineConfig`, :class:`OwnerConfig`), :class:`ClusterSpec` - configuration
- :class:`Owner` (held by a trainer actor), :class:`OwnerMixin`, :func:`owned_names`,
  :func:`checkpoint_state_dict` - make an existing trainer actor an owner
- :class:`HFEngine` - the embedded engine (a ``transformers`` model in each engine actor); vLLM engines,
  started or adopted, in :mod:`dcr_ray.engines.vllm`
- :mod:`dcr_ray.codec` - the codec (diff, frames, apply, baselines)
- :class:`DcrError` and subclasses in :mod:`dcr_ray.errors`

Toy models, a toy trainer, link emulation and fault injection for tests and examples live in
:mod:`dcr_ray.testing`, which the library itself never imports.
"""

from dcr_ray.actors.owner import DeltaOwner, owned_names
from dcr_ray.actors.held_owner import Owner, OwnerMixin, StandaloneOwner
from dcr_ray.api import Refit, launch
from dcr_ray.engines import HFEngine
from dcr_ray.config import (
    ClusterSpec,
    CodecConfig,
    CommitConfig,
    EngineConfig,
    OwnerConfig,
    RefitConfig,
    TransportConfig,
)
from dcr_ray.engines.base import checkpoint_state_dict
from dcr_ray.errors import DcrError, RefitError
from dcr_ray.report import RefitReport

__version__ = "0.1.0"
__all__ = [
    "ClusterSpec", "CodecConfig", "CommitConfig", "DcrError", "DeltaOwner", "EngineConfig", "HFEngine",
    "Owner", "OwnerConfig", "OwnerMixin", "Refit", "RefitConfig", "RefitError", "RefitReport", "StandaloneOwner",
    "TransportConfig", "checkpoint_state_dict", "launch", "owned_names",
]
