"""Shard specs of the layouts trainers use: DTensor placements, row slices with vocab padding, fused QKV
with grouped-query heads, fused gate/up, stacked expert slices.

Each function returns a :class:`~dcr_ray.sharding.spec.ShardSpec` for one local tensor; the names are
the canonical (checkpoint) names the engines load. Cells run along local dimension 0 unless said, so
projection cost is one binary search per change.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Sequence

from dcr_ray.sharding.spec import ShardSpec, ShardSpecError, Target, box_target

if TYPE_CHECKING:  # annotations only: torch is imported where it runs
    import torch


def _rows(local_shape: tuple[int, ...], parts: Sequence[tuple[int, Target | None]]) -> ShardSpec:
    """A spec whose cells are consecutive runs of rows (local dim 0): ``parts`` = (rows, target)."""
    if sum(n for n, _ in parts) != local_shape[0]:
        raise ShardSpecError(f"the parts cover {sum(n for n, _ in parts)} rows of a local tensor with "
                             f"{local_shape[0]}")
    cuts, at = [], 0
    for n, _ in parts[:-1]:
        at += n
        cuts.append(at)
    empty = [i for i, (n, _) in enumerate(parts) if n == 0]
    if empty:
        raise ShardSpecError(f"parts {empty} have no rows")
    return ShardSpec(tuple(local_shape), tuple(t for _, t in parts), (tuple(cuts),) + ((),) * (len(local_shape) - 1))


def row_slice(name: str, canonical_shape: tuple[int, ...], row_start: int, local_shape: tuple[int, ...],
              *, col_offset: tuple[int, ...] = ()) -> ShardSpec:
    """Rows ``[row_start, row_start + local_rows)`` of ``name``; rows past the canonical tensor are padding
    (vocab-parallel embeddings and LM heads padded to a multiple of the TP size).

    ``col_offset``: offsets of the other dimensions (a 2-D shard of a row- and column-split tensor).
    """
    canonical_shape, local_shape = tuple(canonical_shape), tuple(local_shape)
    rest = tuple(col_offset) or (0,) * (len(canonical_shape) - 1)
    real = max(0, min(local_shape[0], canonical_shape[0] - row_start))
    parts: list[tuple[int, Target | None]] = []
    if real:
        parts.append((real, box_target(name, canonical_shape, (row_start, *rest))))
    if real < local_shape[0]:
        parts.append((local_shape[0] - real, None))
    return _rows(local_shape, parts)


def from_dtensor(name: str, t: torch.Tensor) -> tuple[torch.Tensor, ShardSpec] | None:
    """This rank's share of DTensor ``t`` (a view of its local tensor) and the spec mapping it to ``name``.

    The local tensor is the box torch's checkpointing computes from the placements (``Shard``,
    FSDP2's strided shards, ``Replicate``). Ranks that hold the same box (``Replicate`` mesh
    dimensions) split it by rows so each element has one owner, balanced by bytes; a rank whose part
    is empty returns None. Nothing is gathered.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, t.placements
    local = t.to_local()
    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    if tuple(shape) != tuple(local.shape):
        raise ShardSpecError(f"{name}: DTensor local shape {tuple(local.shape)} differs from its placements' "
                             f"{tuple(shape)} (padded shards are not supported; use Shard on an evenly sized dim)")
    coord = mesh.get_coordinate()
    rep_dims = [i for i, p in enumerate(placements) if isinstance(p, Replicate)]
    n_rep = math.prod(mesh.size(i) for i in rep_dims) if rep_dims else 1
    r = 0
    for i in rep_dims:
        r = r * mesh.size(i) + coord[i]
    # a DTensor on a sub-mesh (FSDP2 over "dp" of a dp x tp mesh) is replicated along the root mesh's
    # other dimensions: those ranks hold the same box too
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    if root is not mesh and root.mesh_dim_names and mesh.mesh_dim_names:
        rc = root.get_coordinate()
        for i, d in enumerate(root.mesh_dim_names):
            if d not in mesh.mesh_dim_names:
                r = r * root.size(i) + rc[i]
                n_rep *= root.size(i)
    return replicated_share(name, tuple(t.shape), tuple(offset), local, r, n_rep)


def replicated_share(name: str, canonical_shape: tuple[int, ...], offset: tuple[int, ...], local: torch.Tensor,
                     replica: int, replicas: int) -> tuple[torch.Tensor, ShardSpec] | None:
    """Replica ``replica`` of ``replicas`` identical copies of the box of ``name`` at ``offset``: its rows
    (the i-th of ``torch.tensor_split``'s near-equal parts), or the whole box for replica 0 of a scalar.
    An empty box (FSDP2's empty last shards when a dimension has fewer rows than ranks) has no part."""
    if local.numel() == 0:
        return None
    if local.dim() == 0 or replicas == 1:
        if replica:
            return None
        return local, ShardSpec.box(name, canonical_shape, offset, tuple(local.shape))
    rows = local.shape[0]
    lo = replica * rows // replicas
    hi = (replica + 1) * rows // replicas
    if hi == lo:
        return None
    part = local[lo:hi]
    return part, ShardSpec.box(name, canonical_shape, (offset[0] + lo, *offset[1:]), tuple(part.shape))


