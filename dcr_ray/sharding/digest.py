"""Digests of canonical boxes, computed from either side: an owner's local shard or an engine's tensors.

A replacement owner proves it holds the committed version by digest: for every cell of every local
tensor it hashes the cell's bits in the *canonical* element order of the box the cell covers
(:func:`shard_digests`); an engine hashes the same boxes of its canonical tensors
(:func:`box_digests`). Equal digests for every box: the owner's tensors are the committed bits.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Iterable, Mapping

from dcr_ray.codec.bits import bits_view
from dcr_ray.sharding.spec import Box, ShardSpec, _target_box

if TYPE_CHECKING:  # annotations only: torch is imported where it runs
    import torch

BoxKey = tuple[str, tuple[int, ...], tuple[int, ...]]


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(bits_view(t.contiguous()).tobytes(), digest_size=16).hexdigest()


def _canonical_block(local: torch.Tensor, starts, ext, target) -> tuple[Box, torch.Tensor]:
    """The cell's block of ``local``, its dimensions reordered to the canonical box's order."""
    box = _target_box(target, ext)
    block = local[tuple(slice(a, a + n) for a, n in zip(starts, ext))]
    # local dims with extent > 1 run along canonical dims; order them as the canonical dims
    dims = [d for d, n in enumerate(ext) if n > 1]
    order = sorted(dims, key=lambda d: -target.strides[d])  # larger stride: outer canonical dim
    block = block.permute(*order, *[d for d in range(len(ext)) if d not in dims])
    return box, block.reshape(tuple(b - a for a, b in zip(box.start, box.stop)))


def shard_digests(shards: Mapping[str, tuple[torch.Tensor, ShardSpec]]) -> dict[BoxKey, str]:
    """Digest of every canonical box an owner's local tensors cover (padding excluded)."""
    out: dict[BoxKey, str] = {}
    for tensor, spec in shards.values():
        for _, starts, ext, t in spec.cell_boxes():
            if t is None:
                continue
            box, block = _canonical_block(tensor, starts, ext, t)
            out[(box.name, box.start, box.stop)] = _digest(block)
    return out


def box_digests(tensors: Mapping[str, torch.Tensor], boxes: Iterable[BoxKey]) -> dict[BoxKey, str]:
    """Digest of each box ``(name, start, stop)`` of canonical ``tensors`` (an engine's side)."""
    out = {}
    for name, start, stop in boxes:
        t = tensors[name]
        block = t[tuple(slice(a, b) for a, b in zip(start, stop))] if t.dim() else t
        out[(name, tuple(start), tuple(stop))] = _digest(block)
    return out


__all__ = ["BoxKey", "box_digests", "shard_digests"]
