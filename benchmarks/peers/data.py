"""The cases every peer sees, step for step: real AdamW steps of a small and a medium model, and the codec
benchmark's uniform stress changes.

A case yields :class:`benchmarks.codec.Step` s (the committed bits as flat integer arrays, the new tensors),
each with the optimizer step it is, and builds the engine that receives them: for AdamW, the same
``transformers`` model in BF16; for stress, a plain ``torch`` module holding the one tensor under its name.
The AdamW steps are those of one run from the model's initialisation (FP32 master weights,
``torch.optim.AdamW`` at a constant LR, random token batches, the BF16 copy before and after each step),
measured at steps 1, 10 and 50 (``Settings.steps``): the change shrinks as Adam's second moments grow.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from benchmarks.codec.measure import Step
from benchmarks.codec.settings import _log
from benchmarks.common import adamw_step
from benchmarks.peers.settings import Settings


@dataclass
class Case:
    """One data case: its name, where its changes come from, its steps and its engine."""

    name: str
    source: str  # "adamw" or "stress"
    steps: Callable[[], Iterator[tuple[int | None, Step]]]  # (optimizer step, its change); stress: (None, ...)
    engine: Callable[[], "object"]  # a torch.nn.Module whose named parameters are the step's tensors
    n_steps: int
    info: dict = field(default_factory=dict)


def adamw_steps(size: str, lr: float, s: Settings) -> Iterator[tuple[int, Step]]:
    """``(k, step)`` for each ``k`` in ``s.steps``: the ``k``-th AdamW step of the ``size`` model from its
    initialisation at constant ``lr`` (the steps between are taken, not measured)."""
    import torch

    from dcr_ray.codec import bits_view
    from dcr_ray.testing.models import ModelSpec, build_model

    model = build_model(ModelSpec(size=size, seed=s.seed)).float().train()  # FP32 master weights
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(s.seed + 7)
    vocab = model.config.vocab_size
    params = dict(model.named_parameters())
    for k in range(1, max(s.steps) + 1):
        measured = k in s.steps
        before = {n: bits_view(p.detach().to(torch.bfloat16)).copy() for n, p in params.items()} if measured else None
        ids = torch.randint(0, vocab, s.batch, generator=g)
        t = time.perf_counter()
        loss = adamw_step(model, opt, ids)
        if measured or k % 10 == 0:
            _log(f"  {size} lr={lr:g} step {k}/{max(s.steps)} loss={loss:.3f} "
                 f"({time.perf_counter() - t:.1f}s){' measured' if measured else ''}")
        if measured:
            yield k, Step(old=before, new={n: p.detach().to(torch.bfloat16) for n, p in params.items()})


def model_engine(size: str, seed: int):
    """The engine of an AdamW case: the same ``transformers`` model in BF16, parameters frozen."""
    from dcr_ray.testing.models import ModelSpec, build_model

    return build_model(ModelSpec(size=size, seed=seed)).requires_grad_(False)


def module_engine(shapes: dict) -> "object":
    """A plain ``torch`` module with one frozen BF16 parameter per name (dots make submodules), for cases
    without a model."""
    import torch

    root = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), requires_grad=False))
    return root


def cases(s: Settings) -> list[Case]:
    """Every case of the run, in order: AdamW per model and LR, then stress per rate."""
    from benchmarks.codec.data import stress_step

    out = []
    for size in s.models:
        for lr in s.lrs:
            out.append(Case(f"adamw-{size}-lr{lr:g}", "adamw", lambda size=size, lr=lr: adamw_steps(size, lr, s),
                            lambda size=size: model_engine(size, s.seed), len(s.steps), {"model": size, "lr": lr}))
    for rate in s.stress_rates:
        out.append(Case(f"stress-{rate:.0%}", "stress",
                        lambda rate=rate: iter([(None, stress_step(s.stress_elems, rate, s.seed))]),
                        lambda: module_engine({"stress.weight": (s.stress_elems,)}), 1,
                        {"rate": rate, "elements": s.stress_elems}))
    return out
