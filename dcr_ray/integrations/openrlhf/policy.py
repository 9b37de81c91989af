"""OpenRLHF's policy actor as a dcr_ray owner: ``dcr_tensors()`` served from the model it trains.

OpenRLHF 0.11 trains the policy in ``PolicyModelActor`` (``openrlhf/trainer/ray/ppo_actor.py``), one Ray
actor per DeepSpeed rank: ``self.actor`` is OpenRLHF's ``Actor`` wrapper, ``self.actor.model`` the
DeepSpeed engine after ``strategy.prepare`` and ``self.actor.model.module`` the Hugging Face model
(what ``broadcast_to_vllm`` reads). :class:`PolicyOwnerMixin` turns that actor into a dcr_ray owner::

    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor
    DcrPolicyModelActor = dcr_policy_actor(PolicyModelActor)     # pass it where PolicyModelActor went

Every DeepSpeed rank becomes an owner of a disjoint share of the checkpoint names
(:func:`~dcr_ray.owned_names` over ``(rank, world_size)``), so each canonical element is sent by exactly
one rank and no rank sends the whole model:

* ZeRO stage 0/1/2 without DeepSpeed tensor parallelism: every rank holds the full parameters, so a rank
  just reads its share (cast to the rollout dtype, BF16 by default, on the rank's device: the owner diffs
  GPU tensors on their GPU).
* ZeRO-3 or DeepSpeed AutoTP (``ds.tensor_parallel_size > 1``): parameters are partitioned; every rank
  gathers each parameter in the same order with the same DeepSpeed context ``broadcast_to_vllm`` uses
  (a collective: all ranks must call ``dcr_tensors`` together, which the coordinator does by streaming
  every owner at once) and keeps only its share. **GPU-only, and not exercised by dcr_ray's tests**:
  DeepSpeed does not run on the CPU test machines.

A plain (CPU) model without DeepSpeed takes the first path; that is what the tests run. LoRA adapters
are refused (merge them first: the engines serve merged weights under the base model's names).
"""

from __future__ import annotations

from typing import Any

import torch

from dcr_ray.actors.owner.delta import owned_names
from dcr_ray.actors.owner.held import OwnerMixin
from dcr_ray.engines.base import checkpoint_state_dict
from dcr_ray.errors import ConfigError


def hf_model(actor: Any) -> torch.nn.Module:
    """The Hugging Face model inside OpenRLHF's ``Actor`` (through a DeepSpeed engine when there is one)."""
    model = getattr(actor, "model", actor)
    model = getattr(model, "module", model)  # DeepSpeedEngine.module
    if type(model).__name__.startswith("Peft"):
        raise ConfigError("the policy is a PEFT/LoRA model: dcr_ray refits full weights under the base model's "
                          "checkpoint names; merge the adapters (merge_and_unload) before serving dcr_tensors()")
    return model


class PolicyOwnerMixin(OwnerMixin):
    """Mix into OpenRLHF's ``PolicyModelActor`` (or any actor holding ``self.actor`` / ``self.model``).

    Reads ``self.actor`` (OpenRLHF's ``Actor``) or else ``self.model``; rank and world size from
    ``self._rank`` / ``self._world_size`` (OpenRLHF's ``BaseDistributedActor``; a lone actor is rank 0 of
    1); ZeRO stage and AutoTP size from ``self.strategy.args.ds`` when present. Set
    ``dcr_rollout_dtype`` to serve another dtype than BF16 (the engines' ``dtype``).
    """

    dcr_rollout_dtype: torch.dtype = torch.bfloat16

    def dcr_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's share of the policy's checkpoint tensors, in the rollout dtype."""
        actor = getattr(self, "actor", None)
        model = hf_model(actor if actor is not None else self.model)
        rank, world = int(getattr(self, "_rank", 0)), int(getattr(self, "_world_size", 1))
        if self._dcr_partitioned():
            return self._dcr_gathered(model, rank, world)
        with torch.no_grad():
            state = checkpoint_state_dict(model)
            mine = set(owned_names(list(state), rank, world))
            return {n: t.detach().to(self.dcr_rollout_dtype).contiguous() for n, t in state.items() if n in mine}

    # -- ZeRO-3 / AutoTP (GPU-only) --------------------------------------------------------------------
    def _dcr_partitioned(self) -> bool:
        ds = getattr(getattr(getattr(self, "strategy", None), "args", None), "ds", None)
        return ds is not None and (getattr(ds, "zero_stage", 0) == 3 or getattr(ds, "tensor_parallel_size", 1) > 1)

    def _dcr_gathered(self, model: torch.nn.Module, rank: int, world: int) -> dict[str, torch.Tensor]:
        """Gather every parameter (collective, same order on all ranks) and keep this rank's share.

        Parameter names are the in-memory ones: this path serves models whose in-memory names are their
        checkpoint names (dense decoder LMs; transformers' fused MoE layouts need the non-partitioned path).
        """
        import deepspeed  # GPU-only path

        ds = self.strategy.args.ds
        params = list(model.named_parameters())
        mine = set(owned_names([n for n, _ in params], rank, world))
        out = {}
        for name, p in params:
            if ds.tensor_parallel_size > 1:
                ctx = deepspeed.module_inject.layers.GatherReplacedLayerParams([p], model, enabled=True)
            else:
                ctx = deepspeed.zero.GatheredParameters([p], enabled=True)
            with ctx, torch.no_grad():
                if name in mine:
                    out[name] = p.data.to(self.dcr_rollout_dtype).clone()
        return out


def dcr_policy_actor(policy_actor_cls: Any, **ray_options: Any) -> Any:
    """A Ray actor class: OpenRLHF's ``PolicyModelActor`` (a Ray ``ActorClass`` or a plain class) with
    :class:`PolicyOwnerMixin` mixed in. ``ray_options`` default to ``num_gpus=1`` like OpenRLHF's."""
    import ray

    base = getattr(policy_actor_cls, "__ray_actor_class__", policy_actor_cls)
    cls = base if issubclass(base, PolicyOwnerMixin) else type(  # pickled by value to the workers
        f"Dcr{base.__name__}", (PolicyOwnerMixin, base), {})
    return ray.remote(**(ray_options or {"num_gpus": 1}))(cls)


__all__ = ["PolicyOwnerMixin", "dcr_policy_actor", "hf_model"]
