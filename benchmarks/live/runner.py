"""``dcr-ray bench live``: every (receiver, data, mode) topology, every method on it at every link, one JSON;
the targets, each met or unmet with its numbers, and the crossovers."""

from __future__ import annotations

import os
import time

from benchmarks.live import measure, topology
from benchmarks.refit.progress import log

#: Concurrent requests an engine can take beside the refit's own calls (it answers 8 calls at once).
MAX_CLIENTS = 6
#: dcr_ray staged in flight: its longest client gap against SkyRL's delta sync's (as SkyRL ships it).
PAUSE_VS_SKYRL = 0.5
#: dcr_ray staged in flight: its longest client gap <= its admission window + this many token steps.
GAP_STEPS = 2
#: dcr_ray staged in flight: tokens per second across a refit's window >= this fraction of quiet.
TOKENS_VS_QUIET = 0.8
#: dcr_ray's freshness <= SkyRL's at links up to this speed (Mbit/s).
FRESHNESS_UP_TO_MBPS = 10000.0
#: Issue 51: a vLLM engine's staged admission window (the small model), seconds.
VLLM_STAGED_WINDOW_S = 0.040


def run(s) -> dict:
    import ray

    from benchmarks.provenance import git_commit, loadavg

    if not (1 <= s.clients + s.long_clients <= MAX_CLIENTS and s.clients >= 1 and s.long_clients >= 0):
        raise ValueError(f"--clients (>= 1) and --long-clients (>= 0) must add up to at most {MAX_CLIENTS}: an engine "
                         f"answers 8 calls at once, and the refit needs the others")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    result = {"bench": "live", "settings": {k: getattr(s, k) for k in s.__dataclass_fields__},
              "git": git_commit(), "loadavg_start": loadavg(), "started": time.time(), "cases": []}
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    for receiver in s.receivers:
        for data in s.data:
            for mode in s.modes:
                methods = tuple(m for m in s.methods if m == "dcr" or mode == "in_place")
                if not methods:
                    continue
                topo, step = topology.launch(s, receiver, mode, data)
                try:
                    cases = measure.run_case(topo, s, receiver, mode, data, methods, step,
                                             lambda mbps: topology.set_link(topo, mbps, s.latency_s))
                finally:
                    topo.shutdown()
                for c in cases:
                    log(f"  {name(c):<22} {_link(c['link_mbps']):>9}: drain {c['drain_seconds']:.3f}s window "
                        f"{c['pause_seconds']:.3f}s client gap {c['client_gap_seconds']:.3f}s fresh "
                        f"{c['freshness_seconds']:.3f}s exact {c['bit_exact']}")
                result["cases"] += cases
    result["loadavg_end"] = loadavg()
    result["seconds"] = time.time() - result["started"]
    result["targets"] = targets(result["cases"])
    result["crossovers"] = crossovers(result["cases"])
    return result


def name(c: dict) -> str:
    """A case's method as the tables name it: ``dcr staged``, ``dcr staged drain``, ``skyrl_delta``..."""
    if c["method"] != "dcr":
        return c["method"]
    return f"dcr {c['mode']}" + (" drain" if c.get("switch") == "drain" else "")


def _link(mbps) -> str:
    if mbps is None:
        return "no link"
    return f"{mbps / 1e3:g} Gbit/s" if mbps >= 1000 else f"{mbps:g} Mbit/s"


def _find(cases, **kw):
    return next((c for c in cases if all(c.get(k) == v for k, v in kw.items())), None)


def _groups(cases):
    return sorted({(c["receiver"], c["data"]) for c in cases})


def _in_flight(c: dict) -> bool:
    return c.get("switch", "in_flight") == "in_flight"


