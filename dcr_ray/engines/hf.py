"""The embedded default receiver: a ``transformers`` causal LM held in the engine actor.

Its storage *is* the canonical layout (the model's own ``state_dict`` tensors), so placement is the
identity and frames are applied straight into parameter storage: XOR masks through integer views,
overwrites by indexed writes, dense chunks by copy. No second copy of the model exists. While the engine
keeps an undo record, the same pass that writes a position keeps the bits it replaced.

Generation passes through the backend's step gate around every forward pass (:mod:`~dcr_ray.engines.steps`):
greedy decoding is the model's own ``generate``, whose stopping-criteria call after each step is the step
boundary; sampling is a decoding loop of its own. An engine's version switch therefore waits for one step,
never for a request, and each continuation's ``versions`` names the version every step read. KV caches:
each call holds its own, so a running request keeps the KV its earlier steps computed under the old version
(as PipelineRL's in-flight updates do), and nothing is shared between requests: a new request never reads
KV computed under an older version.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch

from dcr_ray.codec import DecodedFrame, apply_decoded
from dcr_ray.codec.bits import bits_view
from dcr_ray.codec.decoding.undo import FrameUndo
from dcr_ray.engines.base import EngineBackend, TensorBackend, canonical_state_dict
from dcr_ray.engines.sampling import Sampling
from dcr_ray.engines.steps import Spans, StepGate
from dcr_ray.errors import ConfigError


class _Passage:
    """One decoding loop's passage through a step gate: inside from :meth:`begin` to the next boundary."""

    def __init__(self, gate: StepGate):
        self.gate = gate
        self.version: int | None = None
        self.inside = False

    def begin(self) -> None:
        self.version = self.gate.enter()
        self.inside = True

    def boundary(self, more: bool) -> None:
        """A step ended: leave the gate, and enter it again for the next step when ``more`` follow."""
        self.end()
        if more:
            self.begin()

    def end(self) -> None:
        if self.inside:
            self.inside = False
            self.gate.leave()


