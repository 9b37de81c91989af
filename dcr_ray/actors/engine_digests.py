"""An engine's membership by digest: prove which committed bits it holds without moving them.

A replacement owner is checked against :meth:`DigestMembership.box_digests` of a settled engine; an
adopted engine that already serves the committed version joins through
:meth:`DigestMembership.join_by_digest` instead of a dense bootstrap; one whose weights changed outside
dcr_ray is told so (:meth:`DigestMembership.invalidate`) and holds no version until it heals. A mixin of
:class:`~dcr_ray.actors.engine.EngineActor` (it uses the engine's lock, its backend and its
:class:`~dcr_ray.actors.engine_state.EngineState`, changed only through its transitions).
"""

from __future__ import annotations

from dcr_ray.errors import EngineStateError


class DigestMembership:
    """``box_digests`` and ``join_by_digest`` of an engine actor."""

    def box_digests(self, boxes: list) -> dict:
        """Digests of canonical boxes ``(name, start, stop)`` of this engine's committed bits (a
        replacement owner is checked against them); refused while a transfer is open or the engine is dirty."""
        from dcr_ray.sharding.digest import box_digests

        with self._cv:
            if not self._st.settled:
                raise EngineStateError(f"engine {self.engine_id} holds no settled version to digest")
            return {"version": self.version, "digests": box_digests(self.backend.tensors(), boxes)}

    def invalidate(self, why: str) -> dict:
        """Hold no version: this engine's weights changed outside dcr_ray (``why``; e.g. a vLLM sleep at
        level 2 discarded them, or its owner reloaded them). It refuses deltas and generation until it
        heals (by digest, when its bits turn out to be the committed ones after all, else densely); an
        update it held open is closed unapplied. Returns :meth:`state`."""
        with self._cv:
            if self._st.attempt is not None:
                self._st.close(self._st.attempt.transfer)
            self._staged = []
            self._mark_dirty(f"invalidated: {why}")
            self._stats["invalidated"] = self._stats.get("invalidated", 0) + 1
            self._cv.notify_all()
        return self.state()

    def join_by_digest(self, version: int, digests: dict, version_id: str | None = None) -> bool:
        """Join at committed ``version`` without a dense bootstrap if the backend shows, by the owners'
        box ``digests``, that it already serves it (:meth:`EngineBackend.matches_digests`). False (the
        coordinator then bootstraps densely) when it does not, cannot tell, or a transfer is open."""
        with self._cv:
            if self._st.paused:
                return False
            if self.backend.matches_digests(version, digests) is not True:  # None: this backend cannot tell
                return False
            self._st.activate(version, version_id)
            self._applied.clear()
            self._undo.clear()
            self.backend.activate(version)
            self._stats["joined_by_digest"] = self._stats.get("joined_by_digest", 0) + 1
            self._cv.notify_all()
            return True
