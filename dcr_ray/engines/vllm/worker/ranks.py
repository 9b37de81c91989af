"""How the workers of one tensor/pipeline-parallel vLLM engine agree on a weight-transfer call's outcome.

vLLM's multiprocessing executor reads a ``collective_rpc``'s replies rank by rank and raises at the first
rank that failed, leaving the later ranks' replies queued: every later call would read the answer to an
earlier one. A worker that raised its "no" on its own would put the engine out of step; one that never
raised would let ``finish_weight_update(weight_version)`` move the version label over an update that did
not happen. So, at world size >= 2, every call's outcome is agreed first:

1. each worker runs the call and keeps its own error (or none);
2. the workers all-gather those errors over vLLM's CPU process groups (tensor-parallel, then
   pipeline-parallel), so every rank knows every rank's outcome;
3. on any failure every rank acts alike: the update is reset on every rank, and vLLM's update session
   is closed on every rank;
4. only the **last** rank raises, with every failed rank's reason. The executor has read every other
   rank's (successful) reply by then, so the call raises for the caller, as vLLM's contract says, and
   the next call reads its own answers.

vLLM's worker closes its session when ``update_weights`` raises, and leaves it open when
``finish_weight_update`` raises; the other ranks return normally. So the backend closes the session
itself where vLLM's worker would not: it holds its worker (:func:`find_worker`, the ``self`` of the
``Worker.load_model`` frame that created the backend).

The Ray executor reads each rank's reply through its own object reference, so it was never out of step;
the same agreement gives it the same outcome.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Protocol


class EngineRanks(Protocol):
    """The workers of one vLLM engine, as the agreement sees them."""

    rank: int
    """This worker's position in the executor's reply order (0 .. size - 1)."""
    size: int
    """How many workers reply to one ``collective_rpc``."""

    def gather(self, item: Any) -> list[Any]:
        """Every worker's ``item``, indexed by rank (a collective: every worker calls it, in the same order)."""


class VllmRanks:
    """:class:`EngineRanks` over vLLM's tensor- and pipeline-parallel CPU groups (gloo)."""

    def __init__(self) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        self._groups = [g for g in (get_tp_group(), get_pp_group()) if g.world_size > 1]
        tp, pp = get_tp_group(), get_pp_group()
        self.rank = pp.rank_in_group * tp.world_size + tp.rank_in_group
        self.size = tp.world_size * pp.world_size

    def gather(self, item: Any) -> list[Any]:
        import torch.distributed as dist

        known = {self.rank: item}
        for group in self._groups:  # tensor-parallel peers first, then the pipeline stages' gathered sets
            parts: list[Any] = [None] * group.world_size
            dist.all_gather_object(parts, known, group=group.cpu_group)
            known = {r: v for part in parts for r, v in part.items()}
        return [known.get(r) for r in range(self.size)]


def vllm_ranks(world_size: int) -> EngineRanks | None:
    """This worker's :class:`VllmRanks`, or None where vLLM's model-parallel groups do not exist (one
    worker, or an engine built outside vLLM's worker) or do not span ``world_size`` workers."""
    if world_size <= 1:
        return None
    try:
        from vllm.distributed.parallel_state import model_parallel_is_initialized

        if not model_parallel_is_initialized():
            return None
        ranks = VllmRanks()
    except (ImportError, AssertionError, RuntimeError):
        return None
    return ranks if ranks.size == world_size else None


def find_worker(max_frames: int = 16) -> "weakref.ref[Any] | None":
    """A weak reference to the vLLM worker whose ``load_model`` is creating the caller (vLLM creates
    its weight-transfer engine there: ``Worker.load_model`` -> ``WeightTransferEngineFactory.create_engine``
    -> the backend's ``__init__``), found as the ``self`` of that frame; None when there is none."""
    frame = sys._getframe(1)
    for _ in range(max_frames):
        if frame is None:
            return None
        cand = frame.f_locals.get("self")
        if cand is not None and hasattr(cand, "_weight_update_active") and hasattr(cand, "model_runner"):
            return weakref.ref(cand)
        frame = frame.f_back
    return None
