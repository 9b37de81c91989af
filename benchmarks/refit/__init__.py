"""``dcr-ray bench refit``: end-to-end refit time against full-checkpoint references measured over the same link.

What runs (real Ray on this machine, loopback only):

- **Topology.** One rollout cluster behind an emulated cross-cluster link
  (:class:`~dcr_ray.testing.links.LinkModel`: ``--link-mbps`` bandwidth, ``--latency-ms`` one-way latency).
  ``relay``: the cluster's head relay pulls every payload across the link once and fans it out to
  ``--engines`` engines. ``object_store``: owners write frames to object storage (a local directory in
  the training region) and every engine reads them across its own node link (the same model, per node).
  Two owners (one per half of the canonical names). The link is switched on *after* the dense bootstrap,
  so only refits are timed. The owners' ``RefitConfig`` is the library's default codec (16 MiB buckets,
  1 Mi-element diff chunks) unless ``--bucket-mib`` says otherwise.
- **Links.** The headline link (``--link-mbps``, default 1 Gbit/s: a cross-region link on which the CPU,
  not only the link, decides) carries every case; the 3% relay case is also measured at ``--links``
  (default 100 Mbit/s, 10 Gbit/s and no link emulation), each with its own measured references
  (:mod:`.sweep`). Nothing in the link table is modelled.
- **Cases.** ``adamw``: a real ``small`` model (:class:`~dcr_ray.testing.trainer.TinyTrainer`, FP32 master
  weights, ``torch.optim.AdamW``, constant LR) refitted after real optimizer steps; its measured change
  rate is reported. ``stress-1%/3%/5%``: synthetic BF16 tensors with the canonical names and shapes of
  ``ModelSpec(size="large")`` (602 M parameters, 1.2 GB; ``medium`` with ``--quick``), held by two
  owner actors, received by engines with a light backend (the same in-place ``apply_decoded`` as the
  ``transformers`` backend, undo record kept in the same pass, without a model around it); each case changes a uniform ``rate`` of the
  elements by a relative ``1e-2 * randn`` (one ulp when rounding would leave an element unchanged),
  the recipe of ``dcr-ray bench codec``.
  ``adamw-vllm``: the same trainer, steps and refits received by dcr_ray-started vLLM engines on CPU
  (:class:`~dcr_ray.engines.vllm.VllmEngine`, mirror mode: frames into the host mirror, touched fused groups
  through vLLM's ``reload_weights``). ``--receivers hf,vllm`` picks the receivers of the real-update cases
  (default both; ``hf`` alone with ``--quick``: vLLM engines take about half a minute each to start here).
- **References, measured** (:mod:`.reference`) through the same system and link, at every link:
  ``measured_reference_seconds`` = the uncompressed canonical checkpoint delivered into every engine
  (dcr_ray's dense path with raw frame sections), ``measured_dense_refit_seconds`` = dcr_ray's own dense
  refit (zstd frames). ``reference_seconds`` is the link-model formula (``bytes * 8 / bw + latency``),
  kept beside them; speedups against all three are reported (``speedup_vs_measured_reference``,
  ``speedup_vs_measured_dense_refit``, ``speedup``), targets use the measured reference.
- **Promote.** ``promote_seconds`` (the slowest owner's promote itself), ``ready_for_next_seconds`` (until
  every owner's background promote has finished: when the next refit could start, beside ``dcr_seconds``,
  when engines serve v+1), ``dirty_pages`` (with ``--baseline mmap`` only: baseline pages the promote
  dirtied, ``/proc/self/smaps`` of the baseline files after an ``msync`` before the refit, :mod:`.pages`)
  vs ``changed_pages`` (pages holding a change) and ``baseline_pages``, and ``tensors`` (tensors with a
  change) of ``tensors_total``.
- **Peers** on the same link and data: ``dense`` (per-tensor streaming of raw bits; apply = copy),
  ``areal`` (AReaL-DTE style: int32 index + raw value, dense fallback at 0.9x) and ``slime``
  (uint16 gaps + zstd, overwrite values) from :mod:`benchmarks.peers`. Their construction (bitwise
  diff + encode) and apply are *measured* in the owner processes on this machine; their time is
  ``construction + modelled link time of their bytes + apply`` (they encode, then send, then apply:
  no streaming overlap), reported per case in ``peers``; ``peers_link_s`` gives the link time alone.
- **Per case:** refit seconds (coordinator: prepare -> commit record -> activate), reference seconds,
  speedup, wire and reference bytes, byte ratio (reference / wire bytes), efficiency (speedup / byte
  ratio), delta construction and apply seconds, the transport lower bound (busiest link's serialisation
  time + latency) as a fraction of refit time, owner and engine peak RSS during the refit (VmHWM,
  reset before each refit), and ``bit_exact``: SHA-256 of every tensor's integer view, owners vs every
  engine, after every refit, plus an element-wise integer-view comparison at the end of each topology.
  Per engine (``engine_kind``: ``synthetic``, ``hf`` or ``vllm``): ``engine_apply_s`` (validate + apply
  + flush, what its ACK reported; ``apply_seconds`` is the slowest engine's), ``engine_peaks`` (peak RSS
  during the refit) and ``engine_refit_added_bytes`` (peak minus the RSS the refit began with). A vLLM
  engine's tensors are its host mirror, so at the end of ``adamw-vllm`` the engines' *served* state is also
  compared with a fresh vLLM engine started from a checkpoint of the trainer's current BF16 weights:
  digests of every live parameter and buffer, greedy token ids and logprobs, all with ``==``
  (``served``, folded into ``bit_exact``).
- **Projection** to 30B/120B/235B/1T from the measured per-byte costs and the link model at 5 Gbit/s,
  beside NeMo-DCR's published numbers. A projection, labelled as such.

Modules, one idea each:

- :mod:`.settings`      :class:`Settings` of one run and the constants the modules share
- :mod:`.cli`           the ``refit`` subcommand's options and entry point (:func:`run`)
- :mod:`.actors`        what runs inside the Ray actors: synthetic owners, the AdamW trainer, the light
  engine backend, and their probes (fingerprints, peer measurements, engines' apply seconds)
- :mod:`.topology`      launching a stress or AdamW topology (transformers or vLLM engines); switching its
  emulated link
- :mod:`.memory`        peak RSS of the actor processes during a refit
- :mod:`.measure`       one measured refit (with its promote), bit-exactness checks, the reference formula
- :mod:`.reference`     the full-checkpoint references measured through the same system and link
- :mod:`.pages`         dirtied and changed baseline pages of a promote
- :mod:`.served`        what vLLM engines serve vs a fresh dense vLLM engine (live storage, greedy outputs)
- :mod:`.runner`        the whole run (:func:`run_bench`): every case, then the derived results
- :mod:`.sweep`         the link table: the 3% refit measured at every link
- :mod:`.large_models`  the projection to large models
- :mod:`.targets`       the targets at the headline link and their checks
- :mod:`.report`        text table, Markdown tables, PNG plot
- :mod:`.progress`      progress lines on stderr
"""

