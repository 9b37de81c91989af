"""Measuring on a running topology: one refit, its promote, and bit-exactness.

:func:`reference_seconds` is the link-model *formula* for every canonical byte, kept in the JSON as
``reference_seconds`` beside the measured references of :mod:`.reference`.

Two clocks per refit: ``dcr_seconds`` (the coordinator's prepare -> commit record -> activate: engines
serve v+1) and ``ready_for_next_seconds`` (that, plus the wait after the refit returned until every
owner's background promote finished: the next refit's diff cannot start earlier). ``promote_seconds`` is
the slowest owner's promote itself; ``dirty_pages`` / ``changed_pages`` are summed over owners
(:mod:`.pages`).
"""

from __future__ import annotations

import time

from benchmarks.refit.actors import engine_apply_stats, engine_digests
from benchmarks.refit.cpu import critical_path
from benchmarks.refit.memory import MemorySampler
from benchmarks.refit.progress import log
from benchmarks.refit.settings import PEERS
from benchmarks.refit.topology import Topology


def reference_seconds(nbytes: int, mbps: float | None, latency_s: float) -> float:
    """Transport-only time of ``nbytes`` over the link model (0 without a link)."""
    if not mbps:
        return 0.0
    return nbytes * 8 / (mbps * 1e6) + latency_s


def check_exact(topo: Topology) -> bool:
    """Owners' integer-view fingerprints == every engine's, tensor by tensor."""
    import ray

    want = {}
    for d in ray.get([h.bench_digests.remote() for h in topo.owners.values()]):
        want.update(d)
    got = ray.get([e.__ray_call__.remote(engine_digests) for e in topo.engines.values()])
    return all(g == want for g in got)


def check_exact_elementwise(topo: Topology) -> bool:
    """Element-wise integer-view equality of every tensor: owners vs every engine (driver side)."""
    import ray
    import torch

    ok = True
    for oh in topo.owners.values():
        names = ray.get(oh.bench_names.remote())
        for i in range(0, len(names), 8):
            group = names[i:i + 8]
            want = ray.get(oh.bench_tensors.remote(group))
            for e in topo.engines.values():
                got = ray.get(e.tensors.remote(group))
                for n in group:
                    w, g = want[n], got[n]
                    iv = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[w.element_size()]
                    ok &= w.dtype == g.dtype and w.shape == g.shape and torch.equal(w.view(iv), g.view(iv))
    return bool(ok)


