"""A CPU stand-in for OpenRLHF's ``PolicyModelActor``, for the example and the tests.

OpenRLHF's own policy actor cannot be built without a GPU: ``openrlhf.models`` imports flash-attn and
DeepSpeed at import time, and ``PolicyModelActor`` trains through a DeepSpeed engine with NCCL. This
class has the attributes :class:`~dcr_ray.integrations.openrlhf.policy.PolicyOwnerMixin` reads on the
real one, set the way OpenRLHF sets them (``self.actor.model`` wraps the Hugging Face model loaded from
``pretrain`` in FP32 master weights; ``self._rank`` / ``self._world_size`` as ``BaseDistributedActor``
sets them), and ``fit`` is one real AdamW step of a REINFORCE-style policy-gradient loss (advantage =
reward minus the batch mean, the GRPO/RLOO shape) on rollouts the vLLM engines generated. Data-parallel
ranks given the same batches hold bit-identical weights, so each serves only its share of the names.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

import torch

from dcr_ray.engines.base import checkpoint_state_dict
from dcr_ray.integrations.openrlhf.policy import PolicyOwnerMixin, hf_model


class CpuPolicyActor(PolicyOwnerMixin):
    """Rank ``rank`` of ``world_size`` data-parallel policy replicas trained with AdamW on CPU."""

    def __init__(self, pretrain: str, *, lr: float = 1e-3, rank: int = 0, world_size: int = 1, threads: int = 1):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self._rank, self._world_size = rank, world_size
        model = AutoModelForCausalLM.from_pretrained(pretrain, dtype=torch.float32).train()
        self.actor = SimpleNamespace(model=model)  # OpenRLHF: Actor(...).model is the DeepSpeed engine
        self.optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def fit(self, sequences: Sequence[Sequence[int]], prompt_len: int, rewards: Sequence[float]) -> float:
        """One optimizer step: ``-mean(advantage * log p(response tokens))`` over equal-length sequences
        whose first ``prompt_len`` tokens are the prompt. Returns the loss."""
        model = hf_model(self.actor)
        ids = torch.tensor([list(s) for s in sequences])
        adv = torch.tensor(rewards, dtype=torch.float32)
        adv = adv - adv.mean()
        logits = model(input_ids=ids).logits[:, prompt_len - 1:-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, prompt_len:, None]).squeeze(-1)
        loss = -(adv[:, None] * logp).mean()
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        self.optim.step()
        return float(loss.detach())

    def rollout_state(self) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor in the rollout dtype (what a dense reload of the engines would load)."""
        with torch.no_grad():
            return {n: t.to(self.dcr_rollout_dtype).contiguous()
                    for n, t in checkpoint_state_dict(hf_model(self.actor)).items()}


__all__ = ["CpuPolicyActor"]
