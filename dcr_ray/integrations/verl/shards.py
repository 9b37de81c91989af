"""veRL's weight exports as dcr_ray shards, on each trainer rank, with no gather.

veRL hands a checkpoint engine one of two streams:

* ``get_per_tensor_param_shard()`` triples ``(name, local_flat_shard, ShardSpec)`` (FSDP, veomni,
  Megatron); the spec (:mod:`verl.workers.engine.spec`) says where the local shard sits:

  - ``place`` (an explicit override): an ``int`` is a flat offset — the shard is canonical flat elements
    ``[place, place + numel)``, projected by :func:`dcr_ray.sharding.flat.flat_shards` (at most ``2n - 1``
    flat-contiguous boxes, views of the shard) — or a ``BlockPlacement``: a box at ``global_offset``;
    ``contributes=False`` marks a replica that sends nothing;
  - ``mesh`` + ``placements`` (DTensor vocabulary): veRL's own ``derive_dtensor_placement`` gives the
    block and whether this rank contributes (one rank per replicated block), and the block maps as above
    (a dim-0 cut such as FSDP2 ``Shard(0)`` is a flat range; any other cut is a box of
    ``local_shape``);
  - neither: every rank holds the whole tensor; ranks split such tensors among themselves by a stable
    hash of the name (:func:`dcr_ray.actors.owner.delta.owned_names`), so each has one owner;
  - ``hf_slots`` without ``to_hf_chunk``: row ``e`` of the logical tensor *is* HF tensor
    ``hf_slots[e]`` (stacked experts), so each local row maps whole onto its slot;
  - ``to_hf_chunk``: a converter of whole dim-0 rows to HF tensors (veomni's fused expert stacks): the
    rank converts its own rows and sends the results as residual (always OVERWRITE) tensors.

* ``get_per_tensor_param()`` pairs ``(name, tensor)``: a DTensor is mapped by its placements; a plain
  tensor is the whole parameter, split among ranks by name hash as above.

:func:`shards_from_verl` turns either stream into what an owner's ``dcr_tensors()`` returns.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from dcr_ray.actors.owner.delta import stable_hash
from dcr_ray.errors import ConfigError
from dcr_ray.sharding import Shard, ShardSpec, from_dtensor
from dcr_ray.sharding.flat import flat_shards

log = logging.getLogger(__name__)


def _dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def _host(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rollout-dtype host copy of a local tensor (a local cast; no communication)."""
    t = t.detach()
    if t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
    return t.cpu() if t.device.type != "cpu" else t


def _mine(name: str, rank: int, world: int) -> bool:
    return stable_hash(name) % max(world, 1) == rank


def _block(name: str, local: torch.Tensor, full_shape: tuple, place) -> dict[str, Any]:
    """Shards of a local shard at ``place``: an int flat offset or a veRL ``BlockPlacement``."""
    if isinstance(place, int):
        return flat_shards(name, local, full_shape, place)
    local_shape, offset = tuple(int(n) for n in place.local_shape), tuple(int(o) for o in place.global_offset)
    if local.numel() == 0:
        return {}
    if all(lo == fu for lo, fu in zip(local_shape[1:], full_shape[1:])):  # a dim-0 cut: one flat range
        inner = 1
        for n in full_shape[1:]:
            inner *= int(n)
        return flat_shards(name, local, full_shape, offset[0] * inner)
    return {name: Shard(local.reshape(local_shape), ShardSpec.box(name, full_shape, offset, local_shape))}


def _rows(name: str, local: torch.Tensor, full_shape: tuple, place) -> tuple[int, torch.Tensor]:
    """(first row, local rows) of a shard that holds whole dim-0 rows (what slot and converter specs need)."""
    inner = 1
    for n in full_shape[1:]:
        inner *= int(n)
    if isinstance(place, int):
        start = place
    elif place is None or place == 0:
        start = 0
    else:
        if any(int(o) for o in place.global_offset[1:]) or \
                tuple(place.local_shape[1:]) != tuple(full_shape[1:]):
            raise ConfigError(f"{name}: a spec with hf_slots/to_hf_chunk must cut dimension 0 only (whole rows "
                              f"per rank), got a block at {tuple(place.global_offset)} of {tuple(place.local_shape)}")
        start = int(place.global_offset[0]) * inner
    if inner == 0 or start % inner or local.numel() % inner:
        raise ConfigError(f"{name}: a spec with hf_slots/to_hf_chunk must hold whole rows of {tuple(full_shape)}; "
                          f"this rank holds flat elements [{start}, {start + local.numel()})")
    return start // inner, local.reshape(local.numel() // inner, *full_shape[1:])


