"""What an owner hands over: local tensors, each with the spec that maps it to canonical tensors.

``dcr_tensors()`` returns a mapping whose values may be

* a plain tensor: the whole canonical tensor of that name (data-parallel replicas, the embedded toys);
* a ``torch.distributed`` DTensor (FSDP2 ``fully_shard``, ``parallelize_module``): its local tensor,
  mapped by its placements (:func:`~dcr_ray.sharding.layouts.from_dtensor`), nothing gathered;
* a :class:`Shard`: any local tensor with an explicit :class:`~dcr_ray.sharding.spec.ShardSpec`
  (fused QKV, gate/up, stacked experts, padded vocab, residual conversions), keyed by a local name.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Mapping, NamedTuple

from dcr_ray.sharding.layouts import from_dtensor
from dcr_ray.sharding.spec import ShardSpec, ShardSpecError

if TYPE_CHECKING:  # annotations only: torch is imported where it runs
    import torch


class Shard(NamedTuple):
    """A local tensor and how it maps onto canonical tensors."""

    tensor: torch.Tensor
    spec: ShardSpec


def _dtensor_type():
    """torch's DTensor class, or None in a torch build without distributed."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def _is_dtensor(t) -> bool:
    global _DTENSOR
    if _DTENSOR is False:
        _DTENSOR = _dtensor_type()
    return _DTENSOR is not None and isinstance(t, _DTENSOR)


_DTENSOR = False  # not looked up yet


@functools.lru_cache(maxsize=1 << 20)
def _direct(name: str, shape: tuple[int, ...]) -> ShardSpec:
    """The direct spec of a plain tensor (specs are immutable: one per (name, shape), built and checked
    once, not on every refit of a model with 10^5 tensors)."""
    return ShardSpec.direct(name, shape)


def resolve_shards(tensors: Mapping[str, object], *, to_host: bool = True) -> dict[str, Shard]:
    """Local name -> :class:`Shard` for every value ``dcr_tensors()`` returned (see the module docstring).

    DTensor replicas that own no part of a replicated tensor are left out. With ``to_host`` shards on a
    GPU are copied to host memory whole; owners with a device baseline
    (:mod:`~dcr_ray.sharding.device`) pass ``False`` and copy only the changes.
    """
    import torch

    out: dict[str, Shard] = {}
    for name, t in tensors.items():
        if isinstance(t, Shard):
            if tuple(t.tensor.shape) != t.spec.local_shape:
                raise ShardSpecError(f"{name}: tensor shape {tuple(t.tensor.shape)} differs from its spec's "
                                     f"local shape {t.spec.local_shape}")
            out[name] = t
        elif _is_dtensor(t):
            share = from_dtensor(name, t)
            if share is not None:
                out[name] = Shard(share[0], share[1])
        elif isinstance(t, torch.Tensor):
            out[name] = Shard(t, _direct(name, tuple(t.shape)))
        else:
            raise ShardSpecError(f"dcr_tensors()[{name!r}] is a {type(t).__name__}: give a torch.Tensor, a "
                                 f"DTensor or a dcr_ray.sharding.Shard(tensor, spec)")
    if not to_host:
        return out
    return {n: sh if sh.tensor.device.type == "cpu" else Shard(sh.tensor.detach().cpu(), sh.spec)
            for n, sh in out.items()}


def canonical_specs(shards: Mapping[str, Shard], dtype_of) -> dict[str, tuple]:
    """What an owner declares at attach: canonical name -> (wire dtype, shape) when it owns the whole
    tensor through one direct local tensor, else (wire dtype, shape, [(start, stop), ...])."""
    out: dict[str, tuple] = {}
    for local, sh in shards.items():
        dt = dtype_of(sh.tensor.dtype)
        shapes = {t.name: t.shape for t in sh.spec.cells if t is not None}
        for box in sh.spec.boxes():
            prev = out.get(box.name)
            boxes = [] if prev is None else list(prev[2])
            if prev is not None and prev[0] != dt:
                raise ShardSpecError(f"{box.name}: local tensors of one owner give it two dtypes ({prev[0]}, {dt})")
            out[box.name] = (dt, shapes[box.name], boxes + [(box.start, box.stop)])
    for n, (dt, shape, boxes) in list(out.items()):
        if len(boxes) == 1 and boxes[0] == ((0,) * len(shape), tuple(shape)):
            out[n] = (dt, tuple(shape))
    return out


__all__ = ["Shard", "canonical_specs", "resolve_shards"]
