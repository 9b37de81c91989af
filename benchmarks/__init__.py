"""Benchmarks behind ``dcr-ray bench ...`` and ``dcr-ray chaos``: part of a checkout, not of the installed
``dcr_ray`` package (``dcr_ray.cli.find_benchmarks`` finds this package; tests import it from the
checkout's root). The library never imports it.

Each benchmark is a module or package here that exposes ``add_parser(subparsers)``: it adds its own
subcommand (with ``set_defaults(func=...)``) to the ``bench`` group. :data:`MODULES` lists them; adding a
benchmark is one entry there. Modules import their heavy dependencies (torch, transformers,
matplotlib) inside the functions that run, so ``dcr-ray --help`` stays fast.

- :mod:`~benchmarks.codec`  codec wire size vs the entropy bound and peers, encode/apply throughput
- :mod:`~benchmarks.refit`  end-to-end refits over an emulated cross-cluster link vs a full-checkpoint
  reference and peers; link sweep; projection to large models
- :mod:`~benchmarks.projection`  sharded owners projecting their changes vs gather-then-convert-then-diff
- :mod:`~benchmarks.heal`  healing a dead, lagging or lost engine: bytes across the link, owner bytes, refit stall
- :mod:`~benchmarks.peers`  the peers side by side on the same steps (SkyRL's own code where installed, vLLM
  sparse_nccl, XOR + zstd, and the compact AReaL-DTE- and slime-style encodings the other benchmarks count)
- :mod:`~benchmarks.live`  while engines serve, at every link of a sweep: client stalls, serving pause, trainer
  stall, freshness, tokens/s, beside a dense sync, a full fetch-then-reload and SkyRL's delta sync
- :mod:`~benchmarks.startup`  where a topology's start-up goes (per actor), the first refits, an engine's
  re-creation
- :mod:`~benchmarks.scale`  how refit time, CPU and memory per role (owner, relay, coordinator, engine) grow with
  model size, engines per cluster and clusters: slopes, faster-than-linear flags, the 30B-1T projection from them
- :mod:`~benchmarks.markdown`  a run's tables (BENCHMARKS.md) rendered from its JSON alone
- :mod:`~benchmarks.failpoints`  what the library's failpoints cost a refit when no plan is armed
- :mod:`~benchmarks.chaos`  ``dcr-ray chaos``: seeded faults against a multi-node topology, every refit checked;
  :mod:`~benchmarks.chaos_matrix`: ``dcr-ray chaos --enumerate``, every failpoint x action x apply mode x transport
- :mod:`~benchmarks.cuda`  scripts for a GPU (``cuda_ext/check_gpu.sh`` runs them): the CuPy kernels vs the
  numpy path (``kernels``), one sparse patch's apply vs vLLM ``sparse_nccl``'s (``patch``)
"""

from __future__ import annotations

import importlib

#: Benchmark modules (under ``benchmarks``) that add a ``dcr-ray bench <name>`` subcommand.
MODULES: tuple[str, ...] = ("codec", "refit", "projection", "heal", "peers", "live", "startup", "markdown",
                             "failpoints", "scale")


def add_parsers(subparsers) -> None:
    """Let every module in :data:`MODULES` add its subcommand to ``subparsers``."""
    for name in MODULES:
        importlib.import_module(f"{__name__}.{name}").add_parser(subparsers)


def write_json_and_plot(result: dict, path: str, plot) -> None:
    """Write ``result`` as JSON at ``path`` and ``plot(result, png)`` beside it (same name, ``.png``)."""
    import json
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.splitext(path)[0] + ".png")
