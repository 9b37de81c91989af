"""Which tensors of the tested models go residual, and why; and a Megatron-style layout of each model
projects exactly like gather-then-diff.

The layout: tensor parallel 2 (fused QKV with grouped heads interleaved, fused gate/up, row-parallel
``o_proj``/``down_proj`` split along their input dimension, vocab-parallel embedding and LM head padded
past the vocabulary), the router replicated across TP ranks, stacked experts (transformers'
``gate_up_proj`` / ``down_proj``) expert-parallel 2 onto the per-expert checkpoint tensors, and the
RMSNorm weights stored by the trainer as ``w - 1`` in FP32 (Megatron's zero-centred gamma).

Residual = a *value* conversion, which no map of positions can express: only those norms. Everything
else is affine (a box, a slice, a permutation of rows): fused QKV is a row permutation, fused gate/up two
row blocks, stacked experts one box per expert and part, padding rows a cell with no target. A tied LM
head is *not* residual either: it is the embedding tensor itself, declared once (the checkpoint has no
``lm_head.weight``); declaring it again is an overlap (see ``test_sharding_coverage``).
"""

from __future__ import annotations

import pytest
import torch

from dcr_ray.actors.owner.coverage import check_coverage
from dcr_ray.codec.bits import bits_view, wire_name
from dcr_ray.engines.base import checkpoint_state_dict
from dcr_ray.sharding import (Shard, ShardSpec, canonical_specs, fused_gate_up, fused_qkv, replicated_share,
                              row_slice, stacked_experts)
from dcr_ray.testing.models import ModelSpec, build_model
from dcr_ray.testing.sharded_trainer import checkpoint_names

from test_sharding_cases import Layout, Piece, check_bootstrap, check_projection, owners

TP, EP, PAD_MULT = 2, 2, 100


