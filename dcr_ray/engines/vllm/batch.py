"""One continuous batch over a ``vllm.LLM`` that dcr_ray started: every ``generate`` call joins it, one thread
steps it, and a version switch falls between two of its steps.

:class:`ContinuousBatch` is what :meth:`VllmBackend.generate <dcr_ray.engines.vllm.VllmBackend.generate>`
runs. A call puts its requests on a queue and waits for their answers; one stepping thread adds the queued
requests to the ``LLMEngine`` and runs ``step()`` while any request is unfinished, as vLLM's own server
loop does, so concurrent calls decode in one batch. Every step passes through the backend's step gate
(:mod:`~dcr_ray.engines.steps`) and runs under the backend's step lock, the lock its frame writes, flush
(vLLM's reload) and rollback take: a version switch waits for the step in progress only, the running
requests stay in vLLM's scheduler with their KV blocks, and their next step reads the new version, as
vLLM's ``pause_generation(mode="keep")`` holds them. Each step's new tokens are credited to the version
that step read, so every continuation carries its ``versions`` spans.

Prefixes cached under an older version are never reused by a request admitted under a newer one: each
request enters the engine with ``cache_salt`` naming the version the weights held when it was added (a
prefix-cache block is found only by requests of the same salt), so the running requests keep their own
KV across a switch (as PipelineRL's in-flight updates do) while every request added after it computes
its prefix under the new weights. vLLM's ``reset_prefix_cache`` is refused while requests hold blocks;
the salt makes it unnecessary.

Requests are added in the stepping thread only, at the step that first reads their version; the
``LLMEngine`` is driven by nothing else while a call runs (code that drives the ``LLM`` beside it takes
the step lock, and must not run ``LLM.generate`` while calls are in flight: that loop would consume their
outputs).
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Callable, Sequence

from dcr_ray.engines.steps import Spans, StepGate
from dcr_ray.errors import BackendError

log = logging.getLogger(__name__)


class _Request:
    """One prompt's request and what its ``n`` continuations got so far."""

    def __init__(self, rid: str, prompt: list[int], params: Any, n: int):
        self.rid, self.prompt, self.params = rid, prompt, params
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.spans = [Spans() for _ in range(n)]
        self.done = False
        self.error: BaseException | None = None

    def outputs(self) -> list[dict]:
        return [{"token_ids": t, "logprobs": lp, "versions": s.spans}
                for t, lp, s in zip(self.tokens, self.logprobs, self.spans)]


class ContinuousBatch:
    """The continuous batch of one ``LLM`` (see the module doc). ``gate()`` returns the backend's current
    step gate; ``version()`` the version label it serves (read under ``lock`` when the gate names none)."""

    def __init__(self, llm: Any, lock: threading.RLock, gate: Callable[[], StepGate], version: Callable[[], int]):
        self._llm, self._lock, self._gate, self._version = llm, lock, gate, version
        self._cv = threading.Condition()
        self._queue: list[_Request] = []
        self._running: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: Any, n: int) -> list[list[dict]]:
        """Every prompt's continuations (``n`` each), once all are finished: per prompt a list of
        ``{"token_ids", "logprobs", "versions"}``. ``params``: vLLM ``SamplingParams`` (its output kind is
        set to deltas here)."""
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.DELTA
        reqs = [_Request(f"dcr-{next(self._ids)}", [int(x) for x in p], params, n) for p in prompt_token_ids]
        with self._cv:
            if self._closed:
                raise BackendError("the vLLM engine is closed")
            self._queue += reqs
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dcr-vllm-steps", daemon=True)
                self._thread.start()
            self._cv.notify_all()
            while not all(r.done for r in reqs):
                self._cv.wait()
        failed = next((r.error for r in reqs if r.error is not None), None)
        if failed is not None:
            raise failed
        return [r.outputs() for r in reqs]

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop stepping: calls still waiting fail."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    # -- the stepping thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._queue or self._running or self._closed):
                    self._cv.wait()
                if self._closed:
                    self._fail(list(self._queue) + list(self._running.values()), BackendError("the vLLM engine closed"))
                    return
                new, self._queue = self._queue, []
            try:
                outs, version = self._step(new)
            except BaseException as e:  # noqa: BLE001 - every waiting call gets it, the loop goes on
                self._abort(new, e)
                continue
            self._record(outs, version)

    def _step(self, new: list[_Request]) -> tuple[list, int]:
        """One step: the gate, then under the step lock the new requests (salted with the version the
        weights hold) and ``step()``. Returns the step's outputs and the version it read."""
        from vllm.inputs import TokensPrompt

        gate = self._gate()
        version = gate.enter()
        try:
            with self._lock:
                if version is None:
                    version = self._version()
                engine = self._llm.llm_engine
                for r in new:
                    engine.add_request(r.rid, TokensPrompt(prompt_token_ids=r.prompt, cache_salt=f"dcr-v{version}"),
                                       r.params)
                    with self._cv:
                        self._running[r.rid] = r
                return engine.step(), version
        finally:
            gate.leave()

    def _record(self, outs: list, version: int) -> None:
        with self._cv:
            for o in outs:
                r = self._running.get(o.request_id)
                if r is None:
                    continue
                for c in o.outputs:
                    ids = list(c.token_ids)
                    r.tokens[c.index] += ids
                    r.logprobs[c.index] += [float(step[t].logprob) for step, t in zip(c.logprobs or [], ids)]
                    r.spans[c.index].add(version, len(ids))
                if o.finished:
                    r.done = True
                    del self._running[o.request_id]
            self._cv.notify_all()

    def _abort(self, new: list[_Request], error: BaseException) -> None:
        """A step failed (its gate refused, or vLLM raised): every request in flight fails with ``error``
        and leaves the engine."""
        with self._cv:
            victims = list(self._running.values()) + [r for r in new if r.rid not in self._running]
            self._running.clear()
        ids = [r.rid for r in victims]
        try:
            with self._lock:
                self._llm.llm_engine.abort_request(ids)
        except Exception as e:  # noqa: BLE001 - the calls fail either way
            log.warning("aborting %d vLLM requests after a failed step: %r", len(ids), e)
        with self._cv:
            self._fail(victims, error)

    def _fail(self, reqs: list[_Request], error: BaseException) -> None:
        for r in reqs:
            if not r.done:
                r.error, r.done = error, True
        self._cv.notify_all()
