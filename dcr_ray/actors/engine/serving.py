"""Serving: an engine generates from the versions it holds, and never from half-written weights.

``generate`` is admitted under the engine's lock, then runs *outside* it, counted in
``EngineContext.serving``: deliveries, flushes and other protocol calls go on while it runs. Admission
waits while the engine is paused (:attr:`EngineState.paused`: a transfer writes in place, or staged frames
are being written until the version is activated) and refuses while it holds no version.

Where a version switch falls (``EngineConfig.switch``):

- ``"in_flight"`` (the default, for backends that decode through a step gate): a write waits only for the
  decoding steps in progress (:mod:`~dcr_ray.actors.engine.switch`); the running calls stop at their next
  step boundary and go on under the new version, with the KV cache they hold. An answer's tokens may come
  from two versions or more: each continuation's ``versions`` says which (spans ``(version, first token
  index)``), and the answer's ``version`` is the oldest of them;
- ``"drain"``: a write waits until every call running has answered from the old version; each answer
  comes from one version, the one read at admission.

The seconds generation waited, and every refit's pause on this engine's clock, are kept by the
engine's :class:`~dcr_ray.actors.engine.pause.PauseClock` (``pauses()``).
"""

from __future__ import annotations

import time

from dcr_ray.actors.engine.context import EngineContext
from dcr_ray.engines.sampling import Sampling
from dcr_ray.engines.steps import fill_spans
from dcr_ray.errors import ConfigError, EngineStateError, RefitTimeoutError


class Serving:
    """``generate`` and ``pauses`` of one engine (see the module doc)."""

    def __init__(self, ctx: EngineContext):
        self._engine = ctx

    def generate(self, prompt_token_ids: list[list[int]], max_tokens: int = 8, timeout_s: float | None = None,
                 sampling=None) -> dict:
        """Generation with the backend, greedy unless ``sampling`` (a :class:`Sampling` or a dict of its
        fields) says otherwise; returns ``{"engine", "version", "outputs"}`` (outputs prompt-major, ``n``
        per prompt, each with ``versions``: spans ``(version, first token index)`` of the versions that
        produced its tokens; ``version``: the oldest of them). Waits while the engine is paused for a refit
        (past ``timeout_s``, default the stage timeout: :class:`RefitTimeoutError`); refuses while it holds
        no version. ``t_start`` / ``t_end``: when it was admitted and answered, on the engine's clock
        (``time.time()``)."""
        c = self._engine
        sampling = None if sampling is None else Sampling.of(sampling)
        deadline = time.monotonic() + (timeout_s or c.config.commit.timeout_s)
        with c.lock:
            t_wait = time.perf_counter()
            while c.state.paused or c.held is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    c.pause.blocked(time.perf_counter() - t_wait)
                    raise RefitTimeoutError(f"engine {c.engine_id}: paused for a refit longer than allowed")
                c.lock.wait(min(left, 1.0))
            waited = time.perf_counter() - t_wait
            if waited > 0.001:
                c.pause.blocked(waited)
            if c.state.why is not None or c.state.version is None:
                why = c.state.why or "it was never bootstrapped"
                raise EngineStateError(f"engine {c.engine_id} will not generate: it holds no version ({why}); "
                                       f"Refit.rejoin({c.engine_id!r}) restores it")
            version = c.state.version
            c.serving += 1
        t_start = time.time()
        try:
            outputs = (c.backend.generate(prompt_token_ids, max_tokens) if sampling is None
                       else c.backend.generate(prompt_token_ids, max_tokens, sampling=sampling))
        finally:
            with c.lock:
                c.serving -= 1
                c.lock.notify_all()
        for o in outputs:  # an ungated backend (or drain) read one version: the one admitted at
            o["versions"] = fill_spans(o.get("versions"), version)
        oldest = min((v for o in outputs for v, _ in o["versions"]), default=version)
        return {"engine": c.engine_id, "version": oldest, "outputs": outputs, "t_start": t_start,
                "t_end": time.time()}

    def hold(self, label: str, switch: str | None = None) -> None:
        """Stop admitting generation for an operation outside the refit protocol (``label``: what it is,
        e.g. a weight load another system makes); its pause is kept like a refit's (mode ``label``).
        ``switch`` (default: ``EngineConfig.switch``): ``"in_flight"`` returns once the decoding steps in
        progress ended (the running requests wait at their next step and resume after :meth:`release`, as
        vLLM's ``pause_generation(mode="keep")`` holds them); ``"drain"`` once every call running answered.
        :meth:`release` ends it."""
        c = self._engine
        if switch not in (None, "in_flight", "drain"):
            raise ConfigError(f"hold(switch={switch!r}): use 'in_flight', 'drain' or None (the engine's "
                              f"EngineConfig.switch)")
        drain = None if switch is None else switch == "drain"
        with c.lock:
            if c.held is not None:
                raise EngineStateError(f"engine {c.engine_id} is already held for {c.held!r}")
            c.held = label
            c.held_drains = drain if drain is not None else not c.in_flight
            c.pause.begin(label, label)
            try:
                c.quiesce(drain)
            finally:
                c.held_drains = False  # drained (or not): from here no step reads the weights until release

    def release(self, label: str) -> None:
        """End the hold ``label``: generation is admitted again."""
        c = self._engine
        with c.lock:
            if c.held == label:
                c.held, c.held_drains = None, False
                c.pause.end(label, "resumed", c.state.version)
                c.lock.notify_all()

    def pauses(self, since: float = 0.0) -> list[dict]:
        """This engine's serving pauses that began at or after ``since`` (``time.time()``), oldest first:
        per refit, ``pause_s`` (generation could not serve), split into ``apply_s`` (writes and the
        backend's flush) and ``commit_s`` (waiting for the record and activation), ``blocked_s`` (how
        long ``generate`` calls waited), the ``mode`` and ``outcome`` (:mod:`~dcr_ray.actors.engine.pause`)."""
        return self._engine.pause.recent(since)
