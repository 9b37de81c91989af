"""The trainer layouts the projection benchmark shards: FSDP 4 x TP 2 ranks of a Qwen2-like dense model and of
a Qwen3-MoE-like model (experts expert-parallel over all 8 ranks).

Each trainer parameter is held the way Megatron-style trainers hold it (fused QKV with grouped heads
interleaved per KV group, fused gate/up per TP rank, row-parallel ``o_proj``/``down_proj``, vocab-parallel
embedding and LM head padded past the vocabulary, a replicated router, stacked experts, RMSNorm weights as
FP32 ``w - 1``), then FSDP2 ``Shard(0)`` splits each TP shard's rows (ceil-div). :class:`Param` knows, for one
parameter, every rank's local tensor, the owner pieces with their specs, and how an all-gather followed by
the conversion to checkpoint tensors is done with torch ops (:meth:`Param.gather`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dcr_ray.codec import bits_view
from dcr_ray.sharding import (ShardSpec, Target, fused_gate_up, fused_qkv, replicated_share, row_slice,
                              stacked_experts)

DP, TP = 4, 2
WORLD = DP * TP
#: Vocab-parallel tables are padded to a multiple of TP * this many rows.
PAD_ROWS = 384


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A Qwen2-like (``experts == 0``) or Qwen3-MoE-like model."""

    name: str
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    experts: int = 0
    expert_inter: int = 0


DENSE = ModelShape("dense", 1024, 2816, 16, 8, 64, 32000, 12)
MOE = ModelShape("moe", 1024, 0, 16, 4, 64, 32000, 6, experts=16, expert_inter=512)
DENSE_QUICK = ModelShape("dense", 512, 1408, 8, 4, 64, 8192, 2)
MOE_QUICK = ModelShape("moe", 512, 0, 8, 4, 64, 4096, 2, experts=8, expert_inter=256)


def rows_of(spec: ShardSpec, a: int, b: int) -> ShardSpec:
    """Rows ``[a, b)`` of a local tensor whose cells run along dimension 0 (FSDP2 ``Shard(0)`` of a TP shard)."""
    parts = []
    for (s, e), t in zip(spec.cell_bounds()[0], spec.cells):
        lo, hi = max(s, a), min(e, b)
        if lo < hi:
            parts.append((hi - lo, None if t is None else Target(t.name, t.shape, t.base + (lo - s) * t.strides[0],
                                                                 t.strides)))
    cuts = tuple(sum(n for n, _ in parts[:i + 1]) for i in range(len(parts) - 1))
    rest = spec.local_shape[1:]
    return ShardSpec((b - a, *rest), tuple(t for _, t in parts), (cuts,) + ((),) * len(rest), spec.overwrite_only)


@dataclass
class Piece:
    """What one owner diffs: a local tensor (``residual``: the FP32 ``w - 1`` it converts first) and its spec."""

    local: str
    tensor: torch.Tensor
    spec: ShardSpec
    residual: bool = False
    row0: int = 0
    """The piece is rows ``[row0, row0 + len(tensor))`` of its rank's local tensor."""


