"""Helpers shared by the vLLM tests: a real AdamW trainer, frame-level refits of a backend, checkpoints."""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from dcr_ray.codec import BaselineStore, FrameMeta, encode_frames
from dcr_ray.engines.base import checkpoint_state_dict
from dcr_ray.engines.vllm.worker.storage import int_view
from dcr_ray.testing.models import ModelSpec, build_model

if TYPE_CHECKING:
    from dcr_ray.engines.vllm import VllmBackend

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [900, 17, 4]]
MAX_TOKENS = 8


class Trainer:
    """FP32 master copy of a spec's model trained with AdamW on random tokens; BF16 rollout bits."""

    def __init__(self, spec: ModelSpec, lr: float = 1e-3):
        self.model = build_model(spec).float().train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.vocab = self.model.config.vocab_size

    def step(self, seed: int) -> None:
        ids = torch.randint(0, self.vocab, (2, 16), generator=torch.Generator().manual_seed(seed))
        loss = self.model(input_ids=ids, labels=ids).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    @torch.no_grad()
    def bf16(self) -> dict[str, torch.Tensor]:
        return {n: t.to(torch.bfloat16).contiguous() for n, t in checkpoint_state_dict(self.model).items()}


def bits_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(int_view(a.contiguous()),
                                                                      int_view(b.contiguous()))


def write_checkpoint(template: str, directory: str, state: dict[str, torch.Tensor]) -> str:
    """A checkpoint directory with ``template``'s config and ``state`` as its weights."""
    os.makedirs(directory, exist_ok=True)
    for f in os.listdir(template):
        if f.endswith(".json") and "index" not in f:
            shutil.copy(os.path.join(template, f), directory)
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return directory


def refit(engine: VllmBackend, store: BaselineStore, state: dict[str, torch.Tensor], *, bucket_bytes: int = 32 << 10):
    """Diff ``state`` against the committed baseline, send it as frames, flush, promote. Returns #frames."""
    base = engine.version
    deltas = [d for d in (store.diff(n, t) for n, t in state.items()) if d.chunks]
    meta = FrameMeta(transfer=f"refit-{base}", attempt=0, producer="owner-0", payload=0, base=base, target=base + 1)
    frames = list(encode_frames(deltas, meta, bucket_bytes=bucket_bytes))
    for data in frames:
        engine.apply_bytes(data)  # validated against the engine's tensors and version, then sent to its workers
    engine.flush()
    store.begin(base + 1)
    for d in deltas:
        store.add_pending(d)
    store.promote(base + 1)
    return len(frames), sum(d.changed for d in deltas)


def served_bits_equal(url: str, version: int, state: dict) -> bool:
    """Whether a ``vllm serve`` process's workers serve exactly ``state``'s bits: box digests of every tensor,
    checked by the workers themselves inside one ``update_weights`` call that writes nothing."""
    from dcr_ray.engines.vllm.sync import make_calls
    from dcr_ray.errors import BackendError
    from dcr_ray.sharding.digest import box_digests

    whole = [(n, (0,) * t.dim(), tuple(t.shape)) for n, t in state.items()]
    boxes = [[n, list(a), list(b), d] for (n, a, b), d in box_digests(state, whole).items()]
    calls = make_calls([url], 60.0)
    calls.start_weight_update()
    try:
        calls.update_weights({"base": version, "target": version, "verify": boxes})
    except BackendError:
        return False
    calls.finish_weight_update(str(version))
    return True


def start_user_engine(checkpoint: str, tp: int = 1, load_format: str = "auto"):
    """What a user's own code does: an ``LLM`` in a Ray actor, with the ``dcr`` weight-transfer backend.

    ``tp=2``: two tensor-parallel CPU workers in their own processes (vLLM's multiprocessing executor),
    each bound to one core (this machine has one NUMA node, so vLLM needs the binding given).
    ``load_format="dcr_unpacked"``: its CPU weights unpacked (the capture path).
    """
    import ray
    from vllm import LLM

    from dcr_ray.engines.vllm import VLLM_CPU_RUNTIME_ENV

    env = VLLM_CPU_RUNTIME_ENV
    kw = dict(distributed_executor_backend="uni")
    if tp > 1:
        env = {**env, "env_vars": {**env["env_vars"], "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                                   "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp))}}
        kw = dict(distributed_executor_backend="mp", tensor_parallel_size=tp)
    UserLLM = ray.remote(num_cpus=0, runtime_env=env)(LLM)
    return UserLLM.remote(model=checkpoint, enforce_eager=True, skip_tokenizer_init=True, seed=0,
                          weight_transfer_config={"backend": "dcr"}, load_format=load_format, **kw)


def serve(handle) -> list[dict]:
    """A user engine's greedy outputs on :data:`PROMPTS` (token ids and logprobs)."""
    import ray

    from dcr_ray.engines.vllm.serving import greedy

    return ray.get(handle.__ray_call__.remote(greedy, PROMPTS, MAX_TOKENS))


def fresh_engine_outputs(template: str, directory: str, state: dict[str, torch.Tensor], tp: int = 1,
                         load_format: str = "auto") -> list[dict]:
    """What a freshly started user engine serves with ``state`` (written as a checkpoint beside ``template``)."""
    import ray

    fresh = start_user_engine(write_checkpoint(template, directory, state), tp, load_format)
    try:
        return serve(fresh)
    finally:
        ray.kill(fresh)
