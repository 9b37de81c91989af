"""Launching a benchmark topology, and switching the emulated link at its cluster boundary.

A topology is ``dcr_ray.launch`` of one ``rollout`` cluster behind an emulated link
(:class:`~dcr_ray.testing.links.EmulatedLinks`), fed either by two synthetic owners (``stress``, light
engines) or by one real AdamW trainer (``adamw``: ``transformers`` engines, or dcr_ray-started vLLM engines
on CPU). The link stays off through the dense bootstrap and is switched on before the first timed refit.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass

from benchmarks.refit.actors import (BenchOwner, BenchTrainer, SyntheticEngine, actor_pid, canonical_shapes,
                                        time_backend_flush)
from benchmarks.refit.progress import log
from benchmarks.refit.settings import Settings


@dataclass
class Topology:
    """A launched refit with the handles, process ids and sizes the measurements need."""

    kind: str  # "stress" or "adamw"
    transport: str
    refit: object
    owners: dict
    engines: dict
    heads: list
    owner_pids: list
    engine_pids: list
    canonical_bytes: int
    numel: int
    model: str
    link_mbps: float | None = None
    latency_s: float = 0.0
    owner_share_bytes: int = 0
    engine_kind: str = "synthetic"  # "synthetic" (stress), "hf" or "vllm"
    spec: object = None  # the ModelSpec of the adamw cases
    tensors: int = 0  # canonical tensors of the model
    cleanup: list = None  # directories to remove at shutdown (vLLM engines' starting checkpoint)

    @property
    def engine_pid_of(self) -> dict:
        """Engine id -> process id."""
        return dict(zip(self.engines, self.engine_pids))

    def _link_holders(self) -> dict:
        """Actors whose emulated link a payload crosses: relay heads, or engines reading storage."""
        return {f"head{i}": h for i, h in enumerate(self.heads)} if self.transport == "relay" else self.engines

    def set_link(self, mbps: float | None, latency_s: float) -> None:
        import ray

        from dcr_ray.testing.links import set_link

        self.link_mbps, self.latency_s = mbps, (latency_s if mbps else 0.0)
        ray.get([a.__ray_call__.remote(set_link, mbps, latency_s) for a in self._link_holders().values()])

    def set_coding(self, coding: str) -> None:
        """``CodecConfig.coding`` of the refits that follow (``plain``, ``context`` or ``auto``): the
        coordinator passes its choice to the owners per refit."""
        import ray

        ray.get(self.refit.actor.__ray_call__.remote(_set_coding, coding))

    def link_busy(self) -> dict:
        """Link -> (serialisation seconds, bytes) so far."""
        import ray

        from dcr_ray.testing.links import link_busy

        holders = self._link_holders()
        return dict(zip(holders, ray.get([a.__ray_call__.remote(link_busy) for a in holders.values()])))

    def shutdown(self) -> None:
        import ray

        try:
            self.refit.shutdown()
        finally:
            for h in self.owners.values():
                ray.kill(h)
            for d in self.cleanup or ():
                shutil.rmtree(d, ignore_errors=True)


def _set_coding(coordinator_self, coding: str) -> None:
    import dataclasses

    cfg = coordinator_self.config
    coordinator_self.config = dataclasses.replace(cfg, codec=dataclasses.replace(cfg.codec, coding=coding))


def _config(s: Settings, transport: str):
    from dcr_ray.config import CodecConfig, CommitConfig, RefitConfig, TransportConfig

    codec = (CodecConfig() if s.bucket_bytes is None  # the library's defaults, as a user gets them
             else CodecConfig(bucket_bytes=s.bucket_bytes, chunk_elems=s.bucket_bytes // 8))
    return RefitConfig(transport=TransportConfig(kind=transport), codec=codec, commit=CommitConfig(timeout_s=900.0))


def _launch(s: Settings, transport: str, **kw):
    """``dcr_ray.launch`` of one ``rollout`` cluster whose boundary is an emulated link (off until set)."""
    import dcr_ray
    from dcr_ray.config import validate
    from dcr_ray.testing.links import EmulatedLinks

    clusters = [dcr_ray.ClusterSpec(name="rollout", engines=s.engines)]
    config = validate(_config(s, transport), clusters, kw["owners"], kw.get("engine"))
    return dcr_ray.launch(clusters=clusters, config=config, transport=EmulatedLinks(config, {"rollout": (None, 0.0)}),
                          **kw)


def _finish_launch(kind, transport, refit, owners, canonical, numel, model, s, share) -> Topology:
    import ray

    engines = refit.engines()
    heads = [r for rid, r in ray.get(refit.actor.handles.remote())["relays"].items() if rid.endswith("/head")]
    owner_pids = ray.get([h.__ray_call__.remote(actor_pid) for h in owners.values()])
    engine_pids = ray.get([e.__ray_call__.remote(actor_pid) for e in engines.values()])
    topo = Topology(kind, transport, refit, owners, engines, heads, owner_pids, engine_pids, canonical, numel,
                    model, owner_share_bytes=share)
    topo.set_link(s.link_mbps, s.latency_s)
    return topo


def launch_stress(s: Settings, transport: str, shapes: dict | None = None, kind: str = "stress",
                  owners: int | None = None) -> Topology:
    """``s.owners`` (or ``owners``) synthetic owners of ``s.size``'s canonical tensors (or of ``shapes``),
    ``s.engines`` light engines."""
    import ray

    from dcr_ray.actors.owner.delta import owned_names
    from dcr_ray.options import actor_options

    shapes = shapes or canonical_shapes(s.size)
    n_owners = owners or s.owners
    numel = sum(math.prod(v) for v in shapes.values())
    log(f"[{transport}] {kind} topology: {s.size if kind == 'stress' else kind} shapes, {len(shapes)} tensors, "
        f"{numel / 1e6:.0f} M BF16 elements ({2 * numel / 1e9:.2f} GB), {n_owners} owners, {s.engines} engines; "
        f"building + dense "
        f"bootstrap (no link emulation during bootstrap)")
    Owner = ray.remote(BenchOwner)
    names = list(shapes)
    owners, share = {}, 0
    for r in range(n_owners):
        mine = {n: shapes[n] for n in owned_names(names, r, n_owners)}
        share = max(share, 2 * sum(math.prod(v) for v in mine.values()))
        owners[f"owner{r}"] = Owner.options(**actor_options("owner", f"dcr_bench_owner{r}")).remote(mine, s.seed)
    ray.get([h.bench_set_baseline.remote(s.baseline) for h in owners.values()])
    t = time.perf_counter()
    refit = _launch(s, transport, owners=owners, engine=SyntheticEngine(shapes))
    log(f"  up in {time.perf_counter() - t:.1f}s")
    topo = _finish_launch(kind, transport, refit, owners, 2 * numel, numel, s.size if kind == "stress" else kind,
                          s, share)
    topo.tensors = len(shapes)
    return topo


def launch_adamw(s: Settings, transport: str, receiver: str = "hf") -> Topology:
    """One real trainer of the ``small`` model (``tiny`` with ``--size tiny``; AdamW) as owner; ``s.engines``
    engines of ``receiver``:
    ``hf`` (:class:`~dcr_ray.HFEngine`) or ``vllm`` (:class:`~dcr_ray.engines.vllm.VllmEngine` started by
    dcr_ray from a checkpoint of another random init; the dense bootstrap replaces its bits)."""
    import ray

    from benchmarks.common import bench_engine
    from dcr_ray.options import actor_options
    from dcr_ray.testing.models import ModelSpec

    size = "tiny" if s.size == "tiny" else "small"  # --size tiny: the smoke test's seconds-long run
    spec = ModelSpec(size=size, seed=s.seed)
    log(f"[{transport}] real-update topology: {size} model, AdamW lr={s.real_lr:g}, {s.engines} "
        f"{'vLLM (CPU)' if receiver == 'vllm' else 'HF'} engines")
    engine, cleanup = bench_engine(receiver, spec, s.seed + 1, "dcr_bench_vllm_")
    Trainer = ray.remote(BenchTrainer)
    trainer = Trainer.options(**actor_options("owner", "dcr_bench_trainer")).remote(spec, lr=s.real_lr)
    owners = {"trainer": trainer}
    ray.get(trainer.bench_set_baseline.remote(s.baseline))
    t = time.perf_counter()
    try:
        refit = _launch(s, transport, owners=owners, engine=engine)
    except BaseException:
        ray.kill(trainer)
        for d in cleanup:
            shutil.rmtree(d, ignore_errors=True)
        raise
    sizes = ray.get(trainer.__ray_call__.remote(lambda self: [t.numel() for t in self.dcr_tensors().values()]))
    numel = sum(sizes)
    log(f"  up in {time.perf_counter() - t:.1f}s ({numel / 1e6:.1f} M parameters)")
    topo = _finish_launch("adamw", transport, refit, owners, 2 * numel, numel, size, s, 2 * numel)
    topo.engine_kind, topo.spec, topo.cleanup, topo.tensors = receiver, spec, cleanup, len(sizes)
    ray.get([e.__ray_call__.remote(time_backend_flush) for e in topo.engines.values()])
    return topo
