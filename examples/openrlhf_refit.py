"""OpenRLHF's vLLM rollout engines refit by dcr_ray instead of ``broadcast_to_vllm`` (runs on CPU).

    python examples/openrlhf_refit.py [--iters 3] [--dp 2] [--engines 1] [--partial-rollout]

What runs, per iteration: OpenRLHF's rollout actors (started by OpenRLHF's own ``create_vllm_engines``
through the recipe, so they carry the ``dcr`` weight-transfer backend) sample rollouts; every policy
rank takes one real AdamW step on them; then the trainer's ``broadcast_to_vllm`` - here
:class:`~dcr_ray.integrations.openrlhf.DcrBroadcastMixin`'s - refits the engines with only the changed
bits (``--partial-rollout``: as OpenRLHF's async ``TrainingActor`` does with partial rollouts, generation
is paused with requests kept, refit, resumed). At the end the engines' served parameter storage is
compared, as integer bits, with a fresh engine loaded densely from the trainer's final weights.

On CPU the policy ranks are :class:`~dcr_ray.testing.openrlhf_policy.CpuPolicyActor` (OpenRLHF's
``PolicyModelActor`` needs DeepSpeed and flash-attn on GPUs), and Ray gets one *logical* GPU per engine
because OpenRLHF places each engine on a ``{"GPU": 1, "CPU": 1}`` bundle. On a GPU cluster the same
three swaps go into OpenRLHF's ``train_ppo_ray.py``: see ``docs/guide_openrlhf.md``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from types import SimpleNamespace

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

import dcr_ray  # noqa: E402
from dcr_ray.integrations.openrlhf import DcrBroadcastMixin  # noqa: E402

log = logging.getLogger("openrlhf_refit")

PROMPTS = [[3, 14, 15, 92, 65, 35], [27, 18, 28, 18, 28, 45], [1, 1, 2, 3, 5, 8], [99, 98, 97, 96, 95, 94]]


class Trainer(DcrBroadcastMixin):
    """What OpenRLHF's ``PPOTrainer`` / async ``TrainingActor`` hold that ``broadcast_to_vllm`` reads."""

    def __init__(self, engines, partial_rollout: bool):
        self.vllm_engines = engines
        self.args = SimpleNamespace(vllm=SimpleNamespace(enable_sleep=False))
        self._partial_rollout = partial_rollout


def _params(max_tokens: int, temperature: float, seed: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                          seed=seed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=3, help="rollout -> train -> refit iterations")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel policy ranks (each owns a share of the names)")
    ap.add_argument("--engines", type=int, default=1, help="OpenRLHF vLLM engines")
    ap.add_argument("--partial-rollout", action="store_true",
                    help="async mode with partial rollouts: pause generation (requests kept) around each refit")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import torch
    from safetensors.torch import save_file

    from dcr_ray.engines.vllm import VLLM_CPU_RUNTIME_ENV
    from dcr_ray.integrations.openrlhf import adopt_vllm_engines, create_vllm_engines
    from dcr_ray.testing.openrlhf_policy import CpuPolicyActor
    from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint

    cpu = not torch.cuda.is_available()
    # address="local": a new Ray of this process's own, never another one on this host; logical GPUs for the
    # engines and the reference engine (OpenRLHF's placement groups keep theirs until the job ends)
    ray.init(address="local" if cpu else None, num_cpus=2 if cpu else None, num_gpus=args.engines + 1 if cpu else None,
             include_dashboard=False, logging_level="ERROR")
    workdir = tempfile.mkdtemp(prefix="openrlhf_refit_")
    pretrain = save_checkpoint(build_model(ModelSpec(arch="qwen2", seed=1)), os.path.join(workdir, "pretrain"))

    # 1. OpenRLHF's create_vllm_engines, through the recipe: same arguments, engines with the dcr backend
    log.info("starting %d OpenRLHF vLLM engine(s) from %s", args.engines, pretrain)
    engines = create_vllm_engines(
        num_engines=args.engines, tensor_parallel_size=1, pretrain=pretrain, seed=0, full_determinism=False,
        enable_prefix_caching=True, enforce_eager=True, max_model_len=512, gpu_memory_utilization=0.9,
        engine_kwargs={"skip_tokenizer_init": True},  # the random-init model has no tokenizer
        actor_options={"runtime_env": VLLM_CPU_RUNTIME_ENV} if cpu else None)
    # 2. the policy ranks are the owners (on GPUs: dcr_policy_actor(PolicyModelActor) ranks)
    Rank = ray.remote(num_cpus=0)(CpuPolicyActor)
    ranks = [Rank.remote(pretrain, lr=1e-5, rank=r, world_size=args.dp) for r in range(args.dp)]
    # 3. one launch adopts OpenRLHF's engines
    log.info("adopting them: dcr_ray.launch")
    refit = dcr_ray.launch(owners=ranks, clusters=[dcr_ray.ClusterSpec(
        name="rollout", adopt=adopt_vllm_engines(engines, checkpoint=pretrain))])
    trainer = Trainer(engines, args.partial_rollout)
    trainer.dcr_refit = refit
    try:
        for it in range(args.iters):
            outs = ray.get([engines[i % len(engines)].generate.remote(p, _params(8, 1.0, seed=it * 100 + i))
                            for i, p in enumerate(PROMPTS)])
            seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs)]
            rewards = [sum(t % 2 == 0 for t in o.outputs[0].token_ids) / 8 for o in outs]
            loss = ray.get([r.fit.remote(seqs, len(PROMPTS[0]), rewards) for r in ranks])[0]
            trainer.broadcast_to_vllm()  # was: per-parameter NCCL broadcast of the whole model
            log.info("iter %d: reward %.3f loss %+.4f | %s", it, sum(rewards) / len(rewards), loss,
                     trainer.dcr_last_report)
        served = ray.get([e.dcr_storage_digests.remote() for e in engines])
        state = ray.get(ranks[0].rollout_state.remote())
    finally:
        refit.shutdown()
    for e in engines:
        ray.kill(e)
    # the check: a fresh engine loaded densely from the trainer's weights serves the same bits
    dense = os.path.join(workdir, "dense")
    os.makedirs(dense)
    for f in os.listdir(pretrain):  # the config, and the trainer's final weights as the only shard
        if f.endswith(".json") and "index" not in f:
            shutil.copy(os.path.join(pretrain, f), dense)
    save_file(state, os.path.join(dense, "model.safetensors"), metadata={"format": "pt"})
    log.info("starting a fresh engine from the trainer's final weights (a dense load) to compare")
    [fresh] = create_vllm_engines(
        num_engines=1, tensor_parallel_size=1, pretrain=dense, seed=0, full_determinism=False,
        enable_prefix_caching=True, enforce_eager=True, max_model_len=512, gpu_memory_utilization=0.9,
        engine_kwargs={"skip_tokenizer_init": True},
        actor_options={"runtime_env": VLLM_CPU_RUNTIME_ENV} if cpu else None)
    want = ray.get(fresh.dcr_storage_digests.remote())
    ok = all(s == want for s in served)
    log.info("every engine serves exactly the bits of a dense load of the final policy: %s", ok)
    ray.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
