"""Launching one live-benchmark topology: a rollout cluster of serving engines behind an emulated link,
fed by a real AdamW trainer (``adamw``) or by synthetic owners that change 3% of every tensor (``stress3``)."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass

from benchmarks.live import stream
from benchmarks.live.settings import parse_mode
from benchmarks.refit.progress import log


@dataclass
class LiveTopology:
    refit: object
    owners: dict
    engines: dict
    heads: list
    cleanup: list

    def shutdown(self) -> None:
        import ray

        try:
            self.refit.shutdown()
        finally:
            for h in self.owners.values():
                ray.kill(h)
            for d in self.cleanup:
                shutil.rmtree(d, ignore_errors=True)


def launch(s, receiver: str, mode: str, data: str):
    """Returns ``(topology, step)``: ``step(i)`` makes the i-th change on the owners. Every engine's generation
    is timed per token (:mod:`.stream`)."""
    import ray

    import dcr_ray
    from benchmarks.refit.actors import BenchOwner, BenchTrainer, canonical_shapes
    from dcr_ray.options import actor_options
    from dcr_ray.testing.links import EmulatedLinks
    from benchmarks.common import bench_engine
    from dcr_ray.testing.models import ModelSpec

    size = s.vllm_size if receiver.startswith("vllm") else s.size
    spec = ModelSpec(size=size, seed=s.seed)
    engine, cleanup = bench_engine(receiver, spec, s.seed + 1, "dcr_bench_live_vllm_")
    if data == "adamw":
        trainer = ray.remote(BenchTrainer).options(**actor_options("owner", "dcr_live_trainer")).remote(
            spec, lr=s.lr)
        owners = {"trainer": trainer}

        def step(i: int) -> None:
            ray.get(trainer.step.remote(seed=1000 + i))
    else:
        shapes = canonical_shapes(size)
        Owner = ray.remote(BenchOwner)
        owners = {f"owner{r}": Owner.options(**actor_options("owner", f"dcr_live_owner{r}")).remote(
            {n: shapes[n] for n in dcr_ray.owned_names(list(shapes), r, 2)}, s.seed) for r in range(2)}

        def step(i: int) -> None:
            ray.get([h.perturb.remote(0.03, 1000 + i) for h in owners.values()])
    clusters = [dcr_ray.ClusterSpec(name="rollout", engines=s.engines, gpus_per_engine=s.gpus_per_engine)]
    apply, switch = parse_mode(mode)
    config = dcr_ray.RefitConfig(engines=dcr_ray.EngineConfig(apply=apply, switch=switch),
                                 transport=dcr_ray.TransportConfig(kind="relay"),
                                 commit=dcr_ray.CommitConfig(timeout_s=900.0))
    config = dcr_ray.config.validate(config, clusters, owners, engine)
    log(f"[live] {receiver} engines x{s.engines}, {size} model, {mode}, {data}: launching")
    t = time.perf_counter()
    try:
        refit = dcr_ray.launch(owners=owners, clusters=clusters, engine=engine, config=config,
                               transport=EmulatedLinks(config, {"rollout": (None, 0.0)}))
    except BaseException:
        for h in owners.values():
            ray.kill(h)
        for d in cleanup:
            shutil.rmtree(d, ignore_errors=True)
        raise
    log(f"  up in {time.perf_counter() - t:.1f}s")
    heads = [r for rid, r in ray.get(refit.actor.handles.remote())["relays"].items() if rid.endswith("/head")]
    topo = LiveTopology(refit, owners, refit.engines(), heads, cleanup)
    ray.get([e.__ray_call__.remote(stream.install) for e in topo.engines.values()])  # every token timed
    return topo, step


def set_link(topo: LiveTopology, mbps: float | None, latency_s: float) -> None:
    """The emulated cluster link every method crosses (``None``: none, and no latency)."""
    import ray

    from dcr_ray.testing.links import set_link

    ray.get([h.__ray_call__.remote(set_link, mbps, latency_s if mbps is not None else 0.0) for h in topo.heads])
