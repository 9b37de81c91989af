"""OpenRLHF's vLLM rollout engines as dcr_ray engines: start them with the ``dcr`` backend, then adopt them.

OpenRLHF 0.11 starts its engines in :func:`openrlhf.trainer.ray.vllm_engine.create_vllm_engines` as
``RolloutRayActor`` actors (an ``AsyncLLM`` inside, OpenRLHF's ``WorkerWrap`` mixed into every vLLM
worker). Two things keep them from being refit by dcr_ray as they are:

* vLLM builds a worker's weight-transfer engine only when the engine is started with
  ``weight_transfer_config``; ``create_vllm_engines`` has no parameter for it.
* ``RolloutRayActor`` exposes OpenRLHF's per-parameter calls (``update_weight``,
  ``update_weight_cuda_ipc``) but not vLLM's weight-transfer calls, and its ``reset_prefix_cache``
  returns nothing, so a caller cannot tell whether the cache was dropped.

:class:`DcrRolloutRayActor` is OpenRLHF's own ``RolloutRayActor`` (subclassed, nothing of it
replaced) plus exactly those: ``weight_transfer_config={"backend": "dcr"}`` at start, the five
weight-transfer calls forwarded to its ``AsyncLLM``, and ``reset_prefix_cache`` returning vLLM's
answer. :func:`create_vllm_engines` runs OpenRLHF's ``create_vllm_engines`` unchanged (placement
groups, bundles, seeds, ``WorkerWrap``, sleep mode) with this class in place of ``RolloutRayActor``;
:func:`adopt_vllm_engines` turns the handles into
:class:`~dcr_ray.engines.vllm.AdoptedVllmEngine` factories for ``ClusterSpec(adopt=[...])``.

The engines keep serving OpenRLHF's generation calls (``generate``, ``generate_responses``,
``pause_generation``, ``resume_generation``, ``sleep``, ``wake_up``) exactly as before; OpenRLHF's NCCL
/ CUDA-IPC weight sync still works on them too (``WorkerWrap`` stays mixed in), it is just not called.

Importing this module imports OpenRLHF's ``vllm_engine`` module and so vLLM.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import ray

from openrlhf.trainer.ray import vllm_engine as _openrlhf_vllm_engine

from dcr_ray.engines.vllm import AdoptedVllmEngine
from dcr_ray.errors import ConfigError

log = logging.getLogger(__name__)

#: The vLLM weight-transfer backend dcr_ray registers through its vLLM plugin entry point.
DCR_WEIGHT_TRANSFER = {"backend": "dcr"}


class DcrRolloutRayActor(_openrlhf_vllm_engine.RolloutRayActor.__ray_actor_class__):
    """OpenRLHF's ``RolloutRayActor`` started with the ``dcr`` weight-transfer backend and exposing
    vLLM's weight-transfer calls (what :class:`~dcr_ray.engines.vllm.AdoptedVllmEngine` drives).

    Every argument is OpenRLHF's; ``weight_transfer_config`` defaults to ``{"backend": "dcr"}``.
    """

    async def __init__(self, *args, **kwargs):
        kwargs.setdefault("weight_transfer_config", dict(DCR_WEIGHT_TRANSFER))
        await super().__init__(*args, **kwargs)

    # -- vLLM's weight-transfer API on the AsyncLLM inside (runs in every worker via collective_rpc) --
    async def init_weight_transfer_engine(self, request: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(**request))

    async def start_weight_update(self) -> None:
        await self.llm.start_weight_update()

    async def update_weights(self, request: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.llm.update_weights(WeightTransferUpdateRequest(**request))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.llm.finish_weight_update(weight_version)

    async def update_weight_version(self, weight_version: str) -> None:
        await self.llm.update_weight_version(weight_version)

    async def get_weight_version(self) -> str:
        return await self.llm.get_weight_version()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """OpenRLHF's call, returning whether vLLM dropped the cache (OpenRLHF's caller ignores the value);
        ``reset_running_requests``: preempt the running requests first, as vLLM's own call does.

        While generation is paused (async mode's partial rollouts: ``pause_generation`` keeps requests),
        the kept requests still hold KV blocks the old weights computed, and vLLM refuses to reset then.
        So a paused engine resets with ``reset_running_requests=True``: vLLM preempts the kept requests
        and recomputes their KV with the new weights when generation resumes (tokens already generated
        stay). No request continues on stale KV; OpenRLHF's NCCL path leaves it in place.
        """
        paused = bool(await self.llm.is_paused())
        return bool(await self.llm.reset_prefix_cache(reset_running_requests=reset_running_requests or paused))

    async def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        """vLLM's ``collective_rpc`` on the AsyncLLM inside (the adopted proxy reads each worker's
        ``dcr_transfer_status`` through it)."""
        return await self.llm.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)

    async def dcr_storage_digests(self) -> list[dict[str, str]]:
        """Per vLLM worker: parameter/buffer name (and ``probe:<linear layer>``) -> digest of the bits it serves
        with (for checks: two engines serving the same weights give equal digests; see
        :func:`~dcr_ray.engines.vllm.worker.served.served_fingerprint`)."""
        return await self.llm.collective_rpc(_served_storage_digests)


def _served_storage_digests(worker) -> dict[str, str]:
    """Runs inside a vLLM worker (sent by ``collective_rpc``; OpenRLHF's actor allows pickled callables)."""
    from dcr_ray.engines.vllm.worker.served import served_fingerprint

    return served_fingerprint(worker.get_model())


#: The Ray actor class (what ``create_vllm_engines`` instantiates in place of ``RolloutRayActor``).
DcrRolloutRayActorRemote = ray.remote(DcrRolloutRayActor)


class _WithDcr:
    """Stands in for OpenRLHF's ``RolloutRayActor`` while its ``create_vllm_engines`` runs: the same
    ``.options(...).remote(**kwargs)`` calls, made on :class:`DcrRolloutRayActor` with the extras added."""

    def __init__(self, engine_kwargs: dict, actor_options: dict):
        self.engine_kwargs, self.actor_options = engine_kwargs, actor_options

    def options(self, **options):
        cls = DcrRolloutRayActorRemote.options(**{**options, **self.actor_options})
        extra = self.engine_kwargs
        return type("_Options", (), {"remote": staticmethod(lambda *a, **kw: cls.remote(*a, **{**kw, **extra}))})()


def create_vllm_engines(*args, engine_kwargs: dict | None = None, actor_options: dict | None = None,
                        **kwargs) -> list:
    """OpenRLHF's ``create_vllm_engines`` (same arguments, same placement), with engines that dcr_ray can
    refit: :class:`DcrRolloutRayActor` instead of ``RolloutRayActor``.

    ``engine_kwargs``: extra vLLM engine arguments for every engine, beyond the fixed set OpenRLHF passes
    (e.g. ``{"weight_transfer_config": {...}}`` to override the default ``{"backend": "dcr"}``).
    ``actor_options``: extra Ray options for every engine actor, merged over OpenRLHF's (e.g. a
    ``runtime_env``). OpenRLHF looks the actor class up as a module global at call time, so it is swapped
    for the length of this call only (the driver calls this once, before training). OpenRLHF places
    every engine on a ``{"GPU": 1, "CPU": 1}`` bundle, so the Ray cluster needs GPU resources.
    """
    original = _openrlhf_vllm_engine.RolloutRayActor
    _openrlhf_vllm_engine.RolloutRayActor = _WithDcr(dict(engine_kwargs or {}), dict(actor_options or {}))
    try:
        return _openrlhf_vllm_engine.create_vllm_engines(*args, **kwargs)
    finally:
        _openrlhf_vllm_engine.RolloutRayActor = original


def adopt_vllm_engines(vllm_engines: Sequence[Any], *, checkpoint: str, version: int = 0,
                       timeout_s: float = 300.0) -> list[AdoptedVllmEngine]:
    """One :class:`~dcr_ray.engines.vllm.AdoptedVllmEngine` per OpenRLHF engine handle, for
    ``dcr_ray.ClusterSpec(adopt=...)``.

    ``checkpoint``: the directory the engines were started from (OpenRLHF's ``--pretrain``), readable by
    the proxies dcr_ray starts and by the engines' workers. Handles must come from
    :func:`create_vllm_engines` (or :class:`DcrRolloutRayActor`): plain ``RolloutRayActor`` engines
    have no weight-transfer engine and are refused here, before anything starts.
    """
    handles = list(vllm_engines or [])
    if not handles:
        raise ConfigError("adopt_vllm_engines needs OpenRLHF's vLLM engine handles (create_vllm_engines(...))")
    plain = [i for i, h in enumerate(handles) if not hasattr(h, "update_weights")]
    if plain:
        raise ConfigError(f"vLLM engines {plain} are plain OpenRLHF RolloutRayActor actors, started without the dcr "
                          "weight-transfer backend: create them with "
                          "dcr_ray.integrations.openrlhf.create_vllm_engines(...) (same arguments as OpenRLHF's)")
    return [AdoptedVllmEngine(h, checkpoint=checkpoint, version=version, timeout_s=timeout_s) for h in handles]


__all__ = ["DCR_WEIGHT_TRANSFER", "DcrRolloutRayActor", "DcrRolloutRayActorRemote", "adopt_vllm_engines",
           "create_vllm_engines"]
