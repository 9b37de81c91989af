"""The embedded default receiver: a ``transformers`` causal LM held in the engine actor.

Its storage *is* the canonical layout (the model's own ``state_dict`` tensors), so placement is the
identity and frames are applied straight into parameter storage: XOR masks through integer views,
overwrites by indexed writes, dense chunks by copy. No second copy of the model exists.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch

from dcr_ray.codec.bits import bits_view
from dcr_ray.codec import DecodedFrame, apply_decoded
from dcr_ray.engines.base import EngineBackend, canonical_state_dict


class TransformersBackend(EngineBackend):
    """Wraps a ``transformers`` model (or any ``nn.Module``) built by ``model_factory()`` on CPU."""

    applies_packs = True  # apply_decoded writes packs straight into the parameters

    def __init__(self, model_factory: Callable[[], torch.nn.Module]):
        self.model = model_factory()
        self.model.eval()
        self._tensors = canonical_state_dict(self.model)

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._tensors

    def apply(self, frame: DecodedFrame) -> None:
        apply_decoded(frame, self._tensors)

    def undo_tensors(self) -> Mapping[str, torch.Tensor]:
        return self._tensors  # the live parameters

    def load_dense(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in tensors:
            dst = self._tensors[name]
            bits_view(dst)[:] = bits_view(t.contiguous())

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], max_tokens: int = 8) -> list[dict]:
        """Greedy continuations: per prompt ``{"token_ids": [...], "logprobs": [...]}`` (float32)."""
        outs = []
        for ids in prompt_token_ids:
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                      output_scores=True, return_dict_in_generate=True,
                                      pad_token_id=0)
            toks = out.sequences[0, len(ids):].tolist()
            lps = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, toks)]
            outs.append({"token_ids": toks, "logprobs": lps})
        return outs

    @torch.no_grad()
    def greedy(self, input_ids: list[list[int]], max_new_tokens: int = 8) -> list[list[int]]:
        """Greedy continuation token ids (for examples and checks)."""
        out = self.model.generate(torch.tensor(input_ids), max_new_tokens=max_new_tokens, do_sample=False)
        return out[:, len(input_ids[0]):].tolist()
