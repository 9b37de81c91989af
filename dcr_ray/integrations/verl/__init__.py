"""veRL integration: the ``dcr`` checkpoint-engine backend and the manager that drives it.

Switch a veRL run to dcr_ray with three lines under ``actor_rollout_ref.rollout``::

    checkpoint_engine.backend: dcr
    checkpoint_engine.custom_backend_module: dcr_ray.integrations.verl
    checkpoint_manager_class: dcr_ray.integrations.verl.DcrCheckpointEngineManager

(and start the vLLM servers with ``engine_kwargs.vllm.weight_transfer_config: {backend: dcr}`` and
``VLLM_SERVER_DEV_MODE=1``; ``docs/guide_verl.md`` has the full recipe).

How veRL's pieces map onto dcr_ray's:

=====================================  ===========================================================
veRL                                   dcr_ray
=====================================  ===========================================================
actor rank (``ActorRolloutRefWorker``)  one owner (``dcr_verl_owner:<rank>``, on the rank's node),
                                       fed by :class:`DcrCheckpointEngine` ``.send_weights``
``get_per_tensor_param_shard()``        local shards mapped into canonical coordinates on each
triples ``(name, flat, ShardSpec)``    rank, nothing gathered (:func:`shards_from_verl`; flat
                                       ranges via :mod:`dcr_ray.sharding.flat`)
rollout replica (vLLM HTTP server)     an adopted engine (:class:`~dcr_ray.engines.vllm.AdoptedVllmServer`)
                                       refit through vLLM's weight-transfer API
``CheckpointEngineManager``            :class:`DcrCheckpointEngineManager`: ``launch`` once, then one
``.update_weights``                    ``refit`` per sync, returning after the joint commit
=====================================  ===========================================================

Modules: :mod:`~dcr_ray.integrations.verl.engine` (the checkpoint engine on each trainer rank and rollout
worker), :mod:`~dcr_ray.integrations.verl.manager` (the manager: one refit per sync),
:mod:`~dcr_ray.integrations.verl.settings` (the backend's ``engine_kwargs.dcr`` settings, checked) and
:mod:`~dcr_ray.integrations.verl.shards` (veRL's weight exports as shards, no gather).

Importing this module imports veRL (``verl.checkpoint_engine``) and registers the backend.
"""

from dcr_ray.integrations.verl.engine import BACKEND, MANAGER_FQN, OWNER_PREFIX, DcrCheckpointEngine
from dcr_ray.integrations.verl.manager import (ENGINE_DRIVEN_MODE, DcrCheckpointEngineManager,
                                              report_metrics)
from dcr_ray.integrations.verl.settings import VerlDcrSettings
from dcr_ray.integrations.verl.shards import shards_from_verl

__all__ = ["BACKEND", "DcrCheckpointEngine", "DcrCheckpointEngineManager", "ENGINE_DRIVEN_MODE", "MANAGER_FQN",
           "OWNER_PREFIX", "VerlDcrSettings", "report_metrics", "shards_from_verl"]