from __future__ import annotations

from benchmarks.refit.actors import (BenchOwner, BenchTrainer, SyntheticBackend, SyntheticEngine,
                                        canonical_shapes)
from benchmarks.refit.cli import add_parser, run
from benchmarks.refit.large_models import (NEMO, PROJECTION_APPLIERS, PROJECTION_LINK_MBPS, PROJECTION_MODELS,
                                              PROJECTION_OWNERS, projection)
from benchmarks.refit.measure import check_exact, check_exact_elementwise, measure_refit, reference_seconds
from benchmarks.refit.memory import MemorySampler
from benchmarks.refit.report import format_table, markdown, plot, receivers_markdown
from benchmarks.refit.pages import count_pages, dirty_pages, write_back
from benchmarks.refit.reference import attach_references, measure_references
from benchmarks.refit.runner import case_label, run_adamw, run_bench, run_stress, summarise
from benchmarks.refit.served import DenseVllmReference, check_served, engine_served
from benchmarks.refit.settings import (DEFAULT_BUCKET_MIB, DEFAULT_LATENCY_MS, DEFAULT_LINK_MBPS, DEFAULT_LINKS,
                                          PEERS, RECEIVER_CASE, RECEIVERS, STRESS_RATES, TRANSPORTS, Settings)
from benchmarks.refit.sweep import link_table
from benchmarks.refit.targets import TARGETS, checks
from benchmarks.refit.topology import Topology, launch_adamw, launch_stress

__all__ = [
    "BenchOwner", "BenchTrainer", "DEFAULT_BUCKET_MIB", "DEFAULT_LATENCY_MS", "DEFAULT_LINKS", "DEFAULT_LINK_MBPS",
    "DenseVllmReference", "MemorySampler", "NEMO", "PEERS", "PROJECTION_APPLIERS", "PROJECTION_LINK_MBPS",
    "PROJECTION_MODELS", "PROJECTION_OWNERS", "RECEIVERS", "RECEIVER_CASE", "STRESS_RATES", "Settings",
    "SyntheticBackend", "SyntheticEngine", "TARGETS", "TRANSPORTS", "Topology", "add_parser", "attach_references",
    "canonical_shapes", "case_label", "check_exact", "check_exact_elementwise", "check_served", "checks",
    "count_pages", "dirty_pages", "engine_served", "format_table", "launch_adamw", "launch_stress", "link_table",
    "markdown", "measure_references", "measure_refit", "plot", "projection", "receivers_markdown",
    "reference_seconds", "run", "run_adamw", "run_bench", "run_stress", "summarise", "write_back",
]
