"""``dcr-ray bench live``: every (receiver, data, mode) topology, every method on it at every link, one JSON;
the targets of issue 43, each met or unmet with its numbers, and the crossovers."""

from __future__ import annotations

import os
import time

from benchmarks.live import measure, topology
from benchmarks.refit.progress import log

#: Concurrent requests an engine can take beside the refit's own calls (it answers 8 calls at once).
MAX_CLIENTS = 6
#: Issue 43: dcr_ray's staged pause (admission window and client gap) against SkyRL's delta sync's.
PAUSE_VS_SKYRL = 0.5
#: Issue 43: dcr_ray's freshness <= SkyRL's at links up to this speed (Mbit/s).
FRESHNESS_UP_TO_MBPS = 10000.0
#: Issue 51: a vLLM engine's staged admission window (the small model), seconds.
VLLM_STAGED_WINDOW_S = 0.040


def run(s) -> dict:
    import ray

    from benchmarks.provenance import git_commit, loadavg

    if not 1 <= s.clients <= MAX_CLIENTS:
        raise ValueError(f"--clients must be 1..{MAX_CLIENTS}: an engine answers 8 calls at once, and the refit "
                         f"needs the others")
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
                    log(f"  {c['method']:<17} {c['mode']:<8} {_link(c['link_mbps']):>9}: pause "
                        f"{c['pause_seconds']:.3f}s client gap {c['client_gap_seconds']:.3f}s fresh "
                        f"{c['freshness_seconds']:.3f}s exact {c['bit_exact']}")
                result["cases"] += cases
    result["loadavg_end"] = loadavg()
    result["seconds"] = time.time() - result["started"]
    result["targets"] = targets(result["cases"])
    result["crossovers"] = crossovers(result["cases"])
    return result


def _link(mbps) -> str:
    if mbps is None:
        return "no link"
    return f"{mbps / 1e3:g} Gbit/s" if mbps >= 1000 else f"{mbps:g} Mbit/s"


def _find(cases, **kw):
    return next((c for c in cases if all(c.get(k) == v for k, v in kw.items())), None)


def _groups(cases):
    return sorted({(c["receiver"], c["data"]) for c in cases})


def targets(cases: list[dict]) -> list[dict]:
    """Issue 43's targets, each met or unmet with its numbers (only where both sides were measured), and
    dcr_ray's own (issue 28): trainer stall <= 1.2x construct and freshness <= 1.2x the refit, worst link."""
    out = []
    for receiver, data in _groups(cases):
        for c in cases:
            if (c["receiver"], c["data"], c["method"], c["mode"]) != (receiver, data, "dcr", "staged"):
                continue
            sky = _find(cases, method="skyrl_delta", receiver=receiver, data=data, link_mbps=c["link_mbps"])
            if sky is None:
                continue
            where = f"{receiver}, {data}, {_link(c['link_mbps'])}"
            for key, what in (("pause_seconds", "admission window"), ("client_gap_seconds", "client gap")):
                if sky[key]:
                    r = c[key] / sky[key]
                    out.append({"target": f"staged {what} <= {PAUSE_VS_SKYRL}x skyrl_delta's ({where})", "value": r,
                                "met": r <= PAUSE_VS_SKYRL})
            # the longest gap less its drain (the requests already running finishing first, which every method
            # that answers a request from one version pays alike): what the method itself adds
            mine, theirs = c.get("client_gap_undrained_seconds"), sky.get("client_gap_undrained_seconds")
            if mine is not None and theirs:
                out.append({"target": f"(reported) staged client gap less its drain / skyrl_delta's ({where})",
                            "value": mine / theirs, "met": None})
        for c in cases:
            if (c["receiver"], c["data"], c["method"]) != (receiver, data, "dcr"):
                continue
            if c["link_mbps"] is None or c["link_mbps"] > FRESHNESS_UP_TO_MBPS:
                continue
            sky = _find(cases, method="skyrl_delta", receiver=receiver, data=data, link_mbps=c["link_mbps"])
            if sky and sky["freshness_seconds"]:
                r = c["freshness_seconds"] / sky["freshness_seconds"]
                out.append({"target": f"{c['mode']} freshness <= skyrl_delta's ({receiver}, {data}, "
                                      f"{_link(c['link_mbps'])})", "value": r, "met": r <= 1.0})
    for c in cases:
        if c["receiver"].startswith("vllm") and (c["method"], c["mode"]) == ("dcr", "staged"):
            out.append({"target": f"staged admission window <= {VLLM_STAGED_WINDOW_S * 1e3:.0f} ms ({c['receiver']}, "
                                  f"{c.get('size')}, {c['data']}, {_link(c['link_mbps'])})",
                        "value": c["pause_seconds"], "met": c["pause_seconds"] <= VLLM_STAGED_WINDOW_S})
    for tag in sorted({(c["receiver"], c["mode"], c["data"]) for c in cases if c["method"] == "dcr"}):
        dcr = [c for c in cases if c["method"] == "dcr" and (c["receiver"], c["mode"], c["data"]) == tag]
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
                   (receiver, data, "dcr", mode)}
            for peer in ("dense_sync", "full_fetch_reload", "skyrl_delta"):
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
