"""Where a healing engine's bits come from: what it holds, the missed deltas its cluster's catch-up window
kept, and the peer that can hand the committed version over.

:class:`~dcr_ray.actors.recovery.healing.Healing` asks these in each round of a heal, under the
coordinator's lock, in its order of preference (the deltas it missed, a peer of its cluster, a peer of
another cluster, the owners). They read the coordinator's shared state
(:class:`~dcr_ray.actors.fleet.state.CoordinatorState`) and the engines, and change nothing but an
abandoned transfer's writes an engine still holds, which :func:`held` rolls back first.
"""

from __future__ import annotations

import logging

import ray

from dcr_ray.actors.fleet.state import CoordinatorState

log = logging.getLogger("dcr_ray")


def held(state: CoordinatorState, e: str, timeout_s: float) -> tuple[tuple | None, dict]:
    """``((version, content id) engine ``e`` holds settled, or None (no version, or dirty), its state)``.
    Writes of an abandoned transfer it still holds (evicted inside a refit) are rolled back in place first."""
    handle = state.engines[e]
    st = ray.get(handle.state.remote(), timeout=timeout_s)
    if st["transfer"] is not None and not st["dirty"]:
        ray.get(handle.abort.remote(st["transfer"], True), timeout=timeout_s)
        st = ray.get(handle.state.remote(), timeout=timeout_s)
    if st["dirty"] or st["version"] is None or st["transfer"] is not None:
        return None, st
    return (st["version"], st.get("version_id")), st


def window_steps(state: CoordinatorState, e: str, held: tuple | None, committed: tuple) -> list | None:
    """The committed steps from what ``e`` holds to ``committed``, from its cluster's catch-up window; None
    when the window does not cover it (or there is none)."""
    if held is None or held[0] > committed[0] or state.config.transport.catchup_window_bytes <= 0:
        return None
    try:
        steps = state.transport.window(state.topology.engine_cluster[e], *held)
    except Exception as err:  # the window is an optimisation: a peer or the owners still heal it
        log.warning("dcr_ray: reading the catch-up window for engine %s failed: %r", e, err)
        return None
    if not steps or (steps[-1].target, steps[-1].transfer) != committed:
        return None
    return steps


def same_cluster(state: CoordinatorState, e: str, peer: str) -> bool:
    cluster = state.topology.engine_cluster
    return cluster[e] == cluster[peer]


#: Missed steps that are always replayed, however large: replaying them costs what the refits that made
#: them cost the engines, so it keeps pace with refits where a dense copy may not (a heal then lands).
ALWAYS_REPLAY_STEPS = 2


def dense_is_smaller(state: CoordinatorState, e: str, steps: list) -> bool:
    """Whether a peer's dense copy moves fewer bytes than replaying ``steps`` (large learning rates: a few
    versions of deltas outweigh the model), counted beyond the last :data:`ALWAYS_REPLAY_STEPS`; an
    adopted engine cannot take a copy."""
    model = state.model_bytes  # 0 when unknown (a resumed coordinator): replay
    return (bool(model) and not state.topology.is_adopted(e) and len(steps) > ALWAYS_REPLAY_STEPS
            and sum(st.nbytes for st in steps) >= model)


def peer_for(state: CoordinatorState, e: str) -> str | None:
    """A required engine that can hand over its bits (dcr_ray started it): one of ``e``'s cluster, else one
    of another cluster (the whole cluster was lost: the copy crosses a cluster link once, as the owners'
    would, but off the trainer's clock and without holding up the refits)."""
    topology = state.topology
    cluster = topology.engine_cluster[e]
    ok = [p for p in sorted(state.required) if p != e and not topology.is_adopted(p)]
    ok.sort(key=lambda p: topology.engine_cluster[p] != cluster)  # its own cluster first
    return ok[0] if ok else None
