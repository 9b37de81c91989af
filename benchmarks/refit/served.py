"""What vLLM engines serve after the refits, against a fresh vLLM engine loaded densely with the same weights.

A vLLM engine's :meth:`~dcr_ray.engines.vllm.VllmBackend.tensors` is its host mirror, which is what the
per-refit fingerprints compare; the runtime serves from its own (on CPU: repacked) parameter storage.
So at the end of an ``adamw-vllm`` case, :func:`check_served` also compares, with ``==`` on integer views
and on the outputs:

- the BLAKE2b digest of every parameter and buffer the model serves with (:func:`~dcr_ray.engines.vllm.serving.served_digests`,
  read from the live model), engine vs a fresh engine started from a checkpoint of the trainer's current BF16
  weights (:class:`DenseVllmReference`);
- greedy token ids and their log-probabilities on a few prompts;
- the fresh engine's own checkpoint tensors vs the trainer's (that the reference holds what it should).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from benchmarks.refit.progress import log

#: Prompts (token ids) and greedy tokens of the served-output comparison.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13], [900, 17, 4]]
MAX_TOKENS = 8


def _served_digests(self) -> dict[str, str]:
    """An engine actor's digests of its vLLM model's live storage (run in it with ``__ray_call__``)."""
    from dcr_ray.engines.vllm.serving import served_digests

    return served_digests(self.backend.llm)[0]


class DenseVllmReference:
    """A fresh ``VllmBackend`` started from a checkpoint of ``state`` (canonical BF16 tensors), in its own
    process: ``spec``'s config and the trainer's bits, at ``version``."""

    def __init__(self, spec, state: dict, version: int):
        from safetensors.torch import save_file

        from dcr_ray.engines.vllm import VllmBackend
        from dcr_ray.testing.models import build_model, save_checkpoint

        self.dir = tempfile.mkdtemp(prefix="dcr_bench_dense_vllm_")
        save_checkpoint(build_model(spec), self.dir)  # config + generation config as the engines' had
        for f in os.listdir(self.dir):
            if f.endswith(".safetensors") or f.endswith(".safetensors.index.json"):
                os.remove(os.path.join(self.dir, f))
        save_file({n: t.contiguous() for n, t in state.items()}, os.path.join(self.dir, "model.safetensors"),
                  metadata={"format": "pt"})
        self.backend = VllmBackend(self.dir, version=version)

    def probe(self, prompts, max_tokens) -> dict:
        from benchmarks.refit.actors import _digests
        from dcr_ray.engines.vllm.serving import served_digests

        return {"outputs": self.backend.generate(prompts, max_tokens),
                "served": served_digests(self.backend.llm)[0],
                "checkpoint": _digests(self.backend.tensors())}

    def close(self) -> None:
        self.backend.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def engine_served(topo) -> dict:
    """Every engine's outputs on :data:`PROMPTS` and its live-storage digests (before the topology stops)."""
    import ray

    outs = ray.get([e.generate.remote(PROMPTS, MAX_TOKENS) for e in topo.engines.values()])
    digests = ray.get([e.__ray_call__.remote(_served_digests) for e in topo.engines.values()])
    return {eid: {"outputs": o["outputs"], "version": o["version"], "served": d}
            for eid, o, d in zip(topo.engines, outs, digests)}


def check_served(spec, state: dict, want_digests: dict, engines: dict) -> dict:
    """Start a fresh dense vLLM engine from ``state`` and compare ``engines`` (from :func:`engine_served`)
    with it exactly. Returns what was compared and whether each matched."""
    import ray

    from benchmarks.refit.actors import _digests

    version = next(iter(engines.values()))["version"]
    t = time.perf_counter()
    Ref = ray.remote(num_cpus=0, max_restarts=0)(DenseVllmReference)
    ref = Ref.remote(spec, state, version)
    try:
        got = ray.get(ref.probe.remote(PROMPTS, MAX_TOKENS))
        ray.get(ref.close.remote())
    finally:
        ray.kill(ref)
    served = {eid: e["served"] == got["served"] for eid, e in engines.items()}
    tokens = {eid: [o["token_ids"] for o in e["outputs"]] == [o["token_ids"] for o in got["outputs"]]
              for eid, e in engines.items()}
    logprobs = {eid: [o["logprobs"] for o in e["outputs"]] == [o["logprobs"] for o in got["outputs"]]
                for eid, e in engines.items()}
    out = {"reference_checkpoint_exact": got["checkpoint"] == want_digests == _digests(state),
           "served_storage_exact": all(served.values()), "tokens_equal": all(tokens.values()),
           "logprobs_equal": all(logprobs.values()), "per_engine": {eid: served[eid] and tokens[eid] and logprobs[eid]
                                                                    for eid in engines},
           "served_tensors": len(got["served"]), "prompts": len(PROMPTS), "max_tokens": MAX_TOKENS,
           "version": version, "seconds": time.perf_counter() - t}
    out["exact"] = all(out[k] for k in ("reference_checkpoint_exact", "served_storage_exact", "tokens_equal",
                                        "logprobs_equal"))
    log(f"  served vs a fresh dense vLLM engine at v{version}: {len(got['served'])} live parameters/buffers "
        f"{'==' if out['served_storage_exact'] else '!='}, greedy tokens {'==' if out['tokens_equal'] else '!='}, "
        f"logprobs {'==' if out['logprobs_equal'] else '!='} ({out['seconds']:.0f}s)")
    return out
