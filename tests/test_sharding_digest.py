"""Box digests agree whether computed from an owner's local shard or from an engine's canonical tensors."""

from __future__ import annotations

import torch

from dcr_ray.sharding import ShardSpec, Target, fused_qkv, stacked_experts
from dcr_ray.sharding.digest import box_digests, shard_digests


def _megatron_qkv(q, k, v, nh, nkv, hd, rank, tp):
    qpg, groups = nh // nkv, nkv // tp
    rows = []
    for g in range(rank * groups, (rank + 1) * groups):
        rows += [q[g * qpg * hd:(g + 1) * qpg * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
    return torch.cat(rows)


def test_fused_qkv_shards_digest_like_the_engines_canonical_q_k_v_boxes():
    nh, nkv, hd, h = 8, 4, 4, 16
    canon = {n: torch.randn(s).to(torch.bfloat16) for n, s in
             [("q", (nh * hd, h)), ("k", (nkv * hd, h)), ("v", (nkv * hd, h))]}
    for rank in range(2):
        local = _megatron_qkv(canon["q"], canon["k"], canon["v"], nh, nkv, hd, rank, 2)
        spec = fused_qkv(tuple(local.shape), "q", "k", "v", num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                         tp_rank=rank, tp_size=2)
        mine = shard_digests({"qkv": (local, spec)})
        assert mine == box_digests(canon, mine)


def test_a_transposed_local_copy_and_stacked_experts_digest_like_the_canonical_boxes():
    w = torch.randn(6, 10).to(torch.bfloat16)
    spec = ShardSpec((10, 6), (Target("w", (6, 10), 0, (1, 10)),))  # local = w.T
    mine = shard_digests({"wt": (w.t().contiguous(), spec)})
    assert mine == box_digests({"w": w}, mine)

    experts = {f"e{e}.{p}": torch.randn(4, 8).to(torch.bfloat16) for e in range(4) for p in ("gate", "up")}
    local = torch.stack([torch.cat([experts[f"e{e}.gate"], experts[f"e{e}.up"]]) for e in (2, 3)])
    spec = stacked_experts(tuple(local.shape), lambda e: (f"e{e}.gate", f"e{e}.up"), first_expert=2)
    mine = shard_digests({"gate_up": (local, spec)})
    assert len(mine) == 4 and mine == box_digests(experts, mine)


def test_one_changed_bit_changes_the_digest_of_its_box_only():
    w = torch.randn(8, 8).to(torch.bfloat16)
    specs = {f"r{r}": (w[4 * r:4 * r + 4].clone(), ShardSpec.box("w", (8, 8), (4 * r, 0), (4, 8))) for r in range(2)}
    before = shard_digests(specs)
    specs["r1"][0].view(torch.int16)[0, 0] ^= 1
    after = shard_digests(specs)
    assert [k for k in before if before[k] != after[k]] == [("w", (4, 0), (8, 8))]