def _from_triple(name: str, local: torch.Tensor, spec, rank: int, world: int, dtype: torch.dtype) -> dict[str, Any]:
    full_shape = tuple(int(n) for n in spec.full_shape)
    if local.numel() == 0:
        return {}
    if spec.place is not None:
        place, contributes = spec.place, bool(spec.contributes)
    elif spec.mesh is not None:
        from verl.workers.engine.spec import derive_dtensor_placement

        place, contributes, _ = derive_dtensor_placement(spec)
    else:
        place, contributes = None, _mine(name, rank, world)
    if not contributes:
        return {}
    local = _host(local, dtype)
    if spec.to_hf_chunk is not None:  # converter: this rank's rows -> HF tensors, sent as residual
        row0, rows = _rows(name, local, full_shape, place)
        out = {}
        for hf_name, hf in spec.to_hf_chunk(row0, rows):
            hf = _host(hf, dtype).contiguous()
            out[hf_name] = Shard(hf, ShardSpec.residual(hf_name, tuple(hf.shape)))
        return out
    if spec.hf_slots is not None:  # identity split: row e is HF tensor hf_slots[e]
        row0, rows = _rows(name, local, full_shape, place)
        out = {}
        for i in range(rows.shape[0]):
            hf_name, hf_shape = spec.hf_slots[row0 + i]
            hf_shape = tuple(int(n) for n in hf_shape)
            out[hf_name] = Shard(rows[i].reshape(hf_shape), ShardSpec.direct(hf_name, hf_shape))
        return out
    if place is None or (isinstance(place, int) and place == 0 and local.numel() == _numel(full_shape)):
        return {name: local.reshape(full_shape)}
    return _block(name, local, full_shape, place)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def shards_from_verl(items: Iterable[tuple], *, rank: int, world: int, dtype: torch.dtype = torch.bfloat16,
                     names: set[str] | None = None) -> tuple[dict[str, Any], list[str]]:
    """What this rank owns of veRL's export ``items`` (triples or pairs, see the module docstring):
    ``(dcr_tensors mapping, dropped)``.

    ``names``: the canonical tensors the rollout holds (its checkpoint's); tensors outside it (a tied
    ``lm_head.weight`` the checkpoint does not store) are left out and listed in ``dropped``. The values
    are host tensors in ``dtype`` (views of each local shard where the layout allows).
    """
    out: dict[str, Any] = {}
    dropped: list[str] = []
    seen: set[str] = set()
    for item in items:
        if len(item) == 3:
            name, local, spec = item
            if not hasattr(spec, "full_shape"):
                raise ConfigError(f"{name}: a triple's third element must be veRL's ShardSpec, got "
                                  f"{type(spec).__name__}")
            got = _from_triple(name, local, spec, rank, world, dtype)
        elif len(item) == 2:
            name, t = item
            if _dtensor(t):  # this rank's share by its placements (replicas split replicated boxes)
                share = from_dtensor(name, t.detach())
                got = {} if share is None else {name: Shard(_host(share[0], dtype), share[1])}
            elif isinstance(t, torch.Tensor):
                got = {name: _host(t, dtype)} if _mine(name, rank, world) else {}
            else:
                raise ConfigError(f"{name}: veRL exported a {type(t).__name__}, expected a tensor")
        else:
            raise ConfigError(f"veRL's weight export yields (name, tensor) or (name, local_shard, ShardSpec), "
                              f"got a {len(item)}-tuple")
        if name in seen:
            raise ConfigError(f"veRL's export yields {name!r} twice: each tensor must appear once per rank")
        seen.add(name)
        for key, value in got.items():
            canon = value.spec.names if isinstance(value, Shard) else (key,)
            if names is not None and not set(canon) <= names:
                dropped.append(key)
                continue
            out[key] = value
    if dropped:
        log.info("rank %d: %d exported tensors are not in the rollout checkpoint and are not sent: %s", rank,
                 len(dropped), dropped[:8])
    return out, dropped


def declared_boxes(mapping: dict[str, Any]) -> dict[str, tuple]:
    """Local key -> the canonical boxes ``(name, start, stop)`` its shard covers (metadata only)."""
    from dcr_ray.sharding import resolve_shards

    return {k: tuple((b.name, tuple(b.start), tuple(b.stop)) for b in sh.spec.boxes())
            for k, sh in resolve_shards(mapping, to_host=False).items()}


def replica_exclusions(per_rank: list[dict[str, tuple]]) -> list[set[str]]:
    """Which local keys each rank must leave out so that every block held by several ranks has one owner.

    A DTensor on a sub-mesh (FSDP over the data-parallel ranks of a tensor-parallel grid, HSDP replica
    groups) does not say which other ranks hold copies of its block, so each such rank maps it as its
    own. ``per_rank[r]`` is rank r's :func:`declared_boxes`; blocks declared identically by several ranks
    are kept by one of them (chosen by a stable hash of the key, so the work spreads), excluded from the
    others. Partial overlaps are left for the coverage check at launch, which names them.
    """
    holders: dict[tuple, list[int]] = {}
    for r, boxes in enumerate(per_rank):
        for key, bx in boxes.items():
            holders.setdefault((key, bx), []).append(r)
    out: list[set[str]] = [set() for _ in per_rank]
    for (key, _), ranks in holders.items():
        if len(ranks) > 1:
            keep = ranks[stable_hash(key) % len(ranks)]
            for r in ranks:
                if r != keep:
                    out[r].add(key)
    return out


__all__ = ["declared_boxes", "replica_exclusions", "shards_from_verl"]
