"""Training shards as owners: local tensors mapped onto canonical (checkpoint) coordinates, no gather.

* :mod:`.spec`      :class:`ShardSpec`: a grid of cells, each an affine map onto a canonical tensor
* :mod:`.layouts`   specs of the layouts trainers use (DTensor, row slices with padding, fused QKV,
  fused gate/up, stacked experts)
* :mod:`.local`     :class:`Shard` and how ``dcr_tensors()`` values resolve to shards
* :mod:`.project`   a local changed set projected to canonical changed sets, vectorized
* :mod:`.coverage`  per-element ownership across owners (boxes tile every tensor exactly once)
* :mod:`.flat`      flat ranges: 1-D shards that are a contiguous run of a tensor's elements (veRL, FSDP1)
* :mod:`.digest`    digests of canonical boxes from either side (an owner's shard, an engine's tensors)
* :mod:`.device`    device-resident baselines: GPU shards diffed where they live, only changes cross to host
"""

from typing import TYPE_CHECKING

from dcr_ray.lazy import exports
# ``project`` names a submodule too, so it is bound here, as it always was (numpy only: no torch)
from dcr_ray.sharding.project import project, project_all

#: Public name -> the submodule that defines it, imported on first use (the specs need torch; the
#: coordinator reads coverage alone).
_EXPORTS = {
    "check_tiling": "coverage", "flat_range": "flat", "flat_shards": "flat", "experts_from_dtensor": "layouts",
    "from_dtensor": "layouts", "fused_gate_up": "layouts", "fused_qkv": "layouts", "replicated_share": "layouts",
    "row_slice": "layouts", "stacked_experts": "layouts", "Shard": "local", "canonical_specs": "local",
    "resolve_shards": "local", "Box": "spec", "ShardSpec": "spec", "ShardSpecError": "spec", "Target": "spec",
    "box_target": "spec",
}
__all__ = [
    "Box", "Shard", "ShardSpec", "ShardSpecError", "Target", "box_target", "canonical_specs", "check_tiling",
    "experts_from_dtensor", "from_dtensor", "fused_gate_up", "fused_qkv", "project", "project_all", "replicated_share",
    "resolve_shards", "row_slice", "stacked_experts",
]
__getattr__, __dir__ = exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what static tools see
    from dcr_ray.sharding.coverage import check_tiling
    from dcr_ray.sharding.flat import flat_range, flat_shards  # noqa: F401  (flat 1-D shards, veRL-style)
    from dcr_ray.sharding.layouts import (experts_from_dtensor, from_dtensor, fused_gate_up, fused_qkv,
                                          replicated_share, row_slice, stacked_experts)
    from dcr_ray.sharding.local import Shard, canonical_specs, resolve_shards
    from dcr_ray.sharding.spec import Box, ShardSpec, ShardSpecError, Target, box_target
