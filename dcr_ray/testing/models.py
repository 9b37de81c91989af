"""Small ``transformers`` causal LMs built locally with random init (no hub downloads).

Used by the quickstart, tests and benchmarks. ``ModelSpec`` fixes the architecture and seed, so every
process that builds the same spec gets the same initial bits (trainer, engines, dense reference).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

#: Named sizes. ``tiny`` starts in well under a second; ``mini`` (1.7 M parameters) has MLP tensors large
#: enough to be split into chunks, so an owner's changes fill many small frames; ``small`` has tens of
#: millions of parameters;
#: ``large`` is ~0.6 B parameters (~1.2 GB of BF16), the largest comfortable on a 24 GiB 2-core box.
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
    "mini": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=16384),
    "medium": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                   num_key_value_heads=8, vocab_size=32000),
    "large": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=20, num_attention_heads=24,
                  num_key_value_heads=8, vocab_size=32000),
}


#: Architectures :func:`build_model` knows. The MoE ones have 4 experts of which each token uses 2, and
#: expert MLPs a quarter as wide as the dense preset's (a multiple of 32, as vLLM's CPU MoE kernels need).
ARCHS = ("qwen2", "llama", "qwen3", "qwen3_moe", "mixtral")
#: Each architecture's ``transformers`` modelling module: what a prefork server adds to the library's preloads
#: (``dcr_ray.prefork.start(extra=...)``) so that workers building that model start with it imported.
MODELING_MODULES = {arch: f"transformers.models.{arch}.modeling_{arch}" for arch in ARCHS}
MOE_EXPERTS = 4
MOE_TOP_K = 2


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelSpec:
    """Which model to build."""

    arch: str = "qwen2"
    """One of :data:`ARCHS`: dense ``qwen2``, ``llama``, ``qwen3``, or mixture-of-experts ``qwen3_moe``,
    ``mixtral`` (4 experts, top-2). All have head_dim = hidden / heads >= 32, as vLLM's CPU kernels need."""
    size: str = "tiny"
    """A key of :data:`PRESETS`."""
    seed: int = 0
    """Seed of the random init: equal specs give bit-identical models."""
    dtype: str = "bfloat16"
    """Storage dtype of the model (the rollout copy is BF16)."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the LM head."""

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"ModelSpec.arch must be one of {ARCHS}, got {self.arch!r}")
        if self.size not in PRESETS:
            raise ValueError(f"ModelSpec.size must be one of {sorted(PRESETS)}, got {self.size!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    def with_seed(self, seed: int) -> "ModelSpec":
        """The same architecture with another random init (e.g. engines whose bootstrap replaces it)."""
        return replace(self, seed=seed)

    def __call__(self) -> torch.nn.Module:
        """A spec is a model factory: ``HFEngine(spec)`` / ``VllmEngine(spec)`` build it in each engine."""
        return build_model(self)


def hf_config(spec: ModelSpec):
    """The ``transformers`` config object for ``spec``."""
    import transformers

    kw = dict(PRESETS[spec.size], max_position_embeddings=512, tie_word_embeddings=spec.tie_word_embeddings,
              dtype=spec.dtype)
    expert_width = kw["intermediate_size"] // MOE_EXPERTS
    if spec.arch in ("qwen3", "qwen3_moe"):
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    if spec.arch == "qwen3_moe":
        kw.update(moe_intermediate_size=expert_width, num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K)
    if spec.arch == "mixtral":
        kw.update(intermediate_size=expert_width, num_local_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K)
    cls = {"qwen2": "Qwen2Config", "llama": "LlamaConfig", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig",
           "mixtral": "MixtralConfig"}[spec.arch]
    return getattr(transformers, cls)(**kw)


def build_model(spec: ModelSpec = ModelSpec()) -> torch.nn.Module:
    """Build the causal LM of ``spec`` on CPU with a deterministic random init, in ``spec.dtype``."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(spec)
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.to(getattr(torch, spec.dtype)).eval()


def save_checkpoint(model: torch.nn.Module, directory: str) -> str:
    """Write ``model`` as a Hugging Face checkpoint directory (config + safetensors); returns it."""
    model.save_pretrained(directory, safe_serialization=True)
    return directory
