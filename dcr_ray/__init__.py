"""dcr_ray: delta-compressed, bit-exact refits from trainer shards to rollout engines on Ray.

Entry points:

- :func:`launch` / :class:`Refit` - start a topology and run ``refit.remote()``
- :class:`RefitConfig`, :class:`ClusterSpec` - configuration
- :class:`OwnerMixin`, :func:`owned_names` - make an existing trainer actor an owner
- :class:`HFEngine` - the default engine (a ``transformers`` model in each engine actor)
- :mod:`dcr_ray.codec` - the codec (diff, frames, apply, baselines)
- :class:`DcrError` and subclasses in :mod:`dcr_ray.errors`
"""

from dcr_ray.actors.owner import DeltaOwner, OwnerMixin, StandaloneOwner, owned_names
from dcr_ray.api import HFEngine, Refit, launch
from dcr_ray.config import ClusterSpec, RefitConfig
from dcr_ray.errors import DcrError, RefitError
from dcr_ray.models import ModelSpec, build_model
from dcr_ray.report import RefitReport

__version__ = "0.1.0"
__all__ = [
    "ClusterSpec", "DcrError", "DeltaOwner", "HFEngine", "ModelSpec", "OwnerMixin", "Refit", "RefitConfig",
    "RefitError", "RefitReport", "StandaloneOwner", "build_model", "launch", "owned_names",
]
