"""In-flight version switches: the step gate an engine hands its backend, bound to the engine's own state.

With ``EngineConfig(switch="in_flight")`` and a backend that decodes step by step
(``switches_in_flight``), every forward pass of ``generate`` passes through :class:`EngineGate`
(:mod:`dcr_ray.engines.steps`)::

    enter()   under the engine's lock: wait while the engine may not serve its weights (a write is
              quiescing or running: the phase is paused, a hold is on, or it holds no version), then
              count the step in ``EngineContext.stepping`` and return the committed version it reads
    leave()   uncount it; a write waiting for the steps in progress goes on when none is left

A write (:meth:`EngineContext.quiesce`) then waits for the steps in progress only, never for a request to
finish: the running requests stop at their next step boundary, keep their KV caches, and resume on the
new version when the engine serves again (``activate``, a rollback, a park, a release). Every step reads
exactly one committed version: steps enter only while the phase serves it (ready, staging, parked), and
nothing writes the weights while one is counted.

A step that cannot enter within the stage timeout (``CommitConfig.timeout_s``) fails its request with
:class:`~dcr_ray.errors.RefitTimeoutError`; one whose engine holds no version at the end of that wait (its
bits were lost and no heal restored them) fails with :class:`~dcr_ray.errors.EngineStateError`. A heal
that restores a version in time lets the request go on under it, as any switch does.
"""

from __future__ import annotations

import time

from dcr_ray.actors.engine.context import EngineContext
from dcr_ray.errors import EngineStateError, RefitTimeoutError


class EngineGate:
    """The step gate of one engine (see the module doc)."""

    def __init__(self, ctx: EngineContext):
        self._engine = ctx

    def enter(self) -> int | None:
        c = self._engine
        with c.lock:
            if not c.may_step():
                self._wait(c)
            c.stepping += 1
            return c.state.version

    def _wait(self, c: EngineContext) -> None:
        t0 = time.perf_counter()
        deadline = time.monotonic() + c.config.commit.timeout_s
        while not c.may_step():
            left = deadline - time.monotonic()
            if left <= 0:
                c.pause.blocked(time.perf_counter() - t0)
                if c.state.why is not None or c.state.version is None:
                    raise EngineStateError(f"engine {c.engine_id} holds no version ({c.state.why or 'empty'}): "
                                           f"its running requests end here")
                raise RefitTimeoutError(f"engine {c.engine_id}: a decoding step waited for a version switch "
                                        f"longer than CommitConfig.timeout_s={c.config.commit.timeout_s:g}")
            c.lock.wait(min(left, 1.0))
        c.pause.blocked(time.perf_counter() - t0)

    def leave(self) -> None:
        c = self._engine
        with c.lock:
            c.stepping -= 1
            if not c.stepping:
                c.lock.notify_all()

    def __repr__(self) -> str:
        return f"EngineGate({self._engine.engine_id})"
