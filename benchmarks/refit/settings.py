"""What one run of the refit benchmark measures: its settings and the constants shared by its modules."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

#: Change rates of the stress cases (``--rates``, given there in %). 0.01%: about one page in five of a
#: BF16 baseline holds a change, so dirtied pages show whether promote writes only those.
STRESS_RATES = (0.0001, 0.01, 0.03, 0.05)
TRANSPORTS = ("relay", "object_store")
#: Peer encodings timed on the same link and data (:mod:`benchmarks.peers`).
PEERS = ("dense", "areal", "slime")
#: Receivers of the real-update cases: the ``transformers`` engine (case ``adamw``) and dcr_ray-started vLLM
#: engines on CPU (case ``adamw-vllm``, mirror mode). ``--receivers``; vLLM only in full runs by default.
RECEIVERS = ("hf", "vllm")
#: Case name of each receiver's real-update case.
RECEIVER_CASE = {"hf": "adamw", "vllm": "adamw-vllm"}
#: Headline link: 1 Gbit/s, a cross-region link (NeMo-DCR's testbed: <= 5 Gbit/s per node) on which the
#: measured full-checkpoint reference is a real transfer of seconds and this machine's CPU, not only the
#: link, decides the refit time. Not a link chosen so slow that speedup equals the byte ratio.
DEFAULT_LINK_MBPS = 1000.0
DEFAULT_LATENCY_MS = 25.0
#: Other links measured on the 3% relay case (``--links``, Mbit/s; 0 = no link emulation): a slow
#: cross-region link and a fast in-region one. Each gets its own measured references.
DEFAULT_LINKS = (100.0, 10000.0, 0.0)
#: Payload bucket: None = the library's default ``CodecConfig`` (bucket and diff chunk), as a user gets it.
DEFAULT_BUCKET_MIB = None


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
    baseline: str = "memory"
    receivers: tuple = ("hf",)
    links: tuple = ()
    #: rounds of (plain, context, auto) 3% relay refits at every link (0: none; :mod:`.codings`)
    coding_rounds: int = 0

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "Settings":
        size = a.size or ("medium" if a.quick else "large")
        return cls(quick=a.quick, size=size, link_mbps=a.link_mbps, latency_s=a.latency_ms / 1e3,
                   engines=a.engines, owners=2, rates=tuple(float(x) / 100 for x in a.rates.split(",")),
                   transports=tuple(a.transports.split(",")), real_steps=a.real_steps or (2 if a.quick else 3),
                   real_lr=a.lr, bucket_bytes=_bucket_bytes(a.bucket_mib), seed=a.seed, sweep=not a.no_sweep,
                   reference_check=not a.no_reference_check, cases=tuple(a.cases.split(",")),
                   baseline=a.baseline, receivers=_receivers(getattr(a, "receivers", None), a.quick),
                   links=_links(getattr(a, "links", None), a.link_mbps),
                   coding_rounds=0 if getattr(a, "no_codings", False) else (2 if a.quick else 3))


def _bucket_bytes(mib) -> int | None:
    """``--bucket-mib``: None keeps the library's default bucket (and diff chunk)."""
    if mib is None:
        return None
    if mib <= 0:
        raise ValueError(f"--bucket-mib must be a positive number of MiB, got {mib}")
    return int(mib) << 20


def _links(arg, headline: float) -> tuple:
    """``--links``: comma-separated Mbit/s (0 = no link emulation), the headline link left out; default
    :data:`DEFAULT_LINKS`."""
    got = DEFAULT_LINKS if arg is None else tuple(float(x) for x in arg.split(",") if x.strip())
    bad = [x for x in got if x < 0]
    if bad:
        raise ValueError(f"--links: bandwidths must be >= 0 Mbit/s (0 = no link), got {bad}")
    return tuple(x for x in got if x != headline)


def _receivers(arg: str | None, quick: bool) -> tuple:
    """``--receivers``: comma-separated; default ``hf,vllm`` (``hf`` alone with ``--quick``: vLLM engines
    take about a minute each to start on CPU)."""
    got = tuple(arg.split(",")) if arg else (("hf",) if quick else RECEIVERS)
    bad = [r for r in got if r not in RECEIVERS]
    if bad:
        raise ValueError(f"--receivers: unknown {bad}; choose from {','.join(RECEIVERS)}")
    return got
