"""The ``dcr`` checkpoint engine: registered in veRL's ``CheckpointEngineRegistry``, one per trainer rank.

veRL builds it on every actor rank (``CheckpointEngineRegistry.new("dcr", is_master=..., bucket_size=...,
**engine_kwargs.dcr)``) and on every rollout worker. Its part of the protocol, as
:class:`~dcr_ray.integrations.verl.manager.DcrCheckpointEngineManager` drives it:

``prepare()``
    this rank's identity (rank, world size, Ray node); spawns nothing.
``init_process_group(rank, world_size, names, master_metadata=None)``
    finds or creates this rank's dcr_ray owner actor (``dcr_verl_owner:<rank>`` in namespace ``dcr_ray``,
    on this rank's node, no CPU reserved) and returns its handle; ``names`` are the tensors the rollout
    checkpoint holds. No process group is formed: payloads travel through dcr_ray's transport, so
    ``master_metadata`` (the broadcast source's endpoint in veRL's other backends) is accepted and not
    needed. ``rank=-1`` is veRL's "this rank sits the transfer out": no owner, and its ``send_weights``
    sends nothing (every tensor must then be held by a rank that takes part).
``send_weights(engine_or_weights, global_steps)``
    reads this rank's export — the training engine's ``get_per_tensor_param_shard()`` triples when veRL
    hands over the engine (the manager asks for that path), else the pairs or triples it is given — maps
    each local shard into canonical coordinates (:mod:`~dcr_ray.integrations.verl.shards`, no gather) and
    hands the shards to the owner, which diffs them against the last committed bits at the next refit.
``receive_weights`` / ``build_topology``
    not used: engines are refit by dcr_ray's coordinator through vLLM's weight-transfer API, so both
    raise :class:`NotDrivenHereError` (a :class:`~dcr_ray.errors.ConfigError` and the interface's own
    ``NotImplementedError``) telling to set ``checkpoint_manager_class``. ``receive_weights`` is an
    async generator, as veRL's rollout workers iterate it (``async for``): the error is raised at the
    first item, on the rollout worker, with that advice.
``finalize()``
    nothing to free: the owner keeps the committed baseline between steps.

The owner runs in its own actor (the coordinator calls ``dcr_*`` methods on it, and veRL's worker class
cannot gain methods): each send copies this rank's shard once, on the node, into the owner's process.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
import torch

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from dcr_ray.actors.owner.held import StandaloneOwner
from dcr_ray.errors import ConfigError
from dcr_ray.integrations.verl.settings import VerlDcrSettings
from dcr_ray.integrations.verl.shards import shards_from_verl
from dcr_ray.options import actor_options

log = logging.getLogger(__name__)

#: The backend name in ``checkpoint_engine.backend``.
BACKEND = "dcr"
#: Owner actor names: ``OWNER_PREFIX + str(rank)`` in namespace ``dcr_ray``.
OWNER_PREFIX = "dcr_verl_owner:"
#: The ``checkpoint_manager_class`` that drives this backend.
MANAGER_FQN = "dcr_ray.integrations.verl.DcrCheckpointEngineManager"

_USE_MANAGER = (f"checkpoint_engine.backend={BACKEND!r} is driven by its own manager: set "
                f"actor_rollout_ref.rollout.checkpoint_manager_class={MANAGER_FQN}")
#: veRL's rank for an actor worker left out of the transfer group.
SITS_OUT = -1


class NotDrivenHereError(ConfigError, NotImplementedError):
    """A ``CheckpointEngine`` call that veRL's own manager makes but the ``dcr`` backend does not serve (its
    manager, :data:`MANAGER_FQN`, drives the refit): a ``ConfigError`` and the interface's
    ``NotImplementedError``."""


def _dist_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@CheckpointEngineRegistry.register(BACKEND)
class DcrCheckpointEngine(CheckpointEngine):
    """veRL checkpoint engine whose trainer side feeds a dcr_ray owner (see the module docstring).

    ``bucket_size`` / ``is_master`` are veRL's constructor arguments (unused: dcr_ray buckets frames by
    ``CodecConfig.bucket_bytes``); every other keyword is a :class:`VerlDcrSettings` key.
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False, **kwargs: Any) -> None:
        self.settings = VerlDcrSettings.from_kwargs(kwargs)
        self.is_master = is_master
        self.rank: int | None = None
        self.world_size: int | None = None
        self.names: set[str] | None = None
        self.owner = None
        self.excluded: set[str] = set()  # blocks another rank holds too and sends (replica_exclusions)
        self.sends = 0

    # -- topology ----------------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        rank, world = _dist_rank_world()
        return {"rank": rank, "world_size": world, "node_id": ray.get_runtime_context().get_node_id()}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        raise NotDrivenHereError(_USE_MANAGER)

    def init_process_group(self, rank: int, world_size: int, names: list[str] | None = None,
                           master_metadata: Any = None, num_senders: int | None = None):
        """Find or create this rank's owner actor; returns its handle (the manager attaches it), or None for
        ``rank=-1`` (this rank sits the transfer out). ``master_metadata`` and ``num_senders`` (the keys
        veRL's collective backends' topologies carry) are accepted and unused: dcr_ray forms no process
        group."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if isinstance(rank, bool) or not isinstance(rank, int) or isinstance(world_size, bool) \
                or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"init_process_group takes integer rank and world_size >= 1, got rank={rank!r}, "
                              f"world_size={world_size!r}")
        if rank == SITS_OUT:
            self.rank, self.world_size, self.owner = SITS_OUT, int(world_size), None
            return None
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} outside a world of {world_size} (use {SITS_OUT} for a rank that sits "
                              f"the transfer out)")
        self.rank, self.world_size = int(rank), int(world_size)
        self.names = set(names) if names is not None else None
        if self.owner is None:
            node = ray.get_runtime_context().get_node_id()
            opts = actor_options("owner", OWNER_PREFIX + str(rank), get_if_exists=True,
                                 scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            self.owner = ray.remote(StandaloneOwner).options(**opts).remote()
        return self.owner

    def exclude(self, keys: list[str]) -> None:
        """Leave these local keys out of every later send (a replica of them is sent by another rank)."""
        self.excluded |= set(keys)

    def finalize(self):
        """Nothing to release: the owner keeps the committed baseline for the next delta."""

    # -- trainer side ------------------------------------------------------------------------------
    async def send_weights(self, weights, global_steps: int | None = None) -> dict[str, float]:
        """Hand this rank's shards to its owner (the refit itself is the manager's, after every rank sent).

        ``weights``: veRL's training engine (its ``get_per_tensor_param_shard()`` triples are read: no
        gather), or an iterable of ``(name, local_shard, ShardSpec)`` triples or ``(name, tensor)`` pairs.
        """
        if self.rank == SITS_OUT:
            return {}  # veRL left this rank out of the transfer: another rank sends what it holds
        if self.owner is None:
            raise ConfigError(f"send_weights before init_process_group: {_USE_MANAGER}")
        t0 = time.perf_counter()
        if hasattr(weights, "get_per_tensor_param_shard"):
            items, _ = weights.get_per_tensor_param_shard()
        else:
            items = weights
        shards, dropped = shards_from_verl(items, rank=self.rank, world=self.world_size,
                                           dtype=getattr(torch, self.settings.dtype), names=self.names)
        shards = {k: v for k, v in shards.items() if k not in self.excluded}
        await self.owner.set_tensors.remote(shards)
        self.sends += 1
        elems = sum(v.tensor.numel() if hasattr(v, "spec") else v.numel() for v in shards.values())
        log.info("rank %d: %d local tensors (%d elements) handed to its dcr_ray owner for step %s in %.3f s",
                 self.rank, len(shards), elems, global_steps, time.perf_counter() - t0)
        return {"checkpoint_engine/dcr_local_elems": float(elems),
                "checkpoint_engine/dcr_dropped_tensors": float(len(dropped))}

    # -- rollout side ------------------------------------------------------------------------------
    async def receive_weights(self, global_steps: int | None = None):
        """An async generator, as veRL's interface says; it raises :class:`NotDrivenHereError` at the first
        item (rollout engines are refit by dcr_ray's coordinator, never through this path)."""
        raise NotDrivenHereError(_USE_MANAGER + " (rollout engines are refit by dcr_ray's coordinator through "
                                 "vLLM's weight-transfer API, not through receive_weights)")
        yield  # unreachable: makes this an async generator


__all__ = ["BACKEND", "DcrCheckpointEngine", "MANAGER_FQN", "NotDrivenHereError", "OWNER_PREFIX", "SITS_OUT"]
