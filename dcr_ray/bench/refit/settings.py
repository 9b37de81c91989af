"""What one run of the refit benchmark measures: its settings and the constants shared by its modules."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

#: Change rates of the stress cases (``--rates``, given there in %).
STRESS_RATES = (0.01, 0.03, 0.05)
TRANSPORTS = ("relay", "object_store")
#: Peer encodings timed on the same link and data (:mod:`dcr_ray.bench.peers`).
PEERS = ("dense", "areal", "slime")
#: Receivers of the real-update cases: the ``transformers`` engine (case ``adamw``) and dcr_ray-started vLLM
#: engines on CPU (case ``adamw-vllm``, mirror mode). ``--receivers``; vLLM only in full runs by default.
RECEIVERS = ("hf", "vllm")
#: Case name of each receiver's real-update case.
RECEIVER_CASE = {"hf": "adamw", "vllm": "adamw-vllm"}
#: Headline link: slow enough that the full-checkpoint reference of the large model takes minutes and a
#: refit on a small CPU-only machine is link-bound (BENCHMARKS.md; the sweep shows where that stops).
DEFAULT_LINK_MBPS = 20.0
DEFAULT_LATENCY_MS = 25.0
#: Payload bucket (raw bytes) and diff chunk of the benchmark's RefitConfig: small enough that a model
#: of ~1 GB streams in many payloads (the link starts after the first bucket is built).
DEFAULT_BUCKET_MIB = 2


@dataclass(frozen=True)
class Settings:
    """One run: the stress model, the headline link, the cluster, the cases and what else to measure."""

    quick: bool
    size: str
    link_mbps: float
    latency_s: float
    engines: int
    owners: int
    rates: tuple
    transports: tuple
    real_steps: int
    real_lr: float
    bucket_bytes: int
    seed: int
    sweep: bool
    reference_check: bool
    cases: tuple = ("stress", "adamw")
    baseline: str = "mmap"
    receivers: tuple = ("hf",)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "Settings":
        size = a.size or ("medium" if a.quick else "large")
        return cls(quick=a.quick, size=size, link_mbps=a.link_mbps, latency_s=a.latency_ms / 1e3,
                   engines=a.engines, owners=2, rates=tuple(float(x) / 100 for x in a.rates.split(",")),
                   transports=tuple(a.transports.split(",")), real_steps=a.real_steps or (2 if a.quick else 3),
                   real_lr=a.lr, bucket_bytes=a.bucket_mib << 20, seed=a.seed, sweep=not a.no_sweep,
                   reference_check=not a.no_reference_check, cases=tuple(a.cases.split(",")),
                   baseline=a.baseline, receivers=_receivers(getattr(a, "receivers", None), a.quick))


def _receivers(arg: str | None, quick: bool) -> tuple:
    """``--receivers``: comma-separated; default ``hf,vllm`` (``hf`` alone with ``--quick``: vLLM engines
    take about a minute each to start on CPU)."""
    got = tuple(arg.split(",")) if arg else (("hf",) if quick else RECEIVERS)
    bad = [r for r in got if r not in RECEIVERS]
    if bad:
        raise ValueError(f"--receivers: unknown {bad}; choose from {','.join(RECEIVERS)}")
    return got
