"""An engine's membership by digest: prove which committed bits it holds without moving them.

A replacement owner is checked against :meth:`Digests.box_digests` of a settled engine; an adopted
engine that already serves the committed version joins through :meth:`Digests.join_by_digest` instead of
a dense bootstrap; one whose weights changed outside dcr_ray is told so (:meth:`Digests.invalidate`) and
holds no version until it heals. A part of :class:`~dcr_ray.actors.engine.actor.EngineActor`, handed the
engine's shared state (:class:`~dcr_ray.actors.engine.context.EngineContext`) and the receiver whose
open attempt an invalidation closes.
"""

from __future__ import annotations

from dcr_ray.actors.engine.context import EngineContext
from dcr_ray.actors.engine.receive import Receiver
from dcr_ray.engines.base import readable_tensors
from dcr_ray.errors import EngineStateError


class Digests:
    """``box_digests``, ``invalidate`` and ``join_by_digest`` of one engine."""

    def __init__(self, ctx: EngineContext, receiver: Receiver):
        self._engine = ctx
        self._receiver = receiver

    def box_digests(self, boxes: list) -> dict:
        """Digests of canonical boxes ``(name, start, stop)`` of this engine's committed bits (a
        replacement owner is checked against them); refused while a transfer is open or the engine is dirty."""
        from dcr_ray.sharding.digest import box_digests

        c = self._engine
        with c.lock:
            if not c.state.settled:
                raise EngineStateError(f"engine {c.engine_id} holds no settled version to digest")
            return {"version": c.state.version, "digests": box_digests(readable_tensors(c.backend), boxes)}

    def invalidate(self, why: str) -> None:
        """Hold no version: this engine's weights changed outside dcr_ray (``why``; e.g. a vLLM sleep at
        level 2 discarded them, or its owner reloaded them). It refuses deltas and generation until it
        heals (by digest, when its bits turn out to be the committed ones after all, else densely); an
        update it held open is closed unapplied."""
        c = self._engine
        with c.lock:
            if c.state.attempt is not None:
                self._receiver.abort(c.state.attempt.transfer)
            c.mark_dirty(f"invalidated: {why}")
            c.count("invalidated")

    def join_by_digest(self, version: int, digests: dict, version_id: str | None = None) -> bool:
        """Join at committed ``version`` without a dense bootstrap if the backend shows, by the owners'
        box ``digests``, that it already serves it (:meth:`EngineBackend.matches_digests`). False (the
        coordinator then bootstraps densely) when it does not, cannot tell, or a transfer is open."""
        c = self._engine
        with c.lock:
            if c.state.paused or c.state.attempt is not None:
                return False
            if c.backend.matches_digests(version, digests) is not True:  # None: this backend cannot tell
                return False
            c.become_ready(version, version_id, counter="joined_by_digest", verified=True)
            return True
