"""Every token's time, as a client streaming the answer would see it: the engines' generation, timed per token.

:func:`install` (run in an engine actor: ``handle.__ray_call__.remote(install)``) wraps the backend's
``generate`` so that each continuation also carries ``token_times``: the ``time.time()`` at which each of its
tokens was produced. Generation itself is the backend's own, untouched: ``EngineActor.generate`` admits the
call under the engine's lock (waiting while the engine is paused), and the backend decodes through its step
gate (a version switch falls between two steps, or waits for the call to finish, as the engine's
``EngineConfig.switch`` says); only when each token appeared is observed.

- ``transformers`` engines: a forward hook on the model stamps the end of every forward pass in the thread
  that runs it (one prompt per call, so forward ``i`` produced token ``i``).
- vLLM engines: the backend's continuous batch (:mod:`dcr_ray.engines.vllm.batch`) steps the ``LLMEngine``
  in one thread; a wrapper around ``LLMEngine.step`` stamps each request's new tokens, and one around
  ``LLMEngine.add_request`` tells which call a request id belongs to (by its prompt: every client of an
  engine has a prompt of its own).
"""

from __future__ import annotations

import threading
import time


def _install_hf(backend) -> None:
    local = threading.local()

    def stamp(_module, _args, _output):
        times = getattr(local, "times", None)
        if times is not None:
            times.append(time.time())

    backend.model.register_forward_hook(stamp)
    inner = backend.generate

    def generate(prompt_token_ids, max_tokens=8, sampling=None):
        outs = []
        for ids in prompt_token_ids:
            local.times = []
            try:
                (out,) = inner([ids], max_tokens, sampling)
            finally:
                times, local.times = local.times, None
            outs.append({**out, "token_times": times[:len(out["token_ids"])]})
        return outs

    backend.generate = generate


def _install_vllm(backend) -> None:
    lock = threading.Lock()
    waiting: dict[tuple, list] = {}  # prompt -> its call's token times, until the request is added
    by_request: dict[str, list] = {}  # request id -> token times
    engine = backend.llm.llm_engine
    add, step = engine.add_request, engine.step

    def add_request(request_id, prompt, params, *args, **kwargs):
        with lock:
            times = waiting.pop(tuple(prompt["prompt_token_ids"]), None)
            if times is not None:
                by_request[request_id] = times
        return add(request_id, prompt, params, *args, **kwargs)

    def timed_step():
        outs = step()
        now = time.time()
        with lock:
            for o in outs:
                times = by_request.get(o.request_id)
                if times is not None:
                    times.extend([now] * sum(len(c.token_ids) for c in o.outputs))
                    if o.finished:
                        del by_request[o.request_id]
        return outs

    engine.add_request, engine.step = add_request, timed_step
    inner = backend.generate

    def generate(prompt_token_ids, max_tokens=8, sampling=None):
        stamps = [[] for _ in prompt_token_ids]
        with lock:
            for p, t in zip(prompt_token_ids, stamps):
                waiting[tuple(int(x) for x in p)] = t
        outs = inner(prompt_token_ids, max_tokens, sampling)
        return [{**o, "token_times": t} for o, t in zip(outs, stamps)]

    backend.generate = generate


def install(engine) -> str:
    """(Run in an engine actor.) The backend's ``generate`` stamps every token (see the module docstring);
    returns which kind of engine it is (``hf`` or ``vllm``). Idempotent."""
    backend = engine.backend
    kind = "vllm" if hasattr(backend, "llm") else "hf"
    if getattr(backend, "_bench_streaming", False):
        return kind
    (_install_vllm if kind == "vllm" else _install_hf)(backend)
    backend._bench_streaming = True
    return kind
