"""``DcrCheckpointEngineManager``: veRL's ``CheckpointEngineManager`` with a dcr_ray refit inside.

veRL's own manager forms one collective group of trainer ranks and rollout workers per sync and streams
weights through it. This subclass keeps veRL's replica handling (``abort_replicas``, waking replicas
``sleep_replicas`` put to sleep, ``release_kv_cache_replicas`` before; ``resume_kv_cache_replicas`` and
``resume_generation_replicas`` after) and replaces the middle with dcr_ray's protocol::

    update_weights(global_steps)
      abort_replicas()                                   veRL's own: requests paused, prefix caches kept
      wake_up_replicas()                                 veRL's own, if sleep_replicas() put them to sleep
                                                         (HYBRID / COLOCATED: the trainer sleeps them before
                                                         training and relies on update_weights to wake them)
      release_kv_cache_replicas()                        veRL's own (settings.release_kv_cache)
      first call: execute_checkpoint_engine("prepare")   rank identities (nothing spawned)
                  execute_checkpoint_engine("init_process_group", rank, world, names)
                                                         each rank's owner actor, on its node
      actor_wg.update_weights(mode="delta_sharded")      veRL's engine-driven path: each rank's dcr engine
                                                         reads get_per_tensor_param_shard() (no gather)
                                                         and hands its shards to its owner
      first call: blocks several ranks declared identically keep one owner (replica_exclusions: DTensors
                  on sub-meshes, e.g. FSDP inside a tensor-parallel grid, do not name their replicas)
                  dcr_ray.launch(owners, clusters=[ClusterSpec(adopt=[AdoptedVllmServer(replica URL)])])
                  servers that already hold the trainer's bits join by digest, others get a dense refit
      later:      replicas whose served weights a sleep or release may have dropped (veRL 0.9.1 sleeps
                  HYBRID replicas at level 2, and releases KV cache with a level-2 sleep: on GPU both
                  discard the weights) show by digest that they still serve the committed bits (their
                  workers digest what they serve, nothing is written); one that does not is invalidated
                  (Refit.invalidate) and repaired densely from the owners before the delta is sent (what
                  veRL's naive backend sends every time; keep the weights with release_kv_cache: false /
                  rollout.free_cache_engine: false to avoid it)
                  refit.remote()                         owners diff + stream XOR/OVERWRITE frames through
                                                         the relay tree (one crossing per cluster); engines
                                                         validate, apply, ACK; the commit record is written
                                                         only when every required engine holds every
                                                         payload; owners then promote their baseline
      resume_kv_cache_replicas(); resume_generation_replicas()     veRL's own, even when the sync failed

``mode="delta_sharded"`` is the worker's switch for "the checkpoint engine drives the training engine
itself" (veRL's ``ActorRolloutRefWorker.update_weights`` hands ``self.actor.engine`` to ``send_weights``
for it); the ``dcr`` engine built from the config is the one called. Retries (OVERWRITE of the whole
changed set), dead or hung engines and the joint commit are the coordinator's, unchanged.

The rollout side is veRL's vLLM servers, adopted by URL (``replica.server_address``); they must run with
vLLM's weight-transfer backend ``dcr`` and ``VLLM_SERVER_DEV_MODE=1`` (see ``docs/guide_verl.md``).
``add_replicas`` / ``remove_replicas`` take effect at the next ``update_weights``: the topology is
relaunched (owners re-attach; unchanged servers join by digest when they hold the bits, else densely).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from verl.checkpoint_engine.base import CheckpointEngineManager
from verl.utils.ray_utils import auto_await

import dcr_ray
from dcr_ray.errors import ConfigError
from dcr_ray.integrations.verl.engine import BACKEND
from dcr_ray.integrations.verl.settings import VerlDcrSettings
from dcr_ray.integrations.verl.shards import declared_boxes, replica_exclusions

log = logging.getLogger(__name__)

#: The worker's ``update_weights(mode=...)`` value that hands the training engine to ``send_weights``.
ENGINE_DRIVEN_MODE = "delta_sharded"
#: The default cluster name when ``engine_kwargs.dcr.clusters`` is not given.
DEFAULT_CLUSTER = "rollout"


class DcrCheckpointEngineManager(CheckpointEngineManager):
    """veRL's checkpoint-engine manager, refitting its vLLM replicas with dcr_ray (module docstring).

    Arguments are veRL's: ``config`` (``rollout.checkpoint_engine``, whose ``backend`` must be ``dcr``),
    ``actor_wg`` (the actor worker group), ``replicas`` (the rollout replicas).
    """

    def __init__(self, config, actor_wg, replicas) -> None:
        if getattr(config, "backend", None) != BACKEND:
            raise ConfigError(f"DcrCheckpointEngineManager drives checkpoint_engine.backend={BACKEND!r}, the config "
                              f"names {getattr(config, 'backend', None)!r}: set backend: {BACKEND} and "
                              f"custom_backend_module: dcr_ray.integrations.verl")
        kwargs = dict(getattr(config, "engine_kwargs", None) or {})
        self.settings = VerlDcrSettings.from_kwargs(kwargs.get(BACKEND))
        super().__init__(config, actor_wg, list(replicas))
        self.refit: dcr_ray.Refit | None = None
        self.owners: dict[str, Any] | None = None
        self._stale = False
        self._asleep = False  # sleep_replicas() ran and nothing woke them since
        self._engine_of: dict[int, str] = {}  # replica rank -> its adopted engine id

    # -- topology ----------------------------------------------------------------------------------
    def _checkpoint(self) -> str:
        ckpt = self.settings.checkpoint
        if ckpt is None and self.replicas:
            ckpt = getattr(getattr(self.replicas[0], "model_config", None), "local_path", None)
        if not ckpt:
            raise ConfigError("the rollout checkpoint directory is unknown: set checkpoint_engine.engine_kwargs.dcr."
                              "checkpoint to the directory the vLLM servers were started from")
        return ckpt

    def clusters(self, checkpoint: str) -> list[dcr_ray.ClusterSpec]:
        from dcr_ray.engines.vllm import AdoptedVllmServer

        by_rank = {int(getattr(r, "replica_rank", i)): r for i, r in enumerate(self.replicas)}
        layout = self.settings.clusters or {DEFAULT_CLUSTER: sorted(by_rank)}
        missing = sorted(set(by_rank) - {r for ranks in layout.values() for r in ranks})
        unknown = sorted({r for ranks in layout.values() for r in ranks} - set(by_rank))
        if missing or unknown:
            raise ConfigError(f"engine_kwargs.dcr.clusters must list every rollout replica once: missing {missing}, "
                              f"no such replica {unknown}")
        out = []
        for name, ranks in layout.items():
            adopt = []
            for r in ranks:
                addr = by_rank[r].server_address
                if not addr:
                    raise ConfigError(f"rollout replica {r} has no server address yet: launch its servers first")
                self._engine_of[r] = f"{name}/a{len(adopt)}"  # dcr_ray's id of the i-th adopted engine
                adopt.append(AdoptedVllmServer(f"http://{addr}", checkpoint=checkpoint,
                                               timeout_s=self.settings.timeout_s))
            out.append(dcr_ray.ClusterSpec(name=name, adopt=adopt))
        return out

    def build_process_group(self, rollout=None) -> dict[str, Any]:
        """Give every trainer rank its owner actor (idempotent); returns owner id -> handle."""
        from dcr_ray.engines.vllm.checkpoint import checkpoint_specs

        wg = self.actor_wg
        n = wg.world_size
        meta = ray.get(wg.execute_checkpoint_engine(["prepare"] * n))
        ranks = [int(m["rank"]) for m in meta]
        if sorted(ranks) != list(range(n)):
            raise ConfigError(f"the actor ranks report torch.distributed ranks {ranks}, expected 0..{n - 1}")
        names = sorted(checkpoint_specs(self._checkpoint()))
        handles = ray.get(wg.execute_checkpoint_engine(["init_process_group"] * n, rank=ranks, world_size=[n] * n,
                                                       names=[names] * n))
        self.owners = {f"rank{r}": h for r, h in zip(ranks, handles)}
        return self.owners

    def _dedupe_replicas(self) -> int:
        """After the first send: blocks several ranks declared identically (DTensors on sub-meshes, whose
        specs do not name their replicas) keep one owner; the others drop them now and in every later send.
        Returns how many local blocks were dropped."""
        handles = list(self.owners.values())
        per_rank = ray.get([h.__ray_call__.remote(_owner_boxes) for h in handles])
        drop = replica_exclusions(per_rank)
        n = len(self.owners)
        ray.get(self.actor_wg.execute_checkpoint_engine(["exclude"] * n, keys=[sorted(d) for d in drop]))
        ray.get([h.__ray_call__.remote(_owner_drop, sorted(d)) for h, d in zip(handles, drop)])
        return sum(len(d) for d in drop)

    def add_replicas(self, replicas) -> None:
        super().add_replicas(replicas)
        self._stale = True

    def remove_replicas(self, replicas) -> None:
        super().remove_replicas(replicas)
        self._stale = True

    @auto_await
    async def sleep_replicas(self):
        """veRL's: put every replica to sleep (HYBRID / COLOCATED free weights and KV cache); the next
        :meth:`update_weights` wakes them."""
        await super().sleep_replicas()
        self._asleep = True

    @auto_await
    async def wake_up_replicas(self):
        """veRL's: wake every replica (weights and KV cache)."""
        await super().wake_up_replicas()
        self._asleep = False

    def dropped_engines(self, slept: bool, released: bool) -> list[str]:
        """Engine ids of the replicas whose served weights the sleep / KV release may have discarded, by what
        veRL 0.9.1's vLLM servers do: nothing without ``free_cache_engine``; COLOCATED sleeps at level 1
        (weights offloaded, kept) and skips the release; HYBRID sleeps and releases at level 2 (weights
        discarded on GPU); STANDALONE skips the sleep but releases at level 2."""
        out = []
        for i, r in enumerate(self.replicas):
            if getattr(getattr(r, "config", None), "free_cache_engine", True) is False:
                continue
            mode = str(getattr(getattr(r, "rollout_mode", None), "value", getattr(r, "rollout_mode", "")) or "")
            if mode == "colocated":
                continue
            if (released or (slept and mode != "standalone")) and \
                    int(getattr(r, "replica_rank", i)) in self._engine_of:
                out.append(self._engine_of[int(getattr(r, "replica_rank", i))])
        return out

    def _verify(self, engine_ids: list[str]) -> int:
        """Each engine in ``engine_ids`` must still serve the committed version: its proxy has the server's
        workers digest what they serve against the owners' committed box digests (the check a joining
        engine passes; nothing is written). Those whose bits are gone are invalidated and repaired densely
        from the owners (``Refit.invalidate``) before any delta is sent; returns how many."""
        if not engine_ids:
            return 0
        status = self.refit.status()
        version, record = status["version"], status.get("commit_record") or {}
        digests: dict = {}
        for d in ray.get([h.dcr_digests.remote() for h in self.owners.values()], timeout=self.settings.timeout_s):
            digests.update(d)
        engines = self.refit.engines()
        held = ray.get([engines[e].join_by_digest.remote(version, digests, record.get("transfer"))
                        for e in engine_ids], timeout=self.settings.timeout_s)
        lost = [e for e, ok in zip(engine_ids, held) if not ok]
        for e in lost:
            log.warning("dcr_ray: rollout engine %s no longer serves the committed version %d after veRL's sleep / "
                        "KV-cache release (veRL 0.9.1 does both with a level-2 vLLM sleep, which discards the "
                        "weights on GPU): repairing it densely from the trainer. Keep the weights to avoid this: "
                        "checkpoint_engine.engine_kwargs.dcr.release_kv_cache: false and, for HYBRID replicas, "
                        "rollout.free_cache_engine: false", e, version)
            self.refit.invalidate(e, f"its served weights were discarded (veRL sleep / KV-cache release); "
                                     f"digests differ from version {version}")
        return len(lost)

    def shutdown(self) -> None:
        """Stop the dcr_ray topology (coordinator, proxies, relays); the vLLM servers keep running."""
        if self.refit is not None:
            self.refit.shutdown()
            self.refit = None

    # -- one sync ------------------------------------------------------------------------------------
    def _launch(self) -> dcr_ray.RefitReport | None:
        from dcr_ray.config import CommitConfig, RefitConfig, TransportConfig

        config = RefitConfig(transport=TransportConfig(kind=self.settings.transport), codec=self.settings.codec(),
                             commit=CommitConfig(timeout_s=self.settings.timeout_s,
                                                 start_timeout_s=self.settings.timeout_s))
        self.refit = dcr_ray.launch(owners=self.owners, clusters=self.clusters(self._checkpoint()), config=config)
        self._stale = False
        return None

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict[str, float]:
        """Sync the trainer's current weights to every rollout replica; returns veRL-style metrics once the
        commit record is written (every replica serves them), else raises ``dcr_ray.errors.RefitError``."""
        if self.refit is not None and self._stale:
            self.shutdown()
        await self.abort_replicas()
        slept, released = self._asleep, False
        try:
            if slept:  # veRL's trainer slept them (HYBRID / COLOCATED) and relies on this call to wake them
                await self.wake_up_replicas()
            if self.settings.release_kv_cache:
                released = True
                await self.release_kv_cache_replicas()
            if self.owners is None:
                await asyncio.to_thread(self.build_process_group)
            sent = await asyncio.gather(*self.actor_wg.update_weights(global_steps=global_steps,
                                                                      mode=ENGINE_DRIVEN_MODE))
            if self.refit is None:  # launch: every engine joins by digest or is bootstrapped densely
                await asyncio.to_thread(self._dedupe_replicas)
                await asyncio.to_thread(self._launch)
                status = self.refit.status()
                return {"checkpoint_engine/dcr_version": float(status.get("version", 0)),
                        "checkpoint_engine/dcr_launched": 1.0, **_sum(sent)}
            dropped = self.dropped_engines(slept, released)
            repaired = await asyncio.to_thread(self._verify, dropped)
            report = await asyncio.wait_for(self.refit.remote(), timeout=self.settings.timeout_s)
            return {**_sum(sent), **report_metrics(report), "checkpoint_engine/dcr_verified": float(len(dropped)),
                    "checkpoint_engine/dcr_repaired_densely": float(repaired)}
        finally:
            if released:
                await self.resume_kv_cache_replicas()
            await self.resume_generation_replicas()


