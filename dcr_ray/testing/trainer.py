"""A small real trainer used by the quickstart, tests and benchmarks: FP32 master weights, AdamW,
random-token language-model batches, and a BF16 rollout copy in canonical coordinates.

``TinyTrainer`` mixes in :class:`~dcr_ray.OwnerMixin`, so it is also the example of embedding
dcr_ray into an existing trainer actor: data-parallel replicas built with the same spec and fed the
same batches hold bit-identical weights, and each sends only the names it owns
(:func:`~dcr_ray.owned_names`).
"""

from __future__ import annotations

import copy

import torch

from dcr_ray.actors.owner.delta import owned_names
from dcr_ray.actors.owner.held import OwnerMixin
from dcr_ray.engines.base import checkpoint_state_dict
from dcr_ray.testing.models import ModelSpec, build_model


class TinyTrainer(OwnerMixin):
    """FP32 AdamW trainer of ``spec``'s model; rank ``rank`` of ``world`` owns a share of the names (or the
    names in ``owns``)."""

    def __init__(self, spec: ModelSpec = ModelSpec(), *, lr: float = 1e-5, rank: int = 0, world: int = 1,
                 rollout_dtype: torch.dtype = torch.bfloat16, threads: int | None = 1, owns=None):
        if threads:
            torch.set_num_threads(threads)
        self.spec = spec
        self.model = build_model(spec).float().train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.rollout_dtype = rollout_dtype
        self.names = list(checkpoint_state_dict(self.model))
        # the names this replica sends: its share of a stable hash (owned_names), or ``owns`` (the replicas
        # then split the names between them some other way, e.g. by size)
        self.mine = set(owned_names(self.names, rank, world)) if owns is None else set(owns)
        self.steps = 0
        self._cache: tuple[int, dict] | None = None

    def step(self, seed: int, batch: int = 4, seq: int = 32) -> float:
        """One real optimizer step on a random-token batch (same seed: same step on every replica)."""
        g = torch.Generator().manual_seed(seed)
        vocab = self.model.config.vocab_size
        return self.step_on(torch.randint(0, vocab, (batch, seq), generator=g).tolist())

    def step_on(self, token_ids: list[list[int]]) -> float:
        """One real optimizer step (next-token loss) on equal-length sequences, e.g. rollouts."""
        ids = torch.tensor(token_ids)
        loss = self.model(input_ids=ids, labels=ids).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.steps += 1
        return float(loss.detach())

    def train_state(self) -> dict:
        """Everything a replica needs to continue exactly as this one: the FP32 weights, AdamW's state and the
        step count (a replacement owner restored to a committed version loads it)."""
        return {"model": {k: v.clone() for k, v in self.model.state_dict().items()},
                "opt": copy.deepcopy(self.opt.state_dict()), "steps": self.steps}

    def load_train_state(self, state: dict) -> None:
        """Continue from :meth:`train_state` (bit for bit: the weights, the optimizer, the step count)."""
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(copy.deepcopy(state["opt"]))
        self.steps = state["steps"]
        self._cache = None

    def rollout_state(self, names=None) -> dict[str, torch.Tensor]:
        """BF16 (rollout dtype) copies of the canonical tensors, cached per step."""
        if self._cache is None or self._cache[0] != self.steps:
            with torch.no_grad():
                sd = checkpoint_state_dict(self.model)
                self._cache = (self.steps, {n: t.to(self.rollout_dtype).contiguous() for n, t in sd.items()})
        state = self._cache[1]
        return state if names is None else {n: state[n] for n in names}

    def dcr_tensors(self) -> dict[str, torch.Tensor]:
        return {n: t for n, t in self.rollout_state().items() if n in self.mine}
