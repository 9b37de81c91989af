"""What one run of ``dcr-ray bench live`` measures: the cases, the load, the link."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

#: The ways a new policy reaches the engines, each measured on the same engines and link:
#: ``dcr`` (dcr_ray's refit), ``dense_sync`` (OpenRLHF/veRL's shape: pause, every tensor across the link
#: and through the engine's load path, resume) and ``fetch_reload`` (SkyRL's shape: while serving, the new
#: model crosses the link into a local checkpoint beside the engine; then pause and reload it).
METHODS = ("dcr", "dense_sync", "fetch_reload")
#: How dcr_ray's engines take a version: in place (generation pauses from prepare to activate) or staged.
MODES = ("in_place", "staged")
RECEIVERS = ("hf", "vllm")
#: ``adamw``: real AdamW steps of the trainer (``--lr``); ``stress3``: 3% of every tensor's elements change.
DATA = ("adamw", "stress3")
DEFAULT_LINK_MBPS = 1000.0
DEFAULT_LATENCY_MS = 25.0


@dataclass(frozen=True)
class LiveSettings:
    quick: bool
    size: str  #: model preset of HF engines (``medium``; ``--quick``: ``small``)
    vllm_size: str  #: model preset of vLLM engines (``small`` by default: see ``--vllm-size``)
    refits: int  #: timed refits per case
    receivers: tuple
    modes: tuple
    data: tuple
    methods: tuple
    engines: int
    link_mbps: float
    latency_s: float
    lr: float
    quiet_s: float  #: seconds of generation measured before the refits, with nothing else running
    tokens: int  #: tokens per generate call of the closed-loop load
    seed: int = 0
    gpus_per_engine: float = 0  #: a GPU machine: engines on GPUs (vLLM then takes the CUDA capture path)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "LiveSettings":
        return cls(quick=a.quick, size=a.size or ("small" if a.quick else "medium"),
                   vllm_size=a.vllm_size or a.size or "small",
                   refits=a.refits or (2 if a.quick else 4), receivers=tuple(a.receivers.split(",")),
                   modes=tuple(a.modes.split(",")), data=tuple(a.data.split(",")),
                   methods=tuple(a.methods.split(",")), engines=a.engines, link_mbps=a.link_mbps,
                   latency_s=a.latency_ms / 1e3, lr=a.lr, quiet_s=2.0 if a.quick else 4.0, tokens=a.tokens,
                   seed=a.seed, gpus_per_engine=a.gpus_per_engine)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small model, 2 refits per case (<= 10 min here)")
    p.add_argument("--size", default=None, help="model preset (default: medium; --quick: small)")
    p.add_argument("--vllm-size", default=None,
                   help="model preset of vLLM engines (default: --size if given, else small). Two vLLM CPU "
                        "engines of the medium model held 5.7 and 6.1 GB each during a dense sync, beside a "
                        "6.5 GB AdamW trainer: past the 95%% memory line of a 24 GiB machine, where Ray kills "
                        "workers. On a larger machine or GPUs, pass --vllm-size medium")
    p.add_argument("--refits", type=int, default=None, help="timed refits per case (default 4; --quick 2)")
    p.add_argument("--receivers", default="hf,vllm", help="engine backends (hf, vllm)")
    p.add_argument("--modes", default=",".join(MODES), help="dcr_ray apply modes (in_place, staged)")
    p.add_argument("--data", default=",".join(DATA), help="what changes per step (adamw, stress3)")
    p.add_argument("--methods", default=",".join(METHODS), help="dcr, dense_sync, fetch_reload")
    p.add_argument("--engines", type=int, default=2, help="engines in the rollout cluster")
    p.add_argument("--link-mbps", type=float, default=DEFAULT_LINK_MBPS, help="emulated cluster link")
    p.add_argument("--latency-ms", type=float, default=DEFAULT_LATENCY_MS)
    p.add_argument("--lr", type=float, default=1e-6,
                   help="AdamW learning rate of the adamw steps (1e-6: about 1-2%% of BF16 elements change per step)")
    p.add_argument("--tokens", type=int, default=4, help="tokens per generate call of the load")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpus-per-engine", type=float, default=0,
                   help="GPUs per engine (a GPU machine: vLLM engines take the CUDA loader-capture path)")
    p.add_argument("--json", default=None, help="write the run (cases, raw samples, commit) here; PNG beside it")
