"""Every token's time, as a client streaming the answer would see it: the engines' generation, timed per token.

:func:`install` (run in an engine actor: ``handle.__ray_call__.remote(install)``) replaces the backend's
``generate`` with one that returns, beside each continuation, ``token_times``: the ``time.time()`` at which
each of its tokens was produced. Admission is untouched: ``EngineActor.generate`` still admits the call
under the engine's lock, waits while the engine is paused and names the version it read, then calls the
backend; only what the backend does per token is observed.

- ``transformers`` engines: the model's own ``generate`` (greedy, exactly ``max_tokens`` tokens), with a
  streamer that stamps each token as the model emits it. Concurrent calls run in their own threads, as
  they do without the probe.
- vLLM engines: one continuous batch, as a server runs it. Every call adds its prompts to the engine's
  ``LLMEngine``; one stepping thread runs ``step()`` while any request is unfinished, each step under the
  backend's lock (the lock ``VllmBackend.flush`` and every frame forwarded to the workers take), and
  stamps the tokens each step produced. A call returns when its requests finish. Without the probe,
  ``VllmBackend.generate`` holds that lock for a whole call, so concurrent calls would run one after
  another instead of batched.
"""

from __future__ import annotations

import itertools
import threading
import time


class _TokenClock:
    """A ``transformers`` streamer that stamps every token after the prompt."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt = True

    def put(self, value) -> None:
        if self._prompt:  # the first put is the prompt
            self._prompt = False
            return
        now = time.time()
        self.times.extend([now] * int(value.numel()))

    def end(self) -> None:
        pass


def _hf_generate(backend, prompt_token_ids, max_tokens: int = 8, sampling=None) -> list[dict]:
    import torch

    out = []
    with torch.no_grad():
        for ids in prompt_token_ids:
            clock = _TokenClock()
            seq = backend.model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                         do_sample=False, pad_token_id=0, streamer=clock)
            out.append({"token_ids": seq[0, len(ids):].tolist(), "token_times": clock.times})
    return out


class _VllmBatch:
    """One continuous batch over a ``VllmBackend``'s ``LLMEngine`` (see the module docstring)."""

    def __init__(self, backend):
        self.backend = backend
        self._cv = threading.Condition()
        self._queue: list[tuple[str, list[int], object]] = []
        self._times: dict[str, list[float]] = {}
        self._tokens: dict[str, list[int]] = {}
        self._done: set[str] = set()
        self._ids = itertools.count()
        threading.Thread(target=self._run, name="bench-vllm-batch", daemon=True).start()

    def generate(self, prompt_token_ids, max_tokens: int = 8, sampling=None) -> list[dict]:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        rids = []
        with self._cv:
            for p in prompt_token_ids:
                rid = f"bench-{next(self._ids)}"
                self._times[rid], self._tokens[rid] = [], []
                self._queue.append((rid, [int(x) for x in p], sp))
                rids.append(rid)
            self._cv.notify_all()
            while not all(r in self._done for r in rids):
                self._cv.wait()
            out = [{"token_ids": self._tokens.pop(r), "token_times": self._times.pop(r)} for r in rids]
            self._done.difference_update(rids)
        return out

    def _run(self) -> None:
        from vllm.inputs import TokensPrompt

        engine = self.backend.llm.llm_engine
        running: set[str] = set()
        while True:
            with self._cv:
                while not self._queue and not running:
                    self._cv.wait()
                new, self._queue = self._queue, []
            with self.backend.step_lock:  # what flush and every forwarded frame take: one step at a time
                for rid, p, sp in new:
                    engine.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
                    running.add(rid)
                outs = engine.step()
            now = time.time()
            with self._cv:
                for o in outs:
                    rid = o.request_id
                    if rid not in self._tokens:
                        continue
                    ids = list(o.outputs[0].token_ids)
                    self._times[rid].extend([now] * (len(ids) - len(self._tokens[rid])))
                    self._tokens[rid] = ids
                    if o.finished:
                        running.discard(rid)
                        self._done.add(rid)
                self._cv.notify_all()


def install(engine) -> str:
    """(Run in an engine actor.) The backend's ``generate`` stamps every token (see the module docstring);
    returns which kind of engine it is (``hf`` or ``vllm``). Idempotent."""
    backend = engine.backend
    kind = "vllm" if hasattr(backend, "llm") else "hf"
    if getattr(backend, "_bench_streaming", False):
        return kind
    if kind == "vllm":
        backend.generate = _VllmBatch(backend).generate
    else:
        backend.generate = lambda prompts, max_tokens=8, sampling=None: _hf_generate(backend, prompts, max_tokens)
    backend._bench_streaming = True
    return kind
