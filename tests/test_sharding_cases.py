"""Layouts trainers use, built with plain torch ops from canonical tensors, and the checks every projection
test runs on them. The other ``test_sharding_*`` modules draw these layouts with hypothesis.

A layout turns a *state* (the tensors a trainer would hold, by canonical name) into the canonical tensors
the engines hold and the local tensors each owner holds, each with its :class:`ShardSpec`. Local tensors
are cut out with ``torch.tensor_split`` / slicing / ``torch.cat`` / ``torch.stack`` (what the trainers do),
never from the spec, so a wrong spec shows up as a wrong projection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from hypothesis import strategies as st

from dcr_ray.codec import FrameMeta, apply_decoded, bits_view, diff_tensor, encode_frames, full_delta, read_frame
from dcr_ray.codec.encoding.diff import TensorDelta
from dcr_ray.sharding import (ShardSpec, box_target, fused_gate_up, fused_qkv, project, replicated_share,
                              row_slice, stacked_experts)


@dataclass
class Piece:
    """One local tensor of one owner."""

    owner: str
    local: str
    tensor: torch.Tensor
    spec: ShardSpec


@dataclass
class Layout:
    """``state``: name -> (shape, dtype) of what the trainer holds; ``build(state, pad_seed)`` -> (canonical
    tensors, pieces). ``pad_seed`` fills padding rows (vocab padding changes between steps too)."""

    kind: str
    state: dict[str, tuple[tuple[int, ...], torch.dtype]]
    build: Callable[[dict[str, torch.Tensor], int], tuple[dict[str, torch.Tensor], list[Piece]]]
    residual: set[str] = field(default_factory=set)


def _pad(rows: int, like: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((rows, *like.shape[1:]), generator=g).to(like.dtype)


# -- layouts -----------------------------------------------------------------------------------------

def tp_split(shape, dtype, tp, dim):
    """Tensor-parallel column (dim 0 of a Linear weight) or row (dim 1) split, possibly uneven."""
    def build(s, _):
        w = s["w"]
        pieces, at = [], 0
        for r, part in enumerate(torch.tensor_split(w, tp, dim=dim)):
            off = [0] * w.dim()
            off[dim] = at
            at += part.shape[dim]
            if part.numel():
                pieces.append(Piece(f"r{r}", "w", part.contiguous(), ShardSpec.box("w", w.shape, tuple(off), part.shape)))
        return s, pieces
    return Layout(f"tp{tp}-dim{dim}", {"w": (shape, dtype)}, build)


def fsdp(shape, dtype, world, ceil_div):
    """FSDP ``Shard(0)``: ``torch.tensor_split`` parts, or FSDP2's ceil-div chunks (short or empty tail)."""
    def build(s, _):
        w = s["w"]
        rows = w.shape[0]
        if ceil_div:
            n = -(-rows // world)
            bounds = [(min(rows, r * n), min(rows, (r + 1) * n)) for r in range(world)]
        else:
            at = np.cumsum([0] + [p.shape[0] for p in torch.tensor_split(w, world)])
            bounds = list(zip(at[:-1].tolist(), at[1:].tolist()))
        pieces = []
        for r, (a, b) in enumerate(bounds):
            share = replicated_share("w", tuple(w.shape), (a,) + (0,) * (w.dim() - 1), w[a:b].clone(), 0, 1)
            if share is not None:
                pieces.append(Piece(f"r{r}", "w", share[0].contiguous(), share[1]))
        return s, pieces
    return Layout(f"fsdp{world}{'-ceil' if ceil_div else ''}", {"w": (shape, dtype)}, build)


def fsdp_x_tp(shape, dtype, dp, tp, tp_dim):
    """A 2-D mesh: TP splits ``tp_dim``, FSDP then splits the TP shard's rows (ceil-div, empty tails skipped)."""
    def build(s, _):
        w = s["w"]
        pieces, c0 = [], 0
        for t, tpart in enumerate(torch.tensor_split(w, tp, dim=tp_dim)):
            rows = tpart.shape[0]
            n = -(-rows // dp)
            for d in range(dp):
                a, b = min(rows, d * n), min(rows, (d + 1) * n)
                if b <= a or tpart.shape[1] == 0:
                    continue
                local = tpart[a:b].contiguous()
                r0 = a + (c0 if tp_dim == 0 else 0)
                col = (c0 if tp_dim == 1 else 0,)
                pieces.append(Piece(f"r{d * tp + t}", "w", local, row_slice("w", tuple(w.shape), r0, tuple(local.shape),
                                                                             col_offset=col)))
            c0 += tpart.shape[tp_dim]
        return s, pieces
    return Layout(f"fsdp{dp}xtp{tp}-dim{tp_dim}", {"w": (shape, dtype)}, build)


def qkv(nh, nkv, hd, h, tp, interleaved, dtype, bias):
    """Fused QKV with grouped-query heads: Megatron's per-group interleave or vLLM's q|k|v per rank."""
    qpg, groups = nh // nkv, nkv // tp
    names = ("q", "k", "v") + (("qb", "kb", "vb") if bias else ())
    shapes = {"q": (nh * hd, h), "k": (nkv * hd, h), "v": (nkv * hd, h), "qb": (nh * hd,), "kb": (nkv * hd,),
              "vb": (nkv * hd,)}

    def fuse(q, k, v, r):
        if interleaved:
            rows = []
            for g in range(r * groups, (r + 1) * groups):
                rows += [q[g * qpg * hd:(g + 1) * qpg * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
            return torch.cat(rows)
        qs, ks = torch.chunk(q, tp)[r], torch.chunk(k, tp)[r]
        return torch.cat([qs, ks, torch.chunk(v, tp)[r]])

    def build(s, _):
        pieces = []
        for r in range(tp):
            for suffix, (q, k, v) in [("", "qkv")] + ([("b", ("qb", "kb", "vb"))] if bias else []):
                local = fuse(s[q], s[k], s[v], r).contiguous()
                spec = fused_qkv(tuple(local.shape), q, k, v, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                                 tp_rank=r, tp_size=tp, interleaved=interleaved)
                pieces.append(Piece(f"r{r}", "qkv" + suffix, local, spec))
        return s, pieces
    return Layout(f"qkv-{'megatron' if interleaved else 'vllm'}-{nh}/{nkv}-tp{tp}",
                  {n: (shapes[n], dtype) for n in names}, build)


def gate_up(inter, h, tp, dtype):
    """Fused gate/up, each TP rank holding its gate rows then its up rows."""
    def build(s, _):
        pieces = []
        for r in range(tp):
            local = torch.cat([torch.chunk(s["gate"], tp)[r], torch.chunk(s["up"], tp)[r]]).contiguous()
            pieces.append(Piece(f"r{r}", "gate_up", local, fused_gate_up(tuple(local.shape), "gate", "up",
                                                                         intermediate=inter, tp_rank=r, tp_size=tp)))
        return s, pieces
    return Layout(f"gate_up-tp{tp}", {"gate": ((inter, h), dtype), "up": ((inter, h), dtype)}, build)


def experts(n_exp, inter, h, ep, fused, tp, stacked_canonical, dtype):
    """Stacked experts sliced by expert parallelism onto per-expert tensors (``fused``: transformers'
    ``gate_up_proj`` whose dim 1 splits into gate and up; ``tp``: tensor parallel inside each expert), or
    onto the stacked canonical tensor itself (``stacked_canonical``: HF's in-memory layout)."""
    def pnames(e):
        return (f"e{e}.gate", f"e{e}.up") if fused else f"e{e}.down"

    if stacked_canonical:
        state = {"experts": ((n_exp, (2 if fused else 1) * inter, h), dtype)}
    else:
        state = {n: ((inter, h), dtype) for e in range(n_exp)
                 for n in ((pnames(e),) if isinstance(pnames(e), str) else pnames(e))}

    def build(s, _):
        pieces = []
        per = n_exp // ep
        for r in range(ep):
            es = range(r * per, (r + 1) * per)
            for t in range(tp):
                owner = f"r{r * tp + t}"
                if stacked_canonical:
                    local = s["experts"][r * per:(r + 1) * per].contiguous()
                    pieces.append(Piece(owner, "experts", local, ShardSpec.box("experts", s["experts"].shape,
                                                                                (r * per, 0, 0), local.shape))
                                  if t == 0 else None)
                    continue
                blocks = []
                for e in es:
                    ns = pnames(e)
                    ns = (ns,) if isinstance(ns, str) else ns
                    blocks.append(torch.cat([torch.chunk(s[n], tp)[t] for n in ns]))
                local = torch.stack(blocks).contiguous()
                n = inter // tp
                spec = stacked_experts(tuple(local.shape), pnames, first_expert=r * per,
                                       canonical_shape=(inter, h), inner_offset=(t * n, 0))
                pieces.append(Piece(owner, "experts", local, spec))
        return s, [p for p in pieces if p is not None]
    return Layout(f"experts{n_exp}-ep{ep}-tp{tp}{'-fused' if fused else ''}{'-stacked' if stacked_canonical else ''}",
                  state, build)


def vocab(v, h, tp, mult, dtype):
    """Vocab-parallel embedding padded to ``tp * mult`` rows: padding rows exist only locally (and change)."""
    n = -(-v // (tp * mult)) * mult

    def build(s, pad_seed):
        w = s["embed"]
        pieces = []
        for r in range(tp):
            real = w[min(v, r * n):min(v, (r + 1) * n)]
            local = torch.cat([real, _pad(n - real.shape[0], w, pad_seed * 131 + r)]).contiguous()
            pieces.append(Piece(f"r{r}", "embed", local, row_slice("embed", (v, h), r * n, tuple(local.shape))))
        return s, pieces
    return Layout(f"vocab{v}-tp{tp}-pad{tp * n - v}", {"embed": ((v, h), dtype)}, build)


def tied(v, h, tp, dtype):
    """Tied embeddings: the trainer's LM head *is* the embedding; the owners declare it once (the
    checkpoint has no separate ``lm_head.weight``), so it is a vocab layout with no second name."""
    lay = vocab(v, h, tp, 1, dtype)
    lay.kind = f"tied-{lay.kind}"
    return lay


def replicated(shape, dtype, replicas):
    """A tensor every replica holds whole (norms, routers): replica ``i`` sends its ``replicated_share``."""
    def build(s, _):
        pieces = []
        for r in range(replicas):
            copy = s["norm"].clone()  # each replica's own copy
            share = replicated_share("norm", tuple(copy.shape), (0,) * copy.dim(), copy, r, replicas)
            if share is not None:
                pieces.append(Piece(f"r{r}", "norm", share[0].contiguous(), share[1]))
        return s, pieces
    return Layout(f"replicated{replicas}", {"norm": (shape, dtype)}, build)


def transposed(shape, dtype, tp):
    """A trainer that stores ``w.T`` split by columns of ``w``: local dim 0 steps canonical dim 1."""
    def build(s, _):
        w = s["w"]
        pieces, c0 = [], 0
        for r, part in enumerate(torch.tensor_split(w, tp, dim=1)):
            if part.shape[1]:
                local = part.t().contiguous()
                spec = ShardSpec(tuple(local.shape), (box_target("w", tuple(w.shape), (0, c0), dims=(1, 0)),))
                pieces.append(Piece(f"r{r}", "wT", local, spec))
            c0 += part.shape[1]
        return s, pieces
    return Layout(f"transposed-tp{tp}", {"w": (shape, dtype)}, build)


def pipeline(n_layers, shape, dtype, stages):
    """Pipeline stages: each owner holds whole tensors of its own layers."""
    names = [f"layer{i}.w" for i in range(n_layers)]

    def build(s, _):
        bounds = np.linspace(0, n_layers, stages + 1).round().astype(int)
        return s, [Piece(f"r{st_}", n, s[n].clone(), ShardSpec.direct(n, tuple(s[n].shape)))
                   for st_ in range(stages) for n in names[bounds[st_]:bounds[st_ + 1]]]
    return Layout(f"pipeline{stages}", {n: (shape, dtype) for n in names}, build)


def norm_minus_one(shape, replicas):
    """A norm the trainer stores as ``w - 1`` in FP32 (zero-centred gamma): the canonical BF16 ``w`` is a
    value conversion, not a map of positions, so one owner converts the whole tensor and sends it as a
    residual (OVERWRITE only)."""
    def canonical(x):
        return (x + 1).to(torch.bfloat16)

    def build(s, _):
        canon = {"norm": canonical(s["norm"])}
        # every replica holds the FP32 w - 1; replica 0 converts and owns the canonical tensor
        pieces = [Piece("r0", "norm", canonical(s["norm"].clone()), ShardSpec.residual("norm", tuple(shape)))]
        return canon, pieces
    return Layout(f"residual-norm-x{replicas}", {"norm": (shape, torch.float32)}, build, residual={"norm"})


def combine(layouts: list[Layout]) -> Layout:
    """Several layouts in one model, each under its own name prefix; owners of equal rank are one owner."""
    def rename(spec: ShardSpec, p: str) -> ShardSpec:
        cells = tuple(None if t is None else type(t)(p + t.name, t.shape, t.base, t.strides) for t in spec.cells)
        return ShardSpec(spec.local_shape, cells, spec.cuts, spec.overwrite_only)

    def build(s, pad_seed):
        canon, pieces = {}, []
        for i, lay in enumerate(layouts):
            p = f"L{i}."
            c, ps = lay.build({n[len(p):]: t for n, t in s.items() if n.startswith(p)}, pad_seed)
            canon.update({p + n: t for n, t in c.items()})
            pieces += [Piece(x.owner, p + x.local, x.tensor, rename(x.spec, p)) for x in ps]
        return canon, pieces
    state = {f"L{i}.{n}": v for i, lay in enumerate(layouts) for n, v in lay.state.items()}
    res = {f"L{i}.{n}" for i, lay in enumerate(layouts) for n in lay.residual}
    return Layout("+".join(lay.kind for lay in layouts), state, build, residual=res)


# -- hypothesis strategies ---------------------------------------------------------------------------

dtypes = st.sampled_from([torch.bfloat16] * 3 + [torch.float32])
tps = st.sampled_from([1, 2, 4, 8])


@st.composite
def layouts(draw) -> Layout:
    """One random layout of every kind the trainers use."""
    kind = draw(st.sampled_from(["tp", "fsdp", "2d", "qkv", "gate_up", "experts", "vocab", "tied", "replicated",
                                 "transposed", "pipeline", "residual"]))
    dt = draw(dtypes)
    if kind == "tp":
        return tp_split((draw(st.integers(1, 24)), draw(st.integers(1, 24))), dt, draw(tps), draw(st.sampled_from([0, 1])))
    if kind == "fsdp":
        return fsdp((draw(st.integers(1, 20)), draw(st.integers(1, 12))), dt, draw(st.integers(1, 8)), draw(st.booleans()))
    if kind == "2d":
        return fsdp_x_tp((draw(st.integers(2, 20)), draw(st.integers(2, 20))), dt, draw(st.integers(1, 4)),
                         draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([0, 1])))
    if kind == "qkv":
        tp = draw(st.sampled_from([1, 2, 4]))
        nkv = tp * draw(st.integers(1, 2))
        return qkv(nkv * draw(st.sampled_from([1, 2, 4])), nkv, draw(st.sampled_from([2, 4])), draw(st.integers(1, 12)),
                   tp, draw(st.booleans()), dt, draw(st.booleans()))
    if kind == "gate_up":
        tp = draw(tps)
        return gate_up(tp * draw(st.integers(1, 3)), draw(st.integers(1, 12)), tp, dt)
    if kind == "experts":
        ep = draw(st.sampled_from([1, 2, 4]))
        tp = draw(st.sampled_from([1, 2]))
        return experts(ep * draw(st.integers(1, 2)), tp * draw(st.integers(1, 3)), draw(st.integers(1, 8)), ep,
                       draw(st.booleans()), tp, draw(st.booleans()), dt)
    if kind in ("vocab", "tied"):
        v, h, tp = draw(st.integers(1, 40)), draw(st.integers(1, 8)), draw(tps)
        return vocab(v, h, tp, draw(st.sampled_from([1, 4, 8])), dt) if kind == "vocab" else tied(v, h, tp, dt)
    if kind == "replicated":
        shape = draw(st.sampled_from([(), (1,), (7,), (16,), (5, 3)]))
        return replicated(shape, dt, draw(st.integers(1, 8)))
    if kind == "transposed":
        return transposed((draw(st.integers(1, 16)), draw(st.integers(1, 16))), dt, draw(tps))
    if kind == "pipeline":
        return pipeline(draw(st.integers(1, 6)), (draw(st.integers(1, 8)), draw(st.integers(1, 8))), dt,
                        draw(st.integers(1, 4)))
    return norm_minus_one((draw(st.integers(1, 48)),), draw(st.integers(1, 4)))


@st.composite
def models(draw) -> Layout:
    """One to three layouts side by side (one model, owners shared across them)."""
    return combine(draw(st.lists(layouts(), min_size=1, max_size=3)))


# -- states and their changes -------------------------------------------------------------------------

def random_state(layout: Layout, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """Random tensors, some exactly +0 and some NaNs, so sign and payload changes have something to hit."""
    out = {}
    for n, (shape, dt) in layout.state.items():
        t = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dt).reshape(shape).contiguous()
        b = bits_view(t)
        if b.size:
            b[rng.random(b.size) < 0.05] = 0
        out[n] = t
    return out


def change(state: dict[str, torch.Tensor], rng: np.random.Generator, rate: float) -> dict[str, torch.Tensor]:
    """A copy of ``state`` with about ``rate`` of the elements changed in their bits: random bit flips,
    NaNs with random payloads, sign flips (``+0 <-> -0`` where the value is zero)."""
    out = {}
    for n, t in state.items():
        t = t.clone()
        b = bits_view(t)
        if b.size:
            w = b.dtype.itemsize * 8
            hit = np.flatnonzero(rng.random(b.size) < rate)
            kind = rng.integers(0, 3, len(hit))
            top = np.array(1 << (w - 1), dtype=b.dtype)
            exp = {16: 0x7F80, 32: 0x7F800000}[w]
            flips = rng.integers(1, 1 << min(w, 31), len(hit)).astype(b.dtype)
            b[hit[kind == 0]] ^= flips[kind == 0]
            payload = rng.integers(1, 1 << (7 if w == 16 else 23), len(hit)).astype(b.dtype)
            b[hit[kind == 1]] = (exp | payload[kind == 1]).astype(b.dtype)
            b[hit[kind == 2]] ^= top
        out[n] = t
    return out


# -- the checks ---------------------------------------------------------------------------------------

def owners(pieces: list[Piece]) -> dict[str, list[Piece]]:
    out: dict[str, list[Piece]] = {}
    for p in pieces:
        out.setdefault(p.owner, []).append(p)
    return out


def project_owner(olds: list[Piece], news: list[Piece], chunk: int, *, bootstrap: bool = False) -> list[TensorDelta]:
    """What one owner sends: each local tensor diffed against its local baseline (or ``full_delta`` for a
    bootstrap), projected to canonical changed sets."""
    out = []
    for o, n in zip(olds, news):
        assert o.local == n.local and o.spec == n.spec
        if bootstrap:
            td = full_delta(n.local, n.tensor, chunk_elems=chunk)
            out += list(project(td, n.spec, chunk_elems=chunk))
        else:
            base = bits_view(o.tensor).copy()
            td = diff_tensor(n.local, base, n.tensor, chunk_elems=chunk)
            out += list(project(td, n.spec, chunk_elems=chunk, old_bits=lambda b=base: b))
    return out


def check_chunk_invariants(td: TensorDelta, canon: dict[str, torch.Tensor]) -> None:
    """What the frame decoder needs of a projected changed set."""
    t = canon[td.name]
    assert td.shape == tuple(t.shape) and td.numel == t.numel()
    prev_hi = 0
    for c in td.chunks:
        assert 0 <= c.lo < c.hi <= td.numel, (td.name, c.lo, c.hi, td.numel)
        assert c.lo >= prev_hi, f"{td.name}: chunk [{c.lo}, {c.hi}) overlaps the previous one"
        prev_hi = c.hi
        if c.is_dense:
            assert len(c.dense) == c.hi - c.lo == c.count
        else:
            p = c.positions()
            assert len(p) == c.count == len(c.xor) == len(c.new) > 0
            assert (p >= c.lo).all() and (p < c.hi).all()
            assert (np.diff(p) > 0).all(), f"{td.name}: positions not sorted and unique"


def expand(tds: list[TensorDelta]) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """name -> (written positions, written bits, XOR masks or None where dense), over all changed sets."""
    acc: dict[str, list] = {}
    for td in tds:
        for c in td.chunks:
            pos = c.positions()
            acc.setdefault(td.name, []).append((pos, c.dense if c.is_dense else c.new, None if c.is_dense else c.xor))
    return {n: (np.concatenate([a for a, _, _ in v]), np.concatenate([b for _, b, _ in v]), v) for n, v in acc.items()}


def gather_then_diff(canon_old, canon_new) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The reference: name -> (changed flat indices, new bits) of the canonical tensors."""
    out = {}
    for n in canon_new:
        o, w = bits_view(canon_old[n].contiguous()), bits_view(canon_new[n].contiguous())
        pos = np.flatnonzero(o != w)
        out[n] = (pos, w[pos])
    return out


def check_projection(layout: Layout, seed: int, rate: float, chunk: int) -> None:
    """Projection == gather-then-diff, element for element and bit for bit; frames built from it turn the
    canonical old tensors into the canonical new ones."""
    rng = np.random.default_rng(seed)
    s_old = random_state(layout, rng)
    s_new = change(s_old, rng, rate)
    c_old, p_old = layout.build(s_old, seed)
    c_new, p_new = layout.build(s_new, seed + 1)
    assert [(p.owner, p.local) for p in p_old] == [(p.owner, p.local) for p in p_new]
    by_old, by_new = owners(p_old), owners(p_new)
    sent = {o: project_owner(by_old[o], by_new[o], chunk) for o in by_new}
    truth = gather_then_diff(c_old, c_new)

    for tds in sent.values():
        for td in tds:
            check_chunk_invariants(td, c_new)
    got = expand([td for tds in sent.values() for td in tds])
    for name, (pos, val, parts) in got.items():
        o, w = bits_view(c_old[name]), bits_view(c_new[name])
        assert len(np.unique(pos)) == len(pos), f"{name}: an element is sent twice"
        assert (val == w[pos]).all(), f"{name}: a sent value is not the canonical new bits"
        for p, _, x in parts:
            if x is not None:
                assert (x != 0).all() and (x == (o[p] ^ w[p])).all(), f"{name}: XOR mask is not new ^ old"
        real = val != o[pos]  # dense chunks also rewrite unchanged elements with their own bits
        order = np.argsort(pos[real])
        tpos, tval = truth[name]
        assert np.array_equal(pos[real][order], tpos) and np.array_equal(val[real][order], tval), name
        xo = o.copy()
        for p, _, x in parts:
            if x is not None:
                xo[p] ^= x
        dense = np.concatenate([p for p, _, x in parts if x is None] or [np.empty(0, np.int64)])
        sparse = np.setdiff1d(tpos, dense)
        assert (xo[sparse] == w[sparse]).all(), f"{name}: applying the XOR masks does not give the new bits"
    for name, (tpos, _) in truth.items():
        assert len(tpos) == 0 or name in got, f"{name}: changed but nothing sent"

    check_frames(sent, c_old, c_new, layout.residual, mode="mixed")


def check_frames(sent, c_old, c_new, residual, *, mode, zero_start=False) -> None:
    """Encode each owner's projected sets into frames, read and apply them onto the canonical old (or zero)
    tensors: the result is the canonical new tensors, bit for bit; residual tensors never travel as XOR."""
    targets = {n: (torch.zeros_like(t) if zero_start else t.clone()) for n, t in c_old.items()}
    for owner, tds in sent.items():
        meta = FrameMeta(transfer="t", attempt=0, producer=owner, payload=0, base=0, target=1)
        for frame in encode_frames(iter(tds), meta, mode=mode, bucket_bytes=1 << 12,
                                   xor_ok={n: False for n in residual}):
            dec = read_frame(frame, targets)
            for it in dec.items:
                if it.name in residual:
                    assert it.encoding.name != "XOR", f"{it.name} is residual but travelled as XOR"
            apply_decoded(dec, targets)
    for n, t in c_new.items():
        assert np.array_equal(bits_view(targets[n]), bits_view(t)), f"{n}: frames do not rebuild it bit-exactly"


def check_bootstrap(layout: Layout, seed: int, chunk: int) -> None:
    """``full_delta`` of every local tensor, projected: every canonical element exactly once, padding never."""
    rng = np.random.default_rng(seed)
    canon, pieces = layout.build(random_state(layout, rng), seed)
    by = owners(pieces)
    sent = {o: project_owner(ps, ps, chunk, bootstrap=True) for o, ps in by.items()}
    got = expand([td for tds in sent.values() for td in tds])
    assert set(got) == {n for n, t in canon.items() if t.numel()}
    for n, (pos, val, _) in got.items():
        assert len(pos) == canon[n].numel() == len(np.unique(pos)), f"{n}: not every element exactly once"
        assert (val == bits_view(canon[n])[pos]).all()
    for tds in sent.values():
        for td in tds:
            check_chunk_invariants(td, canon)
    check_frames(sent, canon, canon, layout.residual, mode="overwrite", zero_start=True)


def test_every_layout_kind_builds_local_tensors_that_its_specs_describe():
    """Each local tensor's cells, read back through the spec's boxes, are the canonical boxes' bits."""
    lays = [tp_split((6, 5), torch.bfloat16, 4, 1), fsdp((3, 4), torch.float32, 8, True), fsdp_x_tp((9, 6), torch.bfloat16, 3, 2, 1),
            qkv(8, 2, 2, 3, 2, True, torch.bfloat16, True), gate_up(4, 3, 2, torch.bfloat16),
            experts(4, 4, 3, 2, True, 2, False, torch.bfloat16), vocab(10, 3, 4, 4, torch.bfloat16),
            replicated((7,), torch.bfloat16, 3), transposed((5, 7), torch.bfloat16, 2), pipeline(3, (2, 2), torch.bfloat16, 2),
            norm_minus_one((8,), 2)]
    for lay in lays:
        rng = np.random.default_rng(0)
        canon, pieces = lay.build(random_state(lay, rng), 0)
        for p in pieces:
            for _, starts, ext, t in p.spec.cell_boxes():
                if t is None:
                    continue
                cell = p.tensor[tuple(slice(a, a + n) for a, n in zip(starts, ext))].contiguous()
                idx = np.asarray(t.base + sum(
                    torch.arange(n).reshape([-1 if d == k else 1 for k in range(len(ext))]) * s
                    for d, (n, s) in enumerate(zip(ext, t.strides))))
                flat = bits_view(canon[t.name].contiguous())
                assert np.array_equal(bits_view(cell), flat[idx.reshape(-1)]), (lay.kind, p.local)
