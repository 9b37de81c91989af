"""Generation with a ``vllm.LLM``: the sampling parameters every path uses, and greedy (and sampled)
generation through ``LLM.generate``, token ids and their log-probabilities, for exact comparisons
(engines dcr_ray starts serve through :mod:`~dcr_ray.engines.vllm.batch` instead)."""

from __future__ import annotations

from typing import Any, Sequence


def greedy(llm: Any, prompt_token_ids: Sequence[Sequence[int]], max_tokens: int, *,
           one_by_one: bool = False) -> list[dict]:
    """Greedy continuations (temperature 0, EOS ignored, so exactly ``max_tokens`` tokens) of ``llm``.

    One ``{"token_ids": [...], "logprobs": [...]}`` per prompt: the log-probability of each chosen
    token. Also usable on an ``LLM`` actor: ``handle.__ray_call__.remote(greedy, prompts, n)``.
    ``one_by_one``: each prompt is generated on its own. Logprobs are compared bit for bit, and a CPU
    GEMM's rounding may depend on how many rows it multiplies, so an engine compared with a server
    (whose scheduler batches requests as they arrive) must run the same batch shapes: one prompt at a time.
    """
    if one_by_one:
        return [out for p in prompt_token_ids for out in greedy(llm, [p], max_tokens)]
    from vllm.inputs import TokensPrompt

    sp = greedy_params(max_tokens)
    prompts = [TokensPrompt(prompt_token_ids=[int(x) for x in p]) for p in prompt_token_ids]
    result = []
    for o in llm.generate(prompts, sp, use_tqdm=False):
        c = o.outputs[0]
        ids = list(c.token_ids)
        logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs or [], ids)]
        result.append({"token_ids": ids, "logprobs": logprobs})
    return result


def greedy_params(max_tokens: int):
    """vLLM ``SamplingParams`` of a greedy continuation: temperature 0, EOS ignored (exactly ``max_tokens``
    tokens), each chosen token's log-probability, no detokenization."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False)


def sampling_params(max_tokens: int, sampling):
    """vLLM ``SamplingParams`` of :class:`~dcr_ray.engines.sampling.Sampling` (temperature, ``n``, seed,
    ``allowed_token_ids``; EOS ignored; each chosen token's raw log-probability)."""
    from vllm import SamplingParams

    return SamplingParams(temperature=sampling.temperature, n=sampling.n, seed=sampling.seed, max_tokens=max_tokens,
                          logprobs=0, ignore_eos=True, detokenize=False,
                          allowed_token_ids=list(sampling.allowed_token_ids) if sampling.allowed_token_ids else None)


def sample(llm: Any, prompt_token_ids: Sequence[Sequence[int]], max_tokens: int, sampling) -> list[dict]:
    """Sampled continuations through vLLM's own sampler (:func:`sampling_params`), prompt-major, each
    ``{"token_ids", "logprobs"}`` (vLLM's raw log-probabilities of the chosen tokens): see
    :mod:`dcr_ray.engines.sampling`."""
    from vllm.inputs import TokensPrompt

    sp = sampling_params(max_tokens, sampling)
    prompts = [TokensPrompt(prompt_token_ids=[int(x) for x in p]) for p in prompt_token_ids]
    result = []
    for o in llm.generate(prompts, sp, use_tqdm=False):
        for c in sorted(o.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            result.append({"token_ids": ids,
                           "logprobs": [float(step[t].logprob) for step, t in zip(c.logprobs or [], ids)]})
    return result


def served_digests(llm: Any) -> list[dict[str, str]]:
    """Per worker, the digest of every parameter and buffer the engine serves with and of each linear
    layer's kernel output on a probe (:func:`~dcr_ray.engines.vllm.worker.served.served_fingerprint`: on CPU the
    packed linear weights live outside the parameters), read from the workers themselves. Also usable on
    an ``LLM`` actor: ``handle.__ray_call__.remote(served_digests)``."""
    return llm.collective_rpc(_worker_digests)


def _worker_digests(worker: Any) -> dict[str, str]:
    from dcr_ray.engines.vllm.worker.served import served_fingerprint

    return served_fingerprint(worker.get_model())