@dataclass
class Param:
    """One trainer parameter: ``kind``, its trainer-global tensor's shape, canonical names, and per rank the
    local tensor (``locals_[rank]``, None when empty) and owner pieces."""

    name: str
    kind: str
    canonical: list[str]
    locals_: dict[int, torch.Tensor] = field(default_factory=dict)
    pieces: dict[int, list[Piece]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def gather(self, locals_: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        """All-gather (torch.cat of every rank's local tensor) and convert to the canonical tensors."""
        m = self.meta
        if self.kind == "norm":
            return {self.canonical[0]: (locals_[0] + 1).to(torch.bfloat16)}
        if self.kind == "experts":
            full = torch.cat([locals_[r] for r in range(WORLD)])
            parts = m["parts"]
            out = {}
            for e in range(full.shape[0]):
                for i, piece in enumerate(torch.chunk(full[e], parts)):
                    out[self.canonical[e * parts + i]] = piece.contiguous()
            return out
        tp = [torch.cat([locals_[d * TP + t] for d in range(DP) if locals_.get(d * TP + t) is not None])
              for t in range(TP)]
        if self.kind == "router":
            return {self.canonical[0]: tp[0]}
        if self.kind == "row":
            return {self.canonical[0]: torch.cat(tp, dim=1)}
        if self.kind == "vocab":
            return {self.canonical[0]: torch.cat(tp)[:m["vocab"]]}
        if self.kind == "gate_up":
            halves = [x.chunk(2) for x in tp]
            return {self.canonical[0]: torch.cat([h[0] for h in halves]),
                    self.canonical[1]: torch.cat([h[1] for h in halves])}
        if self.kind == "qkv":
            qpg, hd, h = m["qpg"], m["head_dim"], m["hidden"]
            full = torch.cat(tp).view(m["kv_heads"], (qpg + 2) * hd, h)
            return {self.canonical[0]: full[:, :qpg * hd].reshape(-1, h),
                    self.canonical[1]: full[:, qpg * hd:(qpg + 1) * hd].reshape(-1, h),
                    self.canonical[2]: full[:, (qpg + 1) * hd:].reshape(-1, h)}
        raise ValueError(self.kind)


def _fsdp(p: Param, tp_locals: list[torch.Tensor], tp_specs: list[ShardSpec], replicated: bool = False) -> None:
    """FSDP2 ``Shard(0)`` (ceil-div) of every TP shard: rank ``d * TP + t`` holds rows ``[d n, (d + 1) n)``."""
    for t, (x, spec) in enumerate(zip(tp_locals, tp_specs)):
        n = -(-x.shape[0] // DP)
        for d in range(DP):
            a, b = min(x.shape[0], d * n), min(x.shape[0], (d + 1) * n)
            r = d * TP + t
            if a >= b:
                p.locals_[r], p.pieces[r] = None, []
                continue
            local = x[a:b].contiguous()
            p.locals_[r] = local
            if replicated:  # every TP rank holds this box: each sends its share
                share = replicated_share(p.name, tuple(spec.cells[0].shape), (a, 0), local, t, TP)
                p.pieces[r] = [] if share is None else [Piece(p.name, share[0], share[1], row0=t * local.shape[0] // TP)]
            else:
                p.pieces[r] = [Piece(p.name, local, rows_of(spec, a, b))]


def build(shape: ModelShape, gen: torch.Generator) -> list[Param]:
    """Every parameter of ``shape`` under the layout above, random BF16 (norms FP32 ``w - 1``)."""
    s = shape
    out: list[Param] = []

    def rnd(*dims, dtype=torch.bfloat16):
        return torch.randn(dims, generator=gen).to(dtype)

    def chunks(x, dim=0):
        return [c.contiguous() for c in torch.chunk(x, TP, dim=dim)]

    norm_owner = [0]

    def norm(name: str, n: int):
        p = Param(name, "norm", [name])
        w = rnd(n, dtype=torch.float32) * 0.01  # w - 1 of a norm near 1
        for r in range(WORLD):
            p.locals_[r] = w if r == 0 else w.clone()
            p.pieces[r] = []
        owner = norm_owner[0] % WORLD  # one owner per norm, dealt round-robin
        norm_owner[0] += 1
        p.pieces[owner] = [Piece(name, p.locals_[owner], ShardSpec.residual(name, (n,)), residual=True)]
        out.append(p)

    def vocab(name: str):
        per = -(-s.vocab // (TP * PAD_ROWS)) * PAD_ROWS
        full = rnd(per * TP, s.hidden)
        p = Param(name, "vocab", [name], meta={"vocab": s.vocab})
        xs = chunks(full)
        _fsdp(p, xs, [row_slice(name, (s.vocab, s.hidden), t * per, tuple(x.shape)) for t, x in enumerate(xs)])
        out.append(p)

    vocab("model.embed_tokens.weight")
    for layer in range(s.layers):
        pre = f"model.layers.{layer}."
        norm(pre + "input_layernorm.weight", s.hidden)
        norm(pre + "post_attention_layernorm.weight", s.hidden)
        qpg = s.heads // s.kv_heads
        names = [pre + f"self_attn.{x}_proj.weight" for x in "qkv"]
        p = Param(pre + "self_attn.qkv", "qkv", names,
                  meta=dict(qpg=qpg, head_dim=s.head_dim, hidden=s.hidden, kv_heads=s.kv_heads))
        xs = chunks(rnd(s.kv_heads * (qpg + 2) * s.head_dim, s.hidden))
        _fsdp(p, xs, [fused_qkv(tuple(x.shape), *names, num_heads=s.heads, num_kv_heads=s.kv_heads,
                                head_dim=s.head_dim, tp_rank=t, tp_size=TP) for t, x in enumerate(xs)])
        out.append(p)
        rows = [(pre + "self_attn.o_proj.weight", (s.hidden, s.heads * s.head_dim))]
        if s.experts:
            norm(pre + "self_attn.q_norm.weight", s.head_dim)
            norm(pre + "self_attn.k_norm.weight", s.head_dim)
            router = pre + "mlp.gate.weight"
            p = Param(router, "router", [router])
            full = rnd(s.experts, s.hidden)
            _fsdp(p, [full, full.clone()], [ShardSpec.box(router, tuple(full.shape), (0, 0), tuple(full.shape))] * TP,
                  replicated=True)
            out.append(p)
            for stack, parts, dims in [("gate_up_proj", ("gate_proj", "up_proj"), (2 * s.expert_inter, s.hidden)),
                                       ("down_proj", ("down_proj",), (s.hidden, s.expert_inter))]:
                def names_of(e, parts=parts):
                    return tuple(f"{pre}mlp.experts.{e}.{x}.weight" for x in parts)
                p = Param(pre + "mlp.experts." + stack, "experts",
                          [n for e in range(s.experts) for n in names_of(e)], meta={"parts": len(parts)})
                full = rnd(s.experts, *dims)
                per = s.experts // WORLD
                for r in range(WORLD):
                    local = full[r * per:(r + 1) * per].contiguous()
                    p.locals_[r] = local
                    p.pieces[r] = [Piece(p.name, local, stacked_experts(tuple(local.shape), names_of,
                                                                        first_expert=r * per))]
                out.append(p)
        else:
            names = [pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"]
            p = Param(pre + "mlp.gate_up", "gate_up", names)
            xs = chunks(rnd(2 * s.inter, s.hidden))
            _fsdp(p, xs, [fused_gate_up(tuple(x.shape), *names, intermediate=s.inter, tp_rank=t, tp_size=TP)
                          for t, x in enumerate(xs)])
            out.append(p)
            rows.append((pre + "mlp.down_proj.weight", (s.hidden, s.inter)))
        for name, shp in rows:
            p = Param(name, "row", [name])
            xs = chunks(rnd(*shp), dim=1)
            _fsdp(p, xs, [ShardSpec.box(name, shp, (0, t * xs[0].shape[1]), tuple(x.shape)) for t, x in enumerate(xs)])
            out.append(p)
    norm("model.norm.weight", s.hidden)
    vocab("lm_head.weight")
    return out


def change(params: list[Param], rate: float, rng: np.random.Generator) -> list[Param]:
    """A copy of ``params`` whose local tensors changed in about ``rate`` of their elements (random nonzero
    XOR of the bits; positions drawn with replacement, so slightly fewer); replicated copies change alike."""
    out = []
    for p in params:
        q = Param(p.name, p.kind, p.canonical, meta=p.meta)
        new_of: dict = {}
        for r, x in p.locals_.items():
            if x is None:
                q.locals_[r] = None
                continue
            key = "all" if p.kind == "norm" else (r // TP if p.kind == "router" else r)  # replicas alike
            if key not in new_of:
                y = x.clone()
                b = bits_view(y)
                pos = rng.integers(0, b.size, max(1, round(rate * b.size)))
                b[pos] ^= rng.integers(1, 1 << 15, len(pos)).astype(b.dtype)
                new_of[key] = y
            q.locals_[r] = new_of[key] if p.kind != "norm" or r == 0 else new_of[key].clone()
        for r, ps in p.pieces.items():
            q.pieces[r] = [_same_piece(pc, q.locals_[r]) for pc in ps]
        out.append(q)
    return out


def _same_piece(pc: Piece, new_local: torch.Tensor) -> Piece:
    """The piece of the changed local tensor at the same place as ``pc`` in the old one."""
    return Piece(pc.local, new_local[pc.row0:pc.row0 + pc.tensor.shape[0]], pc.spec, pc.residual, pc.row0)
