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

Modules and subpackages:

- :mod:`~dcr_ray.launcher`     :func:`launch`: a topology started, checked before anything is spawned
- :mod:`~dcr_ray.api`          the :class:`Refit` handle of a running topology
- :mod:`~dcr_ray.config`       the settings (:class:`RefitConfig` and its groups, :class:`ClusterSpec`)
- :mod:`~dcr_ray.report`       what a refit returns (:class:`RefitReport`)
- :mod:`~dcr_ray.errors`       the error tree (:class:`DcrError`)
- :mod:`~dcr_ray.status`       ``dcr-ray status``: a running topology, read from its coordinator
- :mod:`~dcr_ray.cli`          the ``dcr-ray`` command line (``bench``, ``status``, ``chaos``)
- :mod:`~dcr_ray.metrics`      every metric, exported through Ray's metrics agent
- :mod:`~dcr_ray.heap`         the heap's free pages back to the OS once a process's part of a refit is done
- :mod:`~dcr_ray.progress`     progress bars for launch and refits on the driver's terminal
- :mod:`~dcr_ray.refit_call`   the Ray task that answers ``refit.remote()``, also when the coordinator is gone
- :mod:`~dcr_ray.options`      names and Ray options of every actor
- :mod:`~dcr_ray.named_actors` a topology's actors and placement groups, found and removed by name
- :mod:`~dcr_ray.start_clock`  where each actor's start-up time goes
- :mod:`~dcr_ray.lazy`         packages whose names are imported on first use
- :mod:`~dcr_ray.actors`       the Ray actors by role: coordinator, owner, engine, fleet, recovery
- :mod:`~dcr_ray.codec`        diff, frames, apply, baselines
- :mod:`~dcr_ray.relay`        the transports: relay trees of Ray actors, object storage
- :mod:`~dcr_ray.engines`      engine backends: ``transformers`` and vLLM
- :mod:`~dcr_ray.sharding`     trainer shards (DTensors, fused layouts, flat ranges) as owners, no gather
- :mod:`~dcr_ray.failpoints`   named failpoints at every step of the protocol
- :mod:`~dcr_ray.integrations` veRL, OpenRLHF, TRL and vLLM's trainer side
- :mod:`~dcr_ray.prefork`      Ray workers forked from a server that imported torch once (opt-in)
- :mod:`~dcr_ray.testing`      tools for tests, benchmarks and drills
"""

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: Public name -> the module that defines it. Imported on first use (PEP 562), so a process that needs
#: one submodule (an engine or relay actor, a Ray task reading a commit record) does not import them all.
_EXPORTS = {
    "ClusterSpec": "dcr_ray.config", "CodecConfig": "dcr_ray.config", "CommitConfig": "dcr_ray.config",
    "EngineConfig": "dcr_ray.config", "OwnerConfig": "dcr_ray.config", "RefitConfig": "dcr_ray.config",
    "TransportConfig": "dcr_ray.config",
    "DcrError": "dcr_ray.errors", "RefitError": "dcr_ray.errors",
    "DeltaOwner": "dcr_ray.actors.owner.delta", "owned_names": "dcr_ray.actors.owner.delta",
    "Owner": "dcr_ray.actors.owner.held", "OwnerMixin": "dcr_ray.actors.owner.held",
    "StandaloneOwner": "dcr_ray.actors.owner.held",
    "Refit": "dcr_ray.api", "launch": "dcr_ray.launcher",
    "HFEngine": "dcr_ray.engines",
    "checkpoint_state_dict": "dcr_ray.engines.base",
    "RefitReport": "dcr_ray.report",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dcr_ray' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # what static tools see
    from dcr_ray.actors.owner.held import Owner, OwnerMixin, StandaloneOwner
    from dcr_ray.actors.owner.delta import DeltaOwner, owned_names
    from dcr_ray.api import Refit
    from dcr_ray.config import (ClusterSpec, CodecConfig, CommitConfig, EngineConfig, OwnerConfig, RefitConfig,
                                TransportConfig)
    from dcr_ray.engines import HFEngine
    from dcr_ray.engines.base import checkpoint_state_dict
    from dcr_ray.errors import DcrError, RefitError
    from dcr_ray.launcher import launch
    from dcr_ray.report import RefitReport
