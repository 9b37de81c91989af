"""The cases' data: real AdamW steps of a small model, uniform stress changes, many small MoE tensors."""

from __future__ import annotations

import time

from benchmarks.codec.measure import Step
from benchmarks.codec.settings import Settings, _log
from benchmarks.common import adamw_step

#: The MoE-shaped many-tensor case: tensors, elements per tensor, change rate.
MOE_TENSORS = 100_000
MOE_SHAPE = (16, 32)
MOE_RATE = 0.01
#: Per-tensor fixed cost the issue asks for: 10**5 tensors in <= 0.5 s per refit per owner and per engine.
FIXED_COST_MAX_S = 0.5


def expert_shapes(n: int = MOE_TENSORS, shape: tuple[int, ...] = MOE_SHAPE) -> dict[str, tuple[int, ...]]:
    """Names and shapes of ``n`` small expert tensors, named like an MoE model's (gate/up/down of 128
    experts per layer); the refit bench's experts case uses the same tensors."""
    out = {}
    for i in range(n):
        layer, rest = divmod(i, 3 * 128)
        out[f"model.layers.{layer}.mlp.experts.{rest // 3}.{('gate_proj', 'up_proj', 'down_proj')[rest % 3]}.weight"] \
            = shape
    return out


def moe_step(n_tensors: int, shape: tuple[int, int], rate: float, seed: int) -> Step:
    """``n_tensors`` small BF16 tensors named like the experts of an MoE model (gate/up/down per expert,
    128 experts per layer), with the stress case's uniform changes at ``rate`` across all of them."""
    import torch

    per = shape[0] * shape[1]
    big = stress_step(n_tensors * per, rate, seed)
    (old_all,), (new_all,) = big.old.values(), big.new.values()
    old, new = {}, {}
    for i, name in enumerate(expert_shapes(n_tensors, shape)):
        old[name] = old_all[i * per:(i + 1) * per]
        new[name] = new_all[i * per:(i + 1) * per].view(torch.bfloat16).reshape(shape)
    return Step(old=old, new=new)


def stress_step(n: int, rate: float, seed: int) -> Step:
    """A BF16 tensor of ``randn * 0.02`` with exactly ``round(rate * n)`` elements changed (relative 1e-2)."""
    import numpy as np
    import torch

    from dcr_ray.codec import bits_view

    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    old = bits_view(base).copy()
    rng = np.random.default_rng(seed + 1)
    k = int(round(rate * n))
    idx = np.sort(rng.choice(n, k, replace=False))
    vals = base[torch.from_numpy(idx)].float()
    newv = (vals * (1 + 1e-2 * torch.randn(k, generator=g))).to(torch.bfloat16)
    nb = bits_view(newv).copy()
    same = nb == old[idx]
    nb[same] ^= 1  # rounding left it unchanged: move it by one ulp
    new = base.clone()
    bits_view(new)[idx] = nb
    return Step(old={"stress.weight": old}, new={"stress.weight": new})


def real_steps(s: Settings, lr: float):
    """Yield :class:`Step` s of AdamW training at constant ``lr`` (after ``s.warm_steps`` unmeasured steps)."""
    import torch

    from dcr_ray.codec import bits_view
    from dcr_ray.testing.models import ModelSpec, build_model

    model = build_model(ModelSpec(size="small", seed=s.seed)).float().train()  # FP32 master weights
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(s.seed + 7)
    vocab = model.config.vocab_size
    params = dict(model.named_parameters())
    for i in range(s.warm_steps + s.steps):
        before = {n: bits_view(p.detach().to(torch.bfloat16)).copy() for n, p in params.items()}
        ids = torch.randint(0, vocab, s.batch, generator=g)
        t = time.perf_counter()
        loss = adamw_step(model, opt, ids)
        _log(f"  lr={lr:g} step {i + 1}/{s.warm_steps + s.steps} loss={loss:.3f} "
             f"({time.perf_counter() - t:.1f}s){' warm-up' if i < s.warm_steps else ''}")
        if i >= s.warm_steps:
            yield Step(old=before, new={n: p.detach().to(torch.bfloat16) for n, p in params.items()})
