"""Parking: an in-place engine that applied a refit serves its version while the refit waits on others.

In place, an engine's writes land in the weights it serves, so it stops serving from the first write
until the commit makes them its new version. Once its own flush is done (every payload applied), what
is left is waiting: for the slower clusters, for a retry after a node was lost elsewhere, for the
commit record. A cluster that is fine should not pay for that. So after ``EngineConfig.hold_s`` past
its flush, if the refit still has not activated, the engine *parks* (phase ``parked``): its undo
record swaps the applied writes out of the weights (the bits each write replaced go back, the written
bits are kept instead: :meth:`~dcr_ray.codec.decoding.undo.UndoLog.set_aside`, memory O(changes) as before), and
generation serves the committed version again. Activation writes them back (a second, short pause: the
same positions, no decode, no transfer); an abort drops them, nothing of the transfer being in the
weights any more.

Exactness: setting aside reads back every position an inverse writes before writing it, so writing the
reads back newest first returns each touched element to the bits the transfer's attempts left there,
whatever their overlaps. Only backends that hold readable tensors park (the undo record needs them).
"""

from __future__ import annotations

import threading
import time

from dcr_ray import failpoints
from dcr_ray.actors.engine.context import EngineContext
from dcr_ray.actors.engine.state import Phase
from dcr_ray.engines.base import TensorBackend
from dcr_ray.errors import EngineStateError


class Parking:
    """One engine's set-aside writes (at most one transfer's) and the timer that sets them aside."""

    def __init__(self, ctx: EngineContext):
        self._engine = ctx
        self._redo = None  # the transfer's writes, set aside (an UndoLog whose rollback writes them back)

    def _parks(self, transfer: str) -> bool:
        """Whether the flushed in-place writes of ``transfer`` may be set aside (call with the lock held)."""
        c = self._engine
        st = c.state
        return (c.config.engines.hold_s is not None and st.phase is Phase.OPEN and st.written == transfer
                and c.undo.transfer == transfer and isinstance(c.backend, TensorBackend))

    def after_flush(self, transfer: str, attempt: int) -> None:
        """The flush of ``(transfer, attempt)`` is done: park after ``hold_s`` unless activated before
        (call with the lock held)."""
        if self._parks(transfer):
            timer = threading.Timer(self._engine.config.engines.hold_s, self._park, (transfer, attempt))
            timer.daemon = True
            timer.start()

    def _park(self, transfer: str, attempt: int) -> None:
        c = self._engine
        st = c.state
        with c.lock:
            if not (st.is_in(transfer, attempt) and st.flushed == (transfer, attempt) and self._parks(transfer)):
                return  # activated, aborted or re-opened meanwhile
            try:  # no generate call reads the weights: the engine has been paused since before its first write
                self._redo = c.undo.set_aside(failpoints.each(c.backend, "engine.park"), c.backend.undo_tensors())
            except Exception as e:
                c.mark_dirty(f"setting aside the applied writes of {transfer} failed ({e!r})")
                c.pause.end(transfer, "abandoned", None)
                return
            st.park()
            c.count("parks")
            c.pause.park()
            c.lock.notify_all()  # generation waiting on the pause goes on, from the version held

    def write_back(self, transfer: str) -> None:
        """Activation of the parked ``transfer``: its writes go back into the weights (generation already
        reading them finishes first). Call with the lock held; the caller then activates."""
        c = self._engine
        c.pause.unpark()
        c.state.unpark()
        c.quiesce()
        t0 = time.perf_counter()
        try:
            self._redo.rollback(failpoints.each(c.backend, "engine.write_back"))
        except Exception as e:
            c.mark_dirty(f"writing back the set-aside writes of the committed transfer {transfer} failed ({e!r})")
            c.pause.end(transfer, "abandoned", None)
            raise EngineStateError(f"engine {c.engine_id}: {c.state.why}") from e
        finally:
            self._redo = None
        c.pause.applied(time.perf_counter() - t0)

    def drop(self) -> None:
        """Forget the set-aside writes (their transfer was abandoned, or another attempt opened)."""
        self._redo = None
