"""An RL-style loop in the shape of veRL / OpenRLHF: a data-parallel trainer worker group (Ray actors
that are also dcr_ray owners), rollout engines that tag every sample with the policy version that
produced it, and a delta refit between rollout and the next optimizer step.

    python examples/rl_loop.py [--iters 3] [--dp 2] [--async-staging]

Where dcr_ray plugs into an existing loop:
  1. the trainer worker class mixes in ``dcr_ray.OwnerMixin`` and implements ``dcr_tensors()``
     (its share of the canonical BF16 weights, by ``dcr_ray.owned_names``),
  2. ``dcr_ray.launch(owners=worker_group, clusters=..., engine=...)`` once,
  3. ``ray.get(refit.remote())`` after every optimizer step, instead of a weight broadcast.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

import dcr_ray  # noqa: E402
from dcr_ray.testing.models import ModelSpec  # noqa: E402
from dcr_ray.testing.trainer import TinyTrainer  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=3, help="rollout -> train -> refit iterations")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel trainer ranks (owners)")
    ap.add_argument("--engines", type=int, default=2, help="rollout engines (one cluster)")
    ap.add_argument("--async-staging", action="store_true",
                    help="engines stage payloads while serving the old version (async RL)")
    args = ap.parse_args(argv)

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    spec = ModelSpec(size="tiny")
    Worker = ray.remote(num_cpus=0)(TinyTrainer)
    group = [Worker.remote(spec, lr=1e-4, rank=r, world=args.dp) for r in range(args.dp)]
    refit = dcr_ray.launch(owners=group, clusters=[dcr_ray.ClusterSpec(name="rollout", engines=args.engines)],
                           engine=dcr_ray.HFEngine(spec),
                           config=dcr_ray.RefitConfig(engines=dcr_ray.EngineConfig(
                               apply="staged" if args.async_staging else "in_place")))
    engines = list(refit.engines().values())
    prompts = [[1 + i, 7, 42, 99] for i in range(4)]
    for it in range(args.iters):
        # rollout: each engine serves a share of the prompts; every result names its policy version
        shares = [prompts[i::len(engines)] for i in range(len(engines))]
        results = ray.get([e.generate.remote(s, 12) for e, s in zip(engines, shares) if s])
        versions = sorted({r["version"] for r in results})
        samples = [p + o["token_ids"] for r, s in zip(results, shares) for p, o in zip(s, r["outputs"])]
        n = min(len(x) for x in samples)
        batch = [x[:n] for x in samples]
        # train: the same batch on every data-parallel rank keeps replicas bit-identical
        loss = ray.get([w.step_on.remote(batch) for w in group])[0]
        report = ray.get(refit.remote())
        print(f"iter {it}: rollouts from policy v{versions} | loss {loss:.4f} | refit -> {report}")
    refit.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
