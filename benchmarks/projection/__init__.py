"""``dcr-ray bench projection``: owners project their shards' changes vs gather-then-convert-then-diff.

One run, side by side, on the trainer layouts of :mod:`.layout` (FSDP 4 x TP 2; MoE experts EP 8), for a
dense and an MoE model at 1/3/5% of elements changed:

* **projection** (what a sharded owner does): each rank diffs its local tensors against its local
  baseline (``diff_tensor``) and projects the changes to canonical coordinates (``project``); residual
  norms are converted (``w - 1`` -> ``w``) and diffed in canonical values. Timed per rank;
  ``projection_seconds`` is the **slowest rank** (ranks run in parallel), ``projection_sum_seconds`` all ranks.
* **gather** (what a trainer without projection does on every rank): all-gather (``torch.cat`` of every
  rank's local tensor, in one process: no network, which favours it), convert to checkpoint tensors
  (un-interleave QKV, split gate/up and experts, drop vocab padding, ``w - 1`` -> ``w``), then diff every
  canonical tensor against a canonical baseline. ``gather_seconds`` = gather+convert (each rank does all
  of it) + the canonical diff divided by the 8 ranks (as if split perfectly among them).

``speedup`` = gather / projection. ``direct_fraction``: canonical bytes on the affine path. Owner memory:
the rank with the largest shard holds its shard, its local baseline and what diff + project allocate
(tracemalloc peak of one diff + project of all its tensors, every changed set kept); ``owner_peak_bytes``
is their sum, ``shard_bytes`` the shard. ``bit_exact``: the union over ranks of projected
(name, index, new bits) equals gather-then-diff's, compared on integer views, no element sent twice.
Benchmarks measure; the numbers are not modelled.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import write_json_and_plot
import time
import tracemalloc

import numpy as np
import torch

from dcr_ray.codec import bits_view, diff_tensor
from dcr_ray.codec.encoding.diff import TensorDelta
from dcr_ray.sharding import project
from benchmarks.projection import layout as L

CHUNK_ELEMS = 1 << 20  # RefitConfig's default codec chunk
RATES = (0.01, 0.03, 0.05)
TARGETS = {"direct_fraction_moe": 0.98, "speedup": 1.0, "owner_peak_over_shard": 2.2}
_T0 = time.perf_counter()


def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``projection`` to the ``bench`` subcommands."""
    p = subparsers.add_parser(
        "projection", help="sharded owners: projection vs gather-then-convert-then-diff",
        description="Construction time of projecting each shard's changes (FSDP 4 x TP 2, MoE EP 8) vs "
                    "all-gathering, converting and diffing canonical tensors, at 1/3/5%% change; affine "
                    "fraction, owner memory, bit-exactness. Table on stdout, progress on stderr; --json "
                    "also writes a PNG plot beside the JSON.")
    p.add_argument("--quick", action="store_true", help="tens of MB per model instead of hundreds")
    p.add_argument("--json", metavar="PATH", help="write results as JSON here and a PNG plot beside it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=None, help="timing repeats, best kept (default 3 quick, 5 full)")
    p.set_defaults(func=_run_from_args)
    return p


def _run_from_args(args: argparse.Namespace) -> int:
    result = run(quick=args.quick, seed=args.seed, repeats=args.repeats or (3 if args.quick else 5))
    print(format_table(result))
    if args.json:
        write_json_and_plot(result, args.json, plot)
    return 0


# -- the two constructions -------------------------------------------------------------------------------

def _convert(x: torch.Tensor) -> torch.Tensor:
    return (x + 1).to(torch.bfloat16)


def baselines(params: list[L.Param]) -> dict[int, dict[str, np.ndarray]]:
    """Each rank's local baselines: bits of its pieces (residual pieces: of the converted tensor)."""
    out: dict[int, dict[str, np.ndarray]] = {r: {} for r in range(L.WORLD)}
    for p in params:
        for r, ps in p.pieces.items():
            for pc in ps:
                out[r][pc.local] = bits_view(_convert(pc.tensor) if pc.residual else pc.tensor).copy()
    return out


def project_rank(params: list[L.Param], rank: int, base: dict[str, np.ndarray], *, keep: bool = True):
    """One owner: diff every local piece against its baseline and project it. Returns (local changed sets,
    canonical changed sets); with ``keep=False`` the canonical sets are dropped as they come, as the owner's
    frame encoder consumes them (the local sets stay, in the form the owner keeps them pending:
    :meth:`~dcr_ray.codec.encoding.diff.TensorDelta.pending_form`, as ``BaselineStore.add_pending`` does)."""
    local, canon = [], []
    for p in params:
        for pc in p.pieces.get(rank, ()):
            t = _convert(pc.tensor) if pc.residual else pc.tensor
            b = base[pc.local]
            td = diff_tensor(pc.local, b, t, chunk_elems=CHUNK_ELEMS)
            if td.chunks:
                local.append(td.pending_form())
                for ctd in project(td, pc.spec, chunk_elems=CHUNK_ELEMS, old_bits=lambda b=b: b):
                    if keep:
                        canon.append(ctd)
                del td  # the first attempt's XOR masks live only while its frames are built
    return local, canon


def gather_convert(params: list[L.Param]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for p in params:
        out.update(p.gather(p.locals_))
    return out


def _expand(tds: list[TensorDelta], old: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """name -> (sorted changed indices, new bits); no-op rewrites of dense chunks dropped; raises on an element
    written twice."""
    acc: dict[str, list] = {}
    for td in tds:
        for c in td.chunks:
            acc.setdefault(td.name, []).append((c.positions(), c.dense if c.is_dense else c.new))
    out = {}
    for n, parts in acc.items():
        pos = np.concatenate([a for a, _ in parts])
        val = np.concatenate([b for _, b in parts])
        order = np.argsort(pos, kind="stable")
        pos, val = pos[order], val[order]
        if len(pos) > 1 and not (np.diff(pos) > 0).all():
            raise AssertionError(f"{n}: an element is sent twice")
        real = val != old[n][pos]
        out[n] = (pos[real], val[real])
    return out


def _same(a: dict, b: dict) -> bool:
    names = {n for n, (p, _) in a.items() if len(p)} | {n for n, (p, _) in b.items() if len(p)}
    return all(n in a and n in b and np.array_equal(a[n][0], b[n][0]) and np.array_equal(a[n][1], b[n][1])
               for n in names)


# -- one model ------------------------------------------------------------------------------------------

def run_model(shape: L.ModelShape, rates, seed: int, repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    _log(f"{shape.name}: building the sharded trainer state")
    old = L.build(shape, gen)
    canon_old = {n: bits_view(t.contiguous()).copy() for n, t in gather_convert(old).items()}
    total = sum(v.nbytes for v in canon_old.values())
    residual = {n for p in old for ps in p.pieces.values() for pc in ps if pc.residual for n in pc.spec.names}
    direct_fraction = 1 - sum(canon_old[n].nbytes for n in residual) / total
    base = baselines(old)
    shard_of = {r: sum(p.locals_[r].nbytes for p in old if p.locals_.get(r) is not None) for r in range(L.WORLD)}
    big = max(shard_of, key=shard_of.get)
    lay = f"fsdp{L.DP}xtp{L.TP}" + (f", experts ep{L.WORLD}" if shape.experts else "")
    _log(f"{shape.name}: {total / 1e6:.0f} MB canonical BF16, {len(canon_old)} tensors, layout {lay}")
    cases = []
    rng = np.random.default_rng(seed)
    for rate in rates:
        new = L.change(old, rate, rng)
        per_rank = [float("inf")] * L.WORLD
        g_conv = g_diff = float("inf")
        for _ in range(repeats):  # the two constructions alternate, so load changes hit both alike
            for r in range(L.WORLD):
                per_rank[r] = min(per_rank[r], _timed(lambda r=r, new=new: project_rank(new, r, base[r]))[0])
            t0 = time.perf_counter()
            canon_new = gather_convert(new)
            t1 = time.perf_counter()
            ref = [diff_tensor(n, canon_old[n], t, chunk_elems=CHUNK_ELEMS) for n, t in canon_new.items()]
            t2 = time.perf_counter()
            g_conv, g_diff = min(g_conv, t1 - t0), min(g_diff, t2 - t1)
            del canon_new
        gather_s = g_conv + g_diff / L.WORLD
        sent = [td for r in range(L.WORLD) for td in project_rank(new, r, base[r])[1]]
        bit_exact = _same(_expand(sent, canon_old), _expand(ref, canon_old))
        del sent, ref
        tracemalloc.start()
        held = project_rank(new, big, base[big], keep=False)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del held
        proj_s = max(per_rank)
        case = {
            "name": f"{shape.name} {rate:.0%}", "model": shape.name, "layout": lay, "change_rate": rate,
            "direct_fraction": direct_fraction, "projection_seconds": proj_s,
            "projection_sum_seconds": sum(per_rank), "gather_seconds": gather_s,
            "gather_convert_seconds": g_conv, "gather_diff_seconds": g_diff,
            "speedup": gather_s / proj_s, "owner_peak_bytes": shard_of[big] + sum(b.nbytes for b in base[big].values()) + peak,
            "owner_alloc_peak_bytes": peak, "shard_bytes": shard_of[big], "canonical_bytes": total,
            "bit_exact": bool(bit_exact),
        }
        _log(f"{case['name']}: projection {proj_s * 1e3:.0f} ms (slowest rank), gather {gather_s * 1e3:.0f} ms, "
             f"x{case['speedup']:.2f}, bit_exact {bit_exact}")
        cases.append(case)
        del new
    return cases


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run(*, quick: bool = False, seed: int = 0, repeats: int = 3, rates=RATES) -> dict:
    shapes = (L.DENSE_QUICK, L.MOE_QUICK) if quick else (L.DENSE, L.MOE)
    cases = [c for i, s in enumerate(shapes) for c in run_model(s, rates, seed + i, repeats)]
    checks = {
        "direct_fraction >= 0.98 (moe)": all(c["direct_fraction"] >= TARGETS["direct_fraction_moe"]
                                             for c in cases if c["model"] == "moe"),
        "projection faster than gather at every rate": all(c["speedup"] > TARGETS["speedup"] for c in cases),
        "owner peak <= 2.2x its shard": all(c["owner_peak_bytes"] <= TARGETS["owner_peak_over_shard"] * c["shard_bytes"]
                                            for c in cases),
        "bit_exact everywhere": all(c["bit_exact"] for c in cases),
    }
    return {"quick": quick, "seed": seed, "repeats": repeats, "chunk_elems": CHUNK_ELEMS, "cases": cases,
            "targets": checks, "elapsed_s": time.perf_counter() - _T0,
            "method": {"projection_seconds": "slowest of the 8 ranks (diff + project of its shard)",
                       "gather_seconds": "torch.cat all-gather + convert of the whole model + canonical diff / 8"}}


def format_table(r: dict) -> str:
    lines = ["projection: slowest rank's diff + project of its shard; gather: cat + convert of the whole model "
             "+ canonical diff / 8 ranks (best of %d)" % r["repeats"],
             f"{'case':10s} {'layout':26s} {'direct':>7s} {'proj ms':>8s} {'(sum)':>7s} {'gather ms':>9s} "
             f"{'(cat+cvt)':>9s} {'(diff)':>7s} {'speedup':>7s} {'peak/shard':>10s} {'shard MB':>8s} bit_exact"]
    for c in r["cases"]:
        lines.append(f"{c['name']:10s} {c['layout']:26s} {c['direct_fraction']:7.4f} {c['projection_seconds'] * 1e3:8.1f} "
                     f"{c['projection_sum_seconds'] * 1e3:7.0f} {c['gather_seconds'] * 1e3:9.1f} "
                     f"{c['gather_convert_seconds'] * 1e3:9.0f} {c['gather_diff_seconds'] * 1e3:7.0f} "
                     f"{c['speedup']:7.2f} {c['owner_peak_bytes'] / c['shard_bytes']:10.2f} "
                     f"{c['shard_bytes'] / 1e6:8.1f} {c['bit_exact']}")
    lines += ["", "targets:"]
    lines += [f"  {k:45s} {'met' if v else 'MISSED'}" for k, v in r["targets"].items()]
    lines.append(f"elapsed {r['elapsed_s']:.1f}s")
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    """Construction seconds per case: projection (slowest rank) vs gather-then-convert-then-diff."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = r["cases"]
    x = np.arange(len(cases))
    fig, ax = plt.subplots(figsize=(9, 4.2))
    a = ax.bar(x - 0.2, [c["projection_seconds"] * 1e3 for c in cases], 0.4, label="projection (slowest rank)")
    b = ax.bar(x + 0.2, [c["gather_seconds"] * 1e3 for c in cases], 0.4, label="gather + convert + diff / 8")
    ax.bar_label(a, fmt="%.0f", fontsize=7)
    ax.bar_label(b, labels=[f"{c['gather_seconds'] * 1e3:.0f}\nx{c['speedup']:.1f}" for c in cases], fontsize=7)
    ax.set_xticks(x, [c["name"] for c in cases])
    ax.set_ylabel("construction ms per refit")
    ax.set_title("sharded owners: projection vs gather-then-convert-then-diff" + (" (quick)" if r["quick"] else ""))
    ax.legend(fontsize=8)
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