def megatron(model, tp=TP, ep=EP) -> Layout:
    """The layout above for ``model`` (state: its parameters, norms as FP32 ``w - 1``)."""
    cfg = model.config
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    _, stacked = checkpoint_names(model)
    params = dict(model.named_parameters())
    state = {n: (tuple(p.shape), torch.float32 if n.endswith("norm.weight") else p.dtype) for n, p in params.items()}

    def build(s, pad_seed):
        canon, pieces = {}, []
        for n, t in s.items():
            if n.endswith("norm.weight"):
                canon[n] = (t + 1).to(torch.bfloat16)
                pieces.append(Piece("r0", n, canon[n].clone(), ShardSpec.residual(n, tuple(t.shape))))
            elif n.endswith(("embed_tokens.weight", "lm_head.weight")):
                canon[n] = t
                v = t.shape[0]
                per = -(-v // (tp * PAD_MULT)) * PAD_MULT
                for r in range(tp):
                    real = t[min(v, r * per):min(v, (r + 1) * per)]
                    g = torch.Generator().manual_seed(pad_seed * 7 + r)
                    pad = torch.randn((per - real.shape[0], t.shape[1]), generator=g).to(t.dtype)
                    local = torch.cat([real, pad])
                    pieces.append(Piece(f"r{r}", n, local, row_slice(n, tuple(t.shape), r * per, tuple(local.shape))))
            elif ".self_attn.q_proj." in n:
                k, v_ = n.replace("q_proj", "k_proj"), n.replace("q_proj", "v_proj")
                canon.update({n: t, k: s[k], v_: s[v_]})
                qpg, groups = nh // nkv, nkv // tp
                for r in range(tp):
                    rows = []
                    for g in range(r * groups, (r + 1) * groups):
                        rows += [t[g * qpg * hd:(g + 1) * qpg * hd], s[k][g * hd:(g + 1) * hd], s[v_][g * hd:(g + 1) * hd]]
                    local = torch.cat(rows)
                    pieces.append(Piece(f"r{r}", n.replace("q_proj", "qkv"), local, fused_qkv(
                        tuple(local.shape), n, k, v_, num_heads=nh, num_kv_heads=nkv, head_dim=hd, tp_rank=r, tp_size=tp)))
            elif ".mlp.gate_proj." in n:
                up = n.replace("gate_proj", "up_proj")
                canon.update({n: t, up: s[up]})
                for r in range(tp):
                    local = torch.cat([torch.chunk(t, tp)[r], torch.chunk(s[up], tp)[r]])
                    pieces.append(Piece(f"r{r}", n.replace("gate_proj", "gate_up"), local, fused_gate_up(
                        tuple(local.shape), n, up, intermediate=t.shape[0], tp_rank=r, tp_size=tp)))
            elif n.endswith(("o_proj.weight", "mlp.down_proj.weight")):
                canon[n] = t
                at = 0
                for r, part in enumerate(torch.chunk(t, tp, dim=1)):
                    pieces.append(Piece(f"r{r}", n, part.contiguous(), ShardSpec.box(n, tuple(t.shape), (0, at), tuple(part.shape))))
                    at += part.shape[1]
            elif n in stacked:
                names = stacked[n]
                parts = len(names(0))
                for e in range(t.shape[0]):
                    for i, cn in enumerate(names(e)):
                        canon[cn] = torch.chunk(t[e], parts)[i]
                per = t.shape[0] // ep
                for r in range(ep):
                    local = t[r * per:(r + 1) * per].contiguous()
                    pieces.append(Piece(f"r{r * tp}", n, local, stacked_experts(tuple(local.shape), names, first_expert=r * per)))
            elif n.endswith("mlp.gate.weight"):  # the router: every TP rank holds it whole
                canon[n] = t
                for r in range(tp):
                    local, spec = replicated_share(n, tuple(t.shape), (0, 0), t.clone(), r, tp)
                    pieces.append(Piece(f"r{r}", n, local.contiguous(), spec))
            elif not any(x in n for x in ("k_proj", "v_proj", "up_proj")):
                raise AssertionError(f"no layout for {n}")
        return canon, pieces
    return Layout(f"megatron-{cfg.model_type}", state, build,
                  residual={n for n in params if n.endswith("norm.weight")})


def _trainer_state(model) -> dict[str, torch.Tensor]:
    return {n: (p.detach().float() - 1 if n.endswith("norm.weight") else p.detach()).clone()
            for n, p in model.named_parameters()}


NORMS = {
    "qwen2": {"model.norm.weight"} | {f"model.layers.{i}.{k}.weight" for i in range(2)
                                      for k in ("input_layernorm", "post_attention_layernorm")},
    "qwen3_moe": {"model.norm.weight"} | {f"model.layers.{i}.{k}.weight" for i in range(2)
                                          for k in ("input_layernorm", "post_attention_layernorm",
                                                    "self_attn.q_norm", "self_attn.k_norm")},
}


@pytest.mark.parametrize("arch, tied", [("qwen2", False), ("qwen2", True), ("qwen3_moe", False)])
def test_only_the_norms_stored_as_w_minus_1_go_residual_and_they_are_under_two_percent_of_the_bytes(arch, tied):
    """Residual: the RMSNorm weights (``input_layernorm``, ``post_attention_layernorm``, the final
    ``model.norm`` and, on Qwen3-MoE, ``q_norm``/``k_norm``), because the trainer stores ``w - 1`` and the
    engines load ``w``: a change of values, not of places. Affine: every other tensor, including the
    fused QKV (a permutation of rows), fused gate/up, the replicated router, the stacked experts and the
    tied embedding (tied: one tensor, no ``lm_head.weight`` in the checkpoint)."""
    model = build_model(ModelSpec(arch=arch, tie_word_embeddings=tied))
    lay = megatron(model)
    canon, pieces = lay.build(_trainer_state(model), 0)
    ck = checkpoint_state_dict(model)
    assert set(canon) == set(ck)
    for n, t in canon.items():  # the layout's canonical tensors are transformers' checkpoint tensors
        assert (bits_view(t.contiguous()) == bits_view(ck[n].detach().contiguous())).all(), n
    assert ("lm_head.weight" in canon) is (not tied)

    residual = {n for p in pieces if p.spec.overwrite_only for n in p.spec.names}
    affine = {n for p in pieces if not p.spec.overwrite_only for n in p.spec.names}
    assert residual == NORMS[arch] and not residual & affine and residual | affine == set(canon)
    nbytes = {n: t.numel() * 2 for n, t in canon.items()}
    direct_fraction = sum(nbytes[n] for n in affine) / sum(nbytes.values())
    assert direct_fraction >= 0.98, direct_fraction

    declared = {o: canonical_specs({p.local: Shard(p.tensor, p.spec) for p in ps}, wire_name)
                for o, ps in owners(pieces).items()}
    check_coverage(declared, {n: (wire_name(t.dtype), tuple(t.shape)) for n, t in canon.items()})


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_a_megatron_layout_of_each_model_projects_exactly_like_gather_then_diff(arch):
    lay = megatron(build_model(ModelSpec(arch=arch)))
    check_projection(lay, seed=3, rate=0.03, chunk=1 << 12)
    check_bootstrap(lay, seed=4, chunk=1 << 12)