def _boundary_criterion(passage: _Passage, spans: Spans, max_tokens: int):
    """A ``transformers`` stopping criterion that never stops: called once after every decoding step of
    ``generate``, it credits the step's token to the version it read and passes the step boundary."""
    from transformers import StoppingCriteria

    class StepBoundary(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            spans.add(passage.version)
            passage.boundary(more=spans.tokens < max_tokens)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StepBoundary()


class TransformersBackend(TensorBackend):
    """Wraps a ``transformers`` model (or any ``nn.Module``) built by ``model_factory()`` on CPU."""

    applies_packs = True  # apply_decoded writes packs straight into the parameters
    switches_in_flight = True  # every forward pass goes through the step gate

    def __init__(self, model_factory: Callable[[], torch.nn.Module]):
        self.model = model_factory()
        self.model.eval()
        self._tensors = canonical_state_dict(self.model)

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "TransformersBackend":
        """A backend over ``tensors`` themselves (held, not copied) with an empty model: the apply, undo
        and dense-load paths of a transformers engine without building one (tests, tools). It cannot
        generate."""
        backend = cls(torch.nn.Module)
        backend._tensors = tensors
        return backend

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._tensors

    def apply(self, frame: DecodedFrame) -> None:
        apply_decoded(frame, self._tensors)

    def apply_with_undo(self, frame: DecodedFrame, undo: FrameUndo) -> None:
        apply_decoded(frame, self._tensors, undo=undo)  # the replaced bits read in the pass that writes

    def undo_tensors(self) -> Mapping[str, torch.Tensor]:
        return self._tensors  # the live parameters

    def load_dense(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in tensors:
            dst = self._tensors[name]
            bits_view(dst)[:] = bits_view(t.contiguous())

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], max_tokens: int = 8,
                 sampling: Sampling | dict | None = None) -> list[dict]:
        """Continuations of each prompt (see :mod:`~dcr_ray.engines.sampling`): greedy by default, one per
        prompt ``{"token_ids": [...], "logprobs": [...], "versions": [...]}`` (float32 logprobs; ``versions``:
        the spans of the versions its steps read, :mod:`~dcr_ray.engines.steps`); with ``sampling``, ``n``
        sampled continuations per prompt, prompt-major."""
        sampling = Sampling.of(sampling)
        if sampling.greedy and sampling.n == 1 and sampling.allowed_token_ids is None:
            return [self._greedy_one(ids, max_tokens) for ids in prompt_token_ids]
        return self._sample(prompt_token_ids, max_tokens, sampling)

    def _greedy_one(self, ids: list[int], max_tokens: int) -> dict:
        from transformers import StoppingCriteriaList

        passage, spans = _Passage(self.step_gate), Spans()
        criteria = StoppingCriteriaList([_boundary_criterion(passage, spans, max_tokens)])
        passage.begin()  # the prefill reads the weights too
        try:
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                      output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                                      stopping_criteria=criteria)
        finally:
            passage.end()
        toks = out.sequences[0, len(ids):].tolist()
        lps = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, toks)]
        return {"token_ids": toks, "logprobs": lps, "versions": spans.spans}

    @torch.no_grad()
    def _sample(self, prompt_token_ids: list[list[int]], max_tokens: int, sampling: Sampling) -> list[dict]:
        """Batched sampling with the model's KV cache: prompts of one length go through together, each
        repeated ``n`` times; every step masks to the allowed tokens, scales by the temperature and draws
        from one seeded generator (greedy: the argmax of the masked logits)."""
        gen = torch.Generator()
        if sampling.seed is not None:
            gen.manual_seed(sampling.seed)
        vocab = self.model.get_output_embeddings().weight.shape[0]
        mask = None
        if sampling.allowed_token_ids is not None:
            mask = torch.full((vocab,), float("-inf"))
            mask[list(sampling.allowed_token_ids)] = 0.0
        out: list[dict | None] = [None] * (len(prompt_token_ids) * sampling.n)
        by_len: dict[int, list[int]] = {}
        for i, ids in enumerate(prompt_token_ids):
            by_len.setdefault(len(ids), []).append(i)
        for idx in by_len.values():
            x = torch.tensor([prompt_token_ids[i] for i in idx]).repeat_interleave(sampling.n, 0)
            past, step_in, toks, lps, spans = None, x, [], [], Spans()
            for _ in range(max_tokens):
                passage = _Passage(self.step_gate)
                passage.begin()
                try:
                    res = self.model(step_in, past_key_values=past, use_cache=True)
                finally:
                    passage.end()
                spans.add(passage.version)
                past, raw = res.past_key_values, res.logits[:, -1].float()
                logits = raw if mask is None else raw + mask
                if sampling.greedy:
                    nxt = logits.argmax(-1, keepdim=True)
                else:
                    nxt = torch.multinomial(torch.softmax(logits / sampling.temperature, -1), 1, generator=gen)
                toks.append(nxt)
                lps.append(torch.log_softmax(raw, -1).gather(-1, nxt))
                step_in = nxt
            toks_t, lps_t = torch.cat(toks, 1).tolist(), torch.cat(lps, 1).tolist()
            for k, i in enumerate(idx):
                for j in range(sampling.n):
                    row = k * sampling.n + j
                    out[i * sampling.n + j] = {"token_ids": toks_t[row], "logprobs": lps_t[row],
                                               "versions": list(spans.spans)}
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def greedy(self, input_ids: list[list[int]], max_new_tokens: int = 8) -> list[list[int]]:
        """Greedy continuation token ids (for examples and checks; not gated: call it while no refit runs)."""
        out = self.model.generate(torch.tensor(input_ids), max_new_tokens=max_new_tokens, do_sample=False)
        return out[:, len(input_ids[0]):].tolist()


class HFEngine:
    """Engine factory: a ``transformers`` causal LM in each engine actor (the embedded receiver).

    ``model`` is a Hugging Face checkpoint directory visible to the engines' nodes (loaded with
    ``AutoModelForCausalLM.from_pretrained`` in ``dtype``), or a picklable zero-argument callable that
    returns the model (e.g. :class:`dcr_ray.testing.models.ModelSpec`). The engine's initial bits do not
    matter: the dense bootstrap replaces them with the owners' committed bits.
    """

    def __init__(self, model: str | Callable[[], torch.nn.Module], *, dtype: str = "bfloat16"):
        if not (isinstance(model, str) or callable(model)):
            raise ConfigError(f"HFEngine(model) takes a checkpoint directory or a callable returning a model, "
                              f"got {type(model).__name__}")
        self.model = model
        self.dtype = dtype

    def _build(self) -> torch.nn.Module:
        if callable(self.model):
            return self.model()
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.model, dtype=getattr(torch, self.dtype))

    def __call__(self) -> EngineBackend:
        return TransformersBackend(self._build)