def _owner_boxes(owner) -> dict[str, tuple]:
    """In an owner actor: its local keys' canonical boxes."""
    return declared_boxes(owner.dcr_tensors())


def _owner_drop(owner, keys: list[str]) -> None:
    """In an owner actor: forget local keys another owner sends."""
    for k in keys:
        owner.dcr_tensors().pop(k, None)


def _sum(results) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in results:
        for k, v in (r or {}).items():
            out[k] = out.get(k, 0.0) + float(v)
    return out


def report_metrics(report: dcr_ray.RefitReport) -> dict[str, float]:
    """A :class:`dcr_ray.RefitReport` as veRL's ``checkpoint_engine/*`` metrics."""
    out = {"checkpoint_engine/dcr_version": float(report.version),
           "checkpoint_engine/changed_elems": float(report.changed),
           "checkpoint_engine/changed_ratio": report.changed / report.numel if report.numel else 0.0,
           "checkpoint_engine/payload_mbytes": report.wire_bytes / (1 << 20),
           "checkpoint_engine/bytes_per_changed_elem": report.wire_bytes / report.changed if report.changed else 0.0,
           "checkpoint_engine/attempts": float(report.attempts),
           "checkpoint_engine/seconds": float(report.seconds.get("total", 0.0))}
    for cluster, nbytes in report.link_bytes.items():
        out[f"checkpoint_engine/link_mbytes/{cluster}"] = nbytes / (1 << 20)
    return out


__all__ = ["DEFAULT_CLUSTER", "DcrCheckpointEngineManager", "ENGINE_DRIVEN_MODE", "report_metrics"]