def fused_qkv(local_shape: tuple[int, ...], q: str, k: str, v: str, *, num_heads: int, num_kv_heads: int,
              head_dim: int, tp_rank: int = 0, tp_size: int = 1, interleaved: bool = True) -> ShardSpec:
    """A tensor-parallel shard of a fused QKV weight (or bias) with grouped-query attention.

    ``interleaved`` (Megatron): per KV group, its query heads, then its key head, then its value head.
    Otherwise (vLLM's ``qkv_proj``): this rank's query rows, then key rows, then value rows. Ranks split
    the KV groups evenly.
    """
    if num_heads % num_kv_heads or num_kv_heads % tp_size:
        raise ShardSpecError(f"fused_qkv needs num_heads ({num_heads}) divisible by num_kv_heads "
                             f"({num_kv_heads}) and num_kv_heads divisible by tp_size ({tp_size})")
    rest = tuple(local_shape[1:])
    qpg = num_heads // num_kv_heads
    groups = num_kv_heads // tp_size
    g0 = tp_rank * groups
    qs, ks = (num_heads * head_dim, *rest), (num_kv_heads * head_dim, *rest)
    z = (0,) * len(rest)

    def tq(g, n=1):
        return (qpg * head_dim * n, box_target(q, qs, (g * qpg * head_dim, *z)))

    def tk(name, g, n=1):
        return (head_dim * n, box_target(name, ks, (g * head_dim, *z)))

    if interleaved:
        parts = [p for g in range(g0, g0 + groups) for p in (tq(g), tk(k, g), tk(v, g))]
    else:
        parts = [tq(g0, groups), tk(k, g0, groups), tk(v, g0, groups)]
    return _rows(tuple(local_shape), parts)


def fused_gate_up(local_shape: tuple[int, ...], gate: str, up: str, *, intermediate: int, tp_rank: int = 0,
                  tp_size: int = 1) -> ShardSpec:
    """A tensor-parallel shard of a fused gate/up weight: this rank's gate rows, then its up rows."""
    if intermediate % tp_size:
        raise ShardSpecError(f"fused_gate_up needs intermediate ({intermediate}) divisible by tp_size ({tp_size})")
    n = intermediate // tp_size
    rest = tuple(local_shape[1:])
    shape = (intermediate, *rest)
    at = (tp_rank * n, *(0,) * len(rest))
    return _rows(tuple(local_shape), [(n, box_target(gate, shape, at)), (n, box_target(up, shape, at))])


def stacked_experts(local_shape: tuple[int, ...], names: Callable[[int], str | Sequence[str]], *,
                    first_expert: int = 0, canonical_shape: tuple[int, ...] | None = None,
                    inner_offset: tuple[int, ...] | None = None) -> ShardSpec:
    """An expert-parallel slice of a stacked expert tensor ``[local experts, ...]`` onto per-expert tensors.

    ``names(e)`` is the canonical name of global expert ``e`` or, for a fused stack (transformers'
    ``gate_up_proj``), the names its dimension 1 splits into equally (``(gate_e, up_e)``).
    ``canonical_shape``/``inner_offset``: the per-expert tensor's shape and this shard's offset in it
    (tensor parallelism inside experts); by default each expert's block is a whole canonical tensor.
    """
    local_shape = tuple(local_shape)
    e_local, inner = local_shape[0], local_shape[1:]
    first = names(first_expert)
    parts = 1 if isinstance(first, str) else len(first)
    if inner[0] % parts:
        raise ShardSpecError(f"dimension 1 ({inner[0]}) does not split into {parts} equal parts")
    block = (inner[0] // parts, *inner[1:])
    cshape = tuple(canonical_shape) if canonical_shape else block
    off = tuple(inner_offset) if inner_offset else (0,) * len(cshape)
    cells = []
    for e in range(first_expert, first_expert + e_local):
        ns = names(e)
        ns = (ns,) if isinstance(ns, str) else tuple(ns)
        cells += [box_target(n, cshape, off, local_ndim=len(local_shape)) for n in ns]
    cuts = (tuple(range(1, e_local)), tuple(block[0] * i for i in range(1, parts))) + ((),) * (len(local_shape) - 2)
    return ShardSpec(local_shape, tuple(cells), cuts)


def experts_from_dtensor(t: torch.Tensor,
                         names: Callable[[int], str | Sequence[str]]) -> tuple[torch.Tensor, ShardSpec] | None:
    """This rank's share of a stacked expert DTensor (``[experts, ...]``, e.g. transformers'
    ``mlp.experts.gate_up_proj`` sharded by FSDP2 or expert parallelism along the experts) as a
    :func:`stacked_experts` spec onto the per-expert checkpoint tensors ``names(e)``."""
    share = from_dtensor("stacked experts", t)
    if share is None:
        return None
    local, spec = share
    (box,) = spec.boxes()
    if any(box.start[1:]) or tuple(box.stop[1:]) != tuple(t.shape[1:]):
        raise ShardSpecError("experts sharded inside an expert (tensor parallel experts): give explicit "
                             "stacked_experts(..., canonical_shape=, inner_offset=) specs")
    return local, stacked_experts(tuple(local.shape), names, first_expert=box.start[0])


__all__ = ["experts_from_dtensor", "from_dtensor", "fused_gate_up", "fused_qkv", "replicated_share", "row_slice",
           "stacked_experts"]
