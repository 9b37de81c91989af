"""How an engine samples its rollouts: one small value object every backend reads the same way.

``generate(prompts, max_tokens, sampling=Sampling(...))`` on any backend (and on the engine actor, which
passes it through). The default is greedy decoding of one continuation per prompt, which the exact
comparisons in tests rely on. RL rollouts sample: ``temperature > 0``, ``n`` continuations per prompt (a
GRPO group), a ``seed`` that makes the draw repeatable, and ``allowed_token_ids`` that restricts every
step to a set of tokens (constrained decoding for a verifiable task's answer format).

Outputs are prompt-major: ``outputs[i * n + j]`` is prompt ``i``'s ``j``-th continuation, each
``{"token_ids": [...], "logprobs": [...]}``. ``logprobs`` are the chosen tokens' log-probabilities
under the model's raw distribution (before temperature and the allowed-token mask), as vLLM reports
them by default; a trainer recomputes its own.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from dcr_ray.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class Sampling:
    temperature: float = 0.0
    """0: greedy (the argmax token, ties to the lowest id); > 0: sample from softmax(logits / temperature)."""
    n: int = 1
    """Continuations per prompt."""
    seed: int | None = None
    """Seed of the draw (same seed, same model bits, same prompts: same continuations); None: unseeded."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Tokens every step may choose from (all others are masked out), or None for the whole vocabulary."""

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not (isinstance(self.temperature, (int, float))
                                                       and math.isfinite(self.temperature)
                                                       and self.temperature >= 0):
            raise ConfigError(f"Sampling.temperature must be a finite number >= 0 (0: greedy), got "
                              f"{self.temperature!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"Sampling.n must be an integer >= 1 (continuations per prompt), got {self.n!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"Sampling.seed must be an integer or None, got {self.seed!r}")
        if self.allowed_token_ids is not None:
            ids = tuple(self.allowed_token_ids)
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ConfigError("Sampling.allowed_token_ids must be a non-empty list of token ids >= 0, or None")
            object.__setattr__(self, "allowed_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, value: "Sampling | dict | None") -> "Sampling":
        """``value`` as a :class:`Sampling` (a dict of its fields, or None for greedy)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ConfigError(f"unknown sampling setting(s) {unknown}; known: {sorted(cls.__dataclass_fields__)}")
            return cls(**value)
        raise ConfigError(f"sampling must be a dcr_ray.engines.sampling.Sampling, a dict of its fields or None, "
                          f"got {type(value).__name__}")
