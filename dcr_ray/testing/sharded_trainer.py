"""A sharded trainer for examples and tests: Ray actors as the ranks of a ``torch.distributed`` gloo
group, training a tiny HF model on a 2-D (data parallel x tensor parallel) device mesh.

Tensor parallelism is PyTorch's own ``parallelize_module`` (``ColwiseParallel`` for q/k/v and gate/up,
``RowwiseParallel`` for o/down, as torchtitan plans a Llama block); data parallelism is FSDP2
``fully_shard`` over the ``dp`` mesh dimension (FP32 parameters, AdamW). Every parameter is then a
DTensor; :meth:`ShardedTrainer.dcr_tensors` hands dcr_ray this rank's shards as BF16 (a local
conversion), which map onto the canonical tensors by their placements: nothing is gathered for a
refit. :meth:`ShardedTrainer.gathered_state` gathers the full model (a collective, for checks only).

Canonical names (``names=``):

* ``"model"``: the ``transformers`` in-memory tensors, what :class:`dcr_ray.HFEngine` holds (an MoE
  layer's experts stacked in ``mlp.experts.gate_up_proj`` / ``down_proj``);
* ``"checkpoint"``: the saved checkpoint's tensors, what vLLM (and :class:`CheckpointHFEngine`) hold:
  each stacked expert parameter is sent as a :class:`~dcr_ray.sharding.Shard` whose
  :func:`~dcr_ray.sharding.stacked_experts` spec maps every expert block onto its per-expert tensors
  (``mlp.experts.<e>.gate_proj.weight`` ...). The per-expert names are read off ``transformers``' own
  reverse conversion (:func:`dcr_ray.checkpoint_state_dict`) at start, so no per-model rule lives here.

Tied embeddings: ``named_parameters`` lists a tied parameter once (``model.embed_tokens.weight``), as
the checkpoint does, so each canonical tensor is sent once.

The driver picks a free port and creates ``world = dp * tp`` actors with ranks ``0..world-1``
(:func:`start_ranks`). Rank ``r`` sits at mesh coordinate ``(r // tp, r % tp)``; the ranks of one
``dp`` group take the same batch, each ``dp`` group its own.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Callable

import torch

from dcr_ray.actors.owner.held import OwnerMixin
from dcr_ray.engines.base import canonical_state_dict, checkpoint_state_dict
from dcr_ray.testing.models import ModelSpec, build_model

#: How each projection of a decoder layer is split by tensor parallelism (torchtitan's Llama plan).
TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
           "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
           "mlp.down_proj": "rowwise"}


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ints(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def checkpoint_names(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, Callable[[int], tuple[str, ...]]]]:
    """How ``model``'s parameters map onto its checkpoint tensors where the names differ:
    ``(renamed, stacked)``. ``renamed``: parameter -> checkpoint name (Mixtral's ``mlp.gate`` is
    ``block_sparse_moe.gate`` on disk); ``stacked``: stacked expert parameter -> ``names(e)``, the
    checkpoint tensors expert ``e``'s block splits into along its dimension 1, in order.

    Found by matching bits against ``transformers``' own reverse conversion: each checkpoint tensor that
    is not a parameter of ``model`` is located as a whole parameter or a row block of one expert of one
    stacked parameter (a random init makes them unique).
    """
    params = dict(model.named_parameters())
    ck = checkpoint_state_dict(model)
    loose = {n: t for n, t in ck.items() if n not in params}
    renamed, out = {}, {}
    for pn, p in params.items():
        if pn in ck:
            continue
        p = p.detach()
        same = [cn for cn, t in loose.items() if t.shape == p.shape and torch.equal(_ints(t), _ints(p))]
        if same:
            renamed[pn] = same[0]
            continue
        if p.dim() != 3:
            raise ValueError(f"{pn}: no checkpoint tensor holds it")
        found: dict[int, list[tuple[int, str]]] = {}
        for cn, t in loose.items():
            if t.dim() != 2 or tuple(t.shape[1:]) != tuple(p.shape[2:]) or p.shape[1] % t.shape[0]:
                continue
            rows = t.shape[0]
            for e in range(p.shape[0]):
                for k in range(p.shape[1] // rows):
                    if torch.equal(_ints(p[e, k * rows:(k + 1) * rows]), _ints(t)):
                        found.setdefault(e, []).append((k * rows, cn))
        if sorted(found) != list(range(p.shape[0])):
            raise ValueError(f"{pn}: could not locate every expert's checkpoint tensors ({sorted(found)})")
        table = {e: tuple(n for _, n in sorted(v)) for e, v in found.items()}
        out[pn] = table.__getitem__
    return renamed, out


class ShardedTrainer(OwnerMixin):
    """Rank ``rank`` of a ``dp x tp`` gloo group training ``spec``'s model with AdamW (FP32 master)."""

    def __init__(self, spec: ModelSpec, *, rank: int, dp: int, tp: int, port: int, lr: float = 1e-3,
                 names: str = "model", threads: int = 1):
        from torch.distributed.device_mesh import init_device_mesh

        if names not in ("model", "checkpoint"):
            raise ValueError(f"names must be 'model' or 'checkpoint', got {names!r}")
        torch.set_num_threads(threads)
        # gathered_state() all-gathers strided shards in two steps, which torch warns may reduce in another
        # order on each rank: an all-gather moves bits and does no arithmetic, so it is exact here
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo", rank=rank, world_size=dp * tp)
        self.spec, self.rank, self.dp, self.tp, self.names = spec, rank, dp, tp, names
        self.mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        self._renamed, self._experts = checkpoint_names(build_model(spec)) if names == "checkpoint" else ({}, {})
        self.model = build_model(spec).float().train()  # the same seed on every rank: the same initial bits
        self.vocab = self.model.config.vocab_size
        self._shard(self.model)
        # parameters replicated over "tp" but applied to tensor-parallel (per-head) activations, such as
        # Qwen3's q_norm/k_norm: each tp rank's gradient covers its own heads only, so they are summed
        self._tp_partial = [p for n, p in self.model.named_parameters()
                            if tp > 1 and ".self_attn." in n and "tp" not in (p.device_mesh.mesh_dim_names or ())]
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.steps = 0

    def _shard(self, model) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        layers = model.model.layers
        if self.tp > 1:
            for layer in layers:  # stacked MoE experts are not Linear layers: FSDP shards them by expert
                plan = {k: styles[v]() for k, v in TP_PLAN.items() if _has(layer, k)}
                parallelize_module(layer, self.mesh["tp"], plan)
        for layer in layers:
            fully_shard(layer, mesh=self.mesh["dp"])
        fully_shard(model, mesh=self.mesh["dp"])

    def step(self, seed: int, batch: int = 2, seq: int = 16) -> float:
        """One real AdamW step on a random-token batch: each data-parallel index ``rank // tp`` has its own,
        which the tensor-parallel ranks at that index share."""
        g = torch.Generator().manual_seed(seed * self.dp + self.rank // self.tp)
        ids = torch.randint(0, self.vocab, (batch, seq), generator=g)
        loss = self.model(input_ids=ids, labels=ids).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in self._tp_partial:
            torch.distributed.all_reduce(p.grad.to_local(), group=self.mesh["tp"].get_group())
        self.opt.step()
        self.steps += 1
        return float(loss.detach())

    def dcr_tensors(self) -> dict:
        """Canonical name -> this rank's BF16 DTensor shard (dcr_ray reads its placements); with
        ``names="checkpoint"``, stacked MoE experts as :class:`~dcr_ray.sharding.Shard` values onto the
        per-expert checkpoint tensors."""
        from dcr_ray.sharding import Shard, experts_from_dtensor

        out = {}
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                t = p.detach().to(torch.bfloat16)  # a DTensor op on the local shard: no communication
                names = self._experts.get(n)
                if names is None:
                    out[self._renamed.get(n, n)] = t
                    continue
                share = experts_from_dtensor(t, names)
                if share is not None:  # None: a replica whose part of a replicated stack is empty
                    out[n] = Shard(*share)
        return out

    def gathered_state(self) -> dict[str, torch.Tensor]:
        """The full BF16 model under the canonical names (a collective: call it on every rank at once).

        With ``names="checkpoint"`` the checkpoint tensors come from ``transformers``' own reverse
        conversion of the gathered model, independent of the shard specs :meth:`dcr_tensors` uses."""
        model = build_model(self.spec)  # BF16, unsharded: the gathered bits replace its initial ones
        dense = dict(model.named_parameters())
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                dense[n].copy_(p.detach().full_tensor().to(torch.bfloat16))
        sd = checkpoint_state_dict(model) if self.names == "checkpoint" else canonical_state_dict(model)
        return {n: t.detach().clone().contiguous() for n, t in sd.items()}

    def covers(self) -> list[str]:
        """The canonical tensors this rank sends (a part of) by :meth:`dcr_tensors`."""
        from dcr_ray.sharding import resolve_shards

        return sorted({n for sh in resolve_shards(self.dcr_tensors()).values() for n in sh.spec.names})

    def baseline_numel(self) -> int:
        """Elements in this rank's committed baseline (after attach): its shard, not the model."""
        owner = self.dcr_delta_owner()
        return sum(owner.store.tensor(n).numel() for n in owner.store.names())

    def placements(self) -> dict[str, str]:
        """Parameter name -> its DTensor placements (for docs and tests)."""
        return {n: str(p.placements) for n, p in self.model.named_parameters()}


class CheckpointHFEngine:
    """Engine factory (tests, examples): a ``transformers`` model whose canonical tensors are the
    *checkpoint* layout (per-expert MoE tensors, as vLLM holds them): a host mirror built by
    :func:`dcr_ray.checkpoint_state_dict`. For refit checks; it does not serve from the mirror."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec

    def __call__(self):
        from dcr_ray.engines.hf import TransformersBackend

        backend = TransformersBackend(self.spec)
        backend._tensors = {n: t.detach().clone().contiguous()
                            for n, t in checkpoint_state_dict(backend.model).items()}
        return backend


def _has(layer, path: str) -> bool:
    try:
        layer.get_submodule(path)
        return True
    except AttributeError:
        return False


def start_ranks(spec: ModelSpec, *, dp: int, tp: int, lr: float = 1e-3, names: str = "model") -> list:
    """Create the ``dp * tp`` ranks as Ray actors (no CPU reserved) and wait until the group is formed."""
    import ray

    port = free_port()
    Rank = ray.remote(num_cpus=0)(ShardedTrainer)
    ranks = [Rank.remote(spec, rank=r, dp=dp, tp=tp, port=port, lr=lr, names=names) for r in range(dp * tp)]
    ray.get([r.placements.remote() for r in ranks])
    return ranks


__all__ = ["CheckpointHFEngine", "ShardedTrainer", "TP_PLAN", "free_port", "checkpoint_names", "start_ranks"]
