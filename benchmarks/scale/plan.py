"""What the scale sweep runs: the synthetic models by element count, the points of each sweep, and how much
memory a point is expected to need (pure Python: no Ray, no torch).

A *point* is one topology: a model size, a number of clusters and engines per cluster. The three sweeps share
points (the engine sweep's 1-engine point is the size sweep's point at that size; the cluster sweep's
1-cluster point is the engine sweep's point with as many engines), and each point runs once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Qwen2-style layouts ``(hidden, intermediate, layers, heads, kv_heads, vocab)`` by element count. 40M, 200M
#: and 600M are ``ModelSpec`` sizes ``small``, ``medium`` and ``large`` (the shapes the refit benchmark uses;
#: :func:`layout_shapes` gives exactly their canonical shapes); 10M and 1.2B extend the line below and above
#: with the same recipe (untied LM head, biased q/k/v).
LAYOUTS: dict[str, tuple[int, int, int, int, int, int]] = {
    "10M": (256, 704, 8, 4, 2, 8192),
    "40M": (512, 1408, 8, 8, 4, 16384),
    "200M": (1024, 2816, 12, 16, 8, 32000),
    "600M": (1536, 4096, 20, 24, 8, 32000),
    "1.2B": (2048, 5632, 24, 32, 8, 32000),
}
#: Sizes of the full sweep and of ``--quick``.
SIZES = tuple(LAYOUTS)
QUICK_SIZES = ("10M", "40M")
#: Engines per cluster of the engine sweep, clusters of the cluster sweep.
ENGINES = (1, 2, 4, 8)
QUICK_ENGINES = (1, 2)
CLUSTERS = (1, 2, 4)
QUICK_CLUSTERS = (1, 2)
#: The size the engine and cluster sweeps run at, and engines per cluster of the cluster sweep.
FANOUT_SIZE = "200M"
QUICK_FANOUT_SIZE = "10M"
CLUSTER_ENGINES = 2
QUICK_CLUSTER_ENGINES = 1
#: Engines of the size sweep: one, so the 1.2B point (two owners and an engine of 2.4 GB each) fits 24 GiB.
SIZE_ENGINES = 1
#: Owners of every point (the names split by ``owned_names``, as in the refit benchmark).
OWNERS = 2
#: Elements whose bits change per refit (uniform, the refit benchmark's stress recipe).
CHANGE_RATE = 0.01


def layout_shapes(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int) -> dict:
    """Canonical (Hugging Face Qwen2) names and shapes of one layout, computed without building it."""
    hd = hidden // heads
    kv = kv_heads * hd
    out = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.q_proj.bias": (hidden,),
            p + "self_attn.k_proj.weight": (kv, hidden), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        })
    out["model.norm.weight"] = (hidden,)
    out["lm_head.weight"] = (vocab, hidden)
    return out


def shapes(size: str) -> dict:
    """Names and shapes of the synthetic model ``size`` (a key of :data:`LAYOUTS`)."""
    if size not in LAYOUTS:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(LAYOUTS)}")
    return layout_shapes(*LAYOUTS[size])


def numel(size: str) -> int:
    """Elements of the synthetic model ``size``."""
    return sum(math.prod(s) for s in shapes(size).values())


@dataclass(frozen=True, order=True)
class Point:
    """One topology of the sweep: ``clusters`` clusters of ``engines`` light engines each, fed by
    :data:`OWNERS` synthetic owners of the model ``size``."""

    size: str
    clusters: int
    engines: int

    @property
    def key(self) -> str:
        return f"{self.size}/c{self.clusters}/e{self.engines}"


@dataclass(frozen=True)
class Plan:
    """The sweeps of one run and the distinct points they need, in the order they run."""

    sizes: tuple
    engines: tuple
    clusters: tuple
    fanout_size: str
    cluster_engines: int

    @classmethod
    def of(cls, quick: bool, sizes=None, engines=None, clusters=None, fanout_size=None) -> "Plan":
        return cls(sizes=tuple(sizes or (QUICK_SIZES if quick else SIZES)),
                   engines=tuple(engines or (QUICK_ENGINES if quick else ENGINES)),
                   clusters=tuple(clusters or (QUICK_CLUSTERS if quick else CLUSTERS)),
                   fanout_size=fanout_size or (QUICK_FANOUT_SIZE if quick else FANOUT_SIZE),
                   cluster_engines=QUICK_CLUSTER_ENGINES if quick else CLUSTER_ENGINES)

    def sweeps(self) -> dict[str, list[Point]]:
        """``{"size": [...], "engines": [...], "clusters": [...]}``: the points each sweep reads."""
        return {"size": [Point(s, 1, SIZE_ENGINES) for s in self.sizes],
                "engines": [Point(self.fanout_size, 1, e) for e in self.engines],
                "clusters": [Point(self.fanout_size, c, self.cluster_engines) for c in self.clusters]}

    def points(self) -> list[Point]:
        """Every distinct point once: the fan-out sweeps first, then sizes from small to large, so the
        largest model runs last (its memory estimate extrapolates from the ones before it, and a failure
        there leaves every other point measured)."""
        sw = self.sweeps()
        fan = sorted({*sw["engines"], *sw["clusters"]}, key=lambda p: (p.clusters * p.engines, p.clusters))
        sizes = sorted(sw["size"], key=lambda p: numel(p.size))
        out: list[Point] = []
        for p in fan + sizes:
            if p not in out:
                out.append(p)
        return out


#: Memory of one process per byte it holds, for the estimate before any point ran: an owner's RSS over its
#: share and an engine's over the model (the refit benchmark's 600M run: owner peak 3.38 GB for a 0.75 GB
#: share, engine 2.97 GB for 1.20 GB), each process's start (imports), and the object store (the relay keeps
#: a transfer's payloads until its end: up to the model's compressed bytes during the dense bootstrap).
OWNER_PER_SHARE = 4.5
ENGINE_PER_MODEL = 2.5
PROCESS_START_BYTES = 400 << 20
STORE_PER_MODEL = 1.0


def estimate_bytes(point: Point, measured: dict | None = None) -> int:
    """Memory ``point`` is expected to need at its peak. ``measured``: ``{size: (peak bytes, start bytes)}`` of
    points already run with the same clusters and engines (every process's peak and start summed, the object
    store's peak in the peak): the processes' starts of the largest of them, plus what they held above their
    starts scaled linearly by the model's elements (how memory grows is what the sweep measures, so the estimate
    for an unmeasured size is linear); else the per-byte constants above."""
    n = numel(point.size)
    same = {s: v for s, v in (measured or {}).items() if v and v[0]}
    if same:
        ref = max(same, key=numel)
        peak, start = same[ref]
        return int(start + max(0, peak - start) * n / numel(ref))
    model = 2 * n
    engines = point.clusters * point.engines
    return int(OWNER_PER_SHARE * model + ENGINE_PER_MODEL * model * engines + STORE_PER_MODEL * model
               + PROCESS_START_BYTES * (OWNERS + engines + point.clusters + 1))