def measure_refit(topo: Topology, *, with_peers: bool = True) -> dict:
    """Refit once (the owners' tensors already changed) and measure everything about it."""
    import ray

    peer = None
    if with_peers:
        t = time.perf_counter()
        per_owner = ray.get([h.bench_peers.remote() for h in topo.owners.values()])
        peer = {p: {"construct_s": max(o[p]["construct_s"] for o in per_owner),
                    "apply_s": sum(o[p]["apply_s"] for o in per_owner),  # one engine applies everything
                    "bytes": sum(o[p]["bytes"] for o in per_owner),
                    "exact": all(o[p]["exact"] for o in per_owner)} for p in PEERS}
        log(f"    peers measured in {time.perf_counter() - t:.1f}s")
    owners = list(topo.owners.values())
    ray.get([h.bench_before_refit.remote() for h in owners])
    before = topo.link_busy()
    with MemorySampler(topo.owner_pids + topo.engine_pids) as mem:
        t = time.perf_counter()
        rep = topo.refit.run()
        wall = time.perf_counter() - t
        ray.get([h.dcr_version.remote() for h in owners])  # waits for every owner's promote
        settle_wait = time.perf_counter() - t - wall
    after = topo.link_busy()
    promotes = ray.get([h.bench_after_refit.remote() for h in owners])
    owner_peak = max(mem.peak[p] for p in topo.owner_pids)
    engine_peak = max(mem.peak[p] for p in topo.engine_pids)
    per_engine = dict(zip(topo.engines, ray.get([e.__ray_call__.remote(engine_apply_stats)
                                                 for e in topo.engines.values()])))
    busy = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}
    busiest = max(busy.values(), key=lambda v: v[0])
    t = time.perf_counter()
    exact = check_exact(topo)
    t_check = time.perf_counter() - t
    lat = topo.latency_s if topo.link_mbps else 0.0
    lower = busiest[0] + (lat if busiest[1] else 0.0)
    sec = rep.seconds
    dcr_s = sec["total"]
    ref_bytes = topo.canonical_bytes
    ref_s = reference_seconds(ref_bytes, topo.link_mbps, lat)
    speedup = ref_s / dcr_s if ref_s else None
    byte_ratio = ref_bytes / rep.wire_bytes if rep.wire_bytes else None
    out = {
        "change_rate": rep.change_rate, "transport": topo.transport, "link_mbps": topo.link_mbps,
        "latency_s": lat, "dcr_seconds": dcr_s, "reference_seconds": ref_s, "speedup": speedup,
        "wire_bytes": rep.wire_bytes, "reference_bytes": ref_bytes,
        "lower_bound_s": lower, "lower_bound_fraction": lower / dcr_s if topo.link_mbps else None,
        "bit_exact": bool(exact), "byte_ratio": byte_ratio,
        "efficiency": speedup / byte_ratio if speedup and byte_ratio else None,
        "construct_s": sec["construct"], "apply_s": sec["apply"], "prepare_s": sec["prepare"],
        "stream_s": sec["stream"], "commit_s": sec["commit"], "driver_wall_s": wall,
        "changed": rep.changed, "numel": rep.numel, "payloads": rep.payloads,
        "bytes_per_change": rep.wire_bytes / rep.changed if rep.changed else None,
        "link_bytes": rep.link_bytes, "links": {k: {"busy_s": v[0], "bytes": v[1]} for k, v in busy.items()},
        "owner_peak_bytes": owner_peak, "engine_peak_bytes": engine_peak,
        "owner_share_bytes": topo.owner_share_bytes,
        "owner_peak_hwm_bytes": max(mem.hwm[p] for p in topo.owner_pids),
        "engine_peak_hwm_bytes": max(mem.hwm[p] for p in topo.engine_pids),
        # the receiver: its kind, and per engine its apply seconds and peak memory during this refit
        "engine_kind": topo.engine_kind, "apply_seconds": max(v["apply_s"] for v in per_engine.values()),
        "engine_apply_s": {k: v["apply_s"] for k, v in per_engine.items()},
        "engine_flush_s": {k: v["flush_s"] for k, v in per_engine.items() if v["flush_s"] is not None},
        "engine_peaks": {k: mem.peak[p] for k, p in topo.engine_pid_of.items()},
        "engine_peaks_hwm": {k: mem.hwm[p] for k, p in topo.engine_pid_of.items()},
        "engine_refit_added_bytes": {k: mem.peak[p] - mem.start[p] for k, p in topo.engine_pid_of.items()},
        "engine_flush": {k: v["flush"] for k, v in per_engine.items() if v["flush"]},
        "model": topo.model, "canonical_bytes": topo.canonical_bytes, "engines": len(topo.engines),
        "owners": len(topo.owners), "seconds": dict(sec), "mode": rep.mode, "retries": rep.retries, "check_s": t_check,
        # promote: its own seconds (slowest owner), and when the next refit could start
        "promote_seconds": max((p["promote_s"] for p in promotes if p["promote_s"] is not None), default=None),
        "ready_for_next_seconds": dcr_s + settle_wait, "serve_seconds": dcr_s,
        "dirty_pages": (None if any(p["dirty_pages"] is None for p in promotes)
                        else sum(p["dirty_pages"] for p in promotes)),
        "changed_pages": sum(p["changed_pages"] for p in promotes),
        "baseline_pages": sum(p["baseline_pages"] for p in promotes),
        "tensors": sum(p["tensors"] for p in promotes), "tensors_total": topo.tensors,
        # which coding the refit used and why (CodecConfig.coding="auto" decides per refit)
        "coding": rep.coding, "coding_reason": rep.coding_reason,
        # process CPU seconds per actor, and the critical path they imply with one core per actor (derived)
        **critical_path(rep.cpu_seconds, lower),
    }
    if peer is not None:
        link_s = {p: reference_seconds(v["bytes"], topo.link_mbps, lat) for p, v in peer.items()}
        out["peers"] = {p: v["construct_s"] + link_s[p] + v["apply_s"] for p, v in peer.items()}
        out["peers_link_s"] = link_s
        out["peers_construct_s"] = {p: v["construct_s"] for p, v in peer.items()}
        out["peers_apply_s"] = {p: v["apply_s"] for p, v in peer.items()}
        out["peers_bytes"] = {p: v["bytes"] for p, v in peer.items()}
        out["peers_bit_exact"] = all(v["exact"] for v in peer.values())
        out["peers_speedup"] = {p: ref_s / v for p, v in out["peers"].items()} if ref_s else {}
    return out