def targets(cases: list[dict]) -> list[dict]:
    """The targets, each met or unmet with its numbers (only where both sides were measured). dcr_ray staged in
    flight, long requests running, per receiver and link: the longest client gap <= its admission window +
    ``GAP_STEPS`` token steps, and <= ``PAUSE_VS_SKYRL`` x SkyRL's as shipped; tokens per second across the
    refit window >= ``TOKENS_VS_QUIET`` x quiet; no request waits for another (the wait before the window, its
    drain, <= ``GAP_STEPS`` token steps: the steps in progress, where a drain waits out whole requests). Then freshness against SkyRL's, and dcr_ray's own: trainer stall <= 1.2x
    construct and freshness <= 1.2x the refit, worst link."""
    out = []
    for receiver, data in _groups(cases):
        for c in cases:
            if (c["receiver"], c["data"], c["method"], c["mode"]) != (receiver, data, "dcr", "staged") \
                    or not _in_flight(c):
                continue
            where = f"{receiver}, {data}, {_link(c['link_mbps'])}"
            step = c.get("token_step_seconds")
            if step:
                bound = c["pause_seconds"] + GAP_STEPS * step
                out.append({"target": f"staged in-flight client gap <= admission window + {GAP_STEPS} token steps "
                                      f"({where}; {1e3 * c['pause_seconds']:.0f} + {GAP_STEPS} x {1e3 * step:.0f} ms)",
                            "value": c["client_gap_seconds"] / bound, "met": c["client_gap_seconds"] <= bound})
                if c.get("client_gap_switch_seconds") is not None:  # the gaps across the switch itself
                    out.append({"target": f"(reported) staged in-flight gap across the switch / (admission window + "
                                          f"{GAP_STEPS} token steps) ({where})",
                                "value": c["client_gap_switch_seconds"] / bound, "met": None})
                out.append({"target": f"staged in-flight: no request waits for another (drain <= {GAP_STEPS} token "
                                      f"steps, {GAP_STEPS * 1e3 * step:.0f} ms; {where})",
                            "value": c["drain_seconds"] / step, "met": c["drain_seconds"] <= GAP_STEPS * step})
            if c.get("tokens_per_second_quiet"):
                r = (c["tokens_per_second_refit"] or 0.0) / c["tokens_per_second_quiet"]
                out.append({"target": f"staged in-flight tokens/s across a refit >= {TOKENS_VS_QUIET}x quiet ({where})",
                            "value": r, "met": r >= TOKENS_VS_QUIET})
            sky = _find(cases, method="skyrl_delta", receiver=receiver, data=data, link_mbps=c["link_mbps"])
            if sky is None:
                continue
            if sky["client_gap_seconds"]:
                r = c["client_gap_seconds"] / sky["client_gap_seconds"]
                out.append({"target": f"staged in-flight client gap <= {PAUSE_VS_SKYRL}x skyrl_delta's as shipped "
                                      f"({where})", "value": r, "met": r <= PAUSE_VS_SKYRL})
            if sky["pause_seconds"]:
                out.append({"target": f"(reported) staged admission window / skyrl_delta's ({where})",
                            "value": c["pause_seconds"] / sky["pause_seconds"], "met": None})
        for c in cases:
            if (c["receiver"], c["data"], c["method"]) != (receiver, data, "dcr") or not _in_flight(c):
                continue
            if c["link_mbps"] is None or c["link_mbps"] > FRESHNESS_UP_TO_MBPS:
                continue
            sky = _find(cases, method="skyrl_delta", receiver=receiver, data=data, link_mbps=c["link_mbps"])
            if sky and sky["freshness_seconds"]:
                r = c["freshness_seconds"] / sky["freshness_seconds"]
                out.append({"target": f"{c['mode']} freshness <= skyrl_delta's ({receiver}, {data}, "
                                      f"{_link(c['link_mbps'])})", "value": r, "met": r <= 1.0})
    for c in cases:
        if c["receiver"].startswith("vllm") and (c["method"], c["mode"]) == ("dcr", "staged") and _in_flight(c):
            out.append({"target": f"staged admission window <= {VLLM_STAGED_WINDOW_S * 1e3:.0f} ms ({c['receiver']}, "
                                  f"{c.get('size')}, {c['data']}, {_link(c['link_mbps'])})",
                        "value": c["pause_seconds"], "met": c["pause_seconds"] <= VLLM_STAGED_WINDOW_S})
    for tag in sorted({(c["receiver"], c["mode"], c["data"]) for c in cases if c["method"] == "dcr" and _in_flight(c)}):
        dcr = [c for c in cases if c["method"] == "dcr" and _in_flight(c) and (c["receiver"], c["mode"], c["data"]) == tag]
        stall = [c["trainer_stall_seconds"] / c["construct_seconds"] for c in dcr if c["construct_seconds"]]
        fresh = [c["freshness_seconds"] / c["refit_seconds"] for c in dcr if c["refit_seconds"]]
        if stall:
            out.append({"target": f"trainer stall <= 1.2x construct ({' '.join(tag)}, worst link)", "value": max(stall),
                        "met": max(stall) <= 1.2})
        if fresh:
            out.append({"target": f"freshness <= 1.2x refit seconds ({' '.join(tag)}, worst link)", "value": max(fresh),
                        "met": max(fresh) <= 1.2})
    return out


def _order(mbps) -> float:
    return float("inf") if mbps is None else mbps


def crossovers(cases: list[dict]) -> list[dict]:
    """Per receiver, data, dcr_ray mode and peer: the link speed above which the peer's freshness beats
    dcr_ray's, from the measured points alone. ``dcr_wins_up_to``: the fastest link where dcr_ray was fresher
    with the peer fresher at every faster one (None: the peer was fresher at every link); ``peer_wins_from``:
    the next link measured (None: dcr_ray was fresher at the fastest link, so there is no crossover)."""
    out = []
    for receiver, data in _groups(cases):
        for mode in ("in_place", "staged"):
            dcr = {c["link_mbps"]: c for c in cases if (c["receiver"], c["data"], c["method"], c["mode"]) ==
                   (receiver, data, "dcr", mode) and _in_flight(c)}
            for peer in ("dense_sync", "pipelinerl_dense", "full_fetch_reload", "skyrl_delta"):
                other = {c["link_mbps"]: c for c in cases if (c["receiver"], c["data"], c["method"]) ==
                         (receiver, data, peer)}
                links = sorted(set(dcr) & set(other), key=_order)
                if not links:
                    continue
                wins = [other[x]["freshness_seconds"] < dcr[x]["freshness_seconds"] for x in links]
                k = len(wins)
                while k > 0 and wins[k - 1]:
                    k -= 1
                out.append({"receiver": receiver, "data": data, "mode": mode, "peer": peer,
                            "links_mbps": links, "peer_fresher": wins,
                            "dcr_wins_up_to": links[k - 1] if k > 0 else None,
                            "peer_wins_from": links[k] if k < len(links) else None,
                            "crossover": k < len(links)})
    return out


def crossover_text(x: dict) -> str:
    """One crossover in words."""
    if not x["crossover"]:
        return f"none: dcr_ray's {x['mode']} freshness beats {x['peer']}'s at the fastest link measured"
    if x["dcr_wins_up_to"] is None:
        return f"{x['peer']} is fresher at every link measured"
    return (f"between {_link(x['dcr_wins_up_to'])} (dcr_ray fresher) and {_link(x['peer_wins_from'])} "
            f"({x['peer']} fresher from there up)")
