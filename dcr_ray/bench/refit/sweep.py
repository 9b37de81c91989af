"""The link sweep: modelled refit time over link bandwidth, anchored on measured points."""

from __future__ import annotations

from dcr_ray.bench.refit.measure import reference_seconds
from dcr_ray.bench.refit.settings import PEERS, Settings

#: Links of the modelled sweep (Mbit/s), and the multiples of the headline link that are also measured.
SWEEP_MBPS = tuple(10 * 10 ** (i / 8) for i in range(25))  # 10 Mbit/s .. 10 Gbit/s
SWEEP_MEASURED_FACTORS = (4.0, 16.0, 64.0)


def sweep_model(result: dict, s: Settings) -> dict | None:
    """Modelled refit time and speedup over link bandwidth, anchored on measured 3% relay points.

    ``T(L) = max(T_cpu, T_link(L) + c)``: ``T_cpu`` = measured refit time with no link emulation
    (compute-bound), ``T_link(L)`` = wire bytes over the link model, ``c`` = measured time outside the
    link at the headline link (pipeline fill/drain, prepare, commit). Peers: measured construction +
    link model + measured apply. The reference: canonical bytes over the link model.
    """
    base = next((c for c in result.get("cases", []) if c.get("case") == "stress-3%" and c["transport"] == "relay"),
                None)
    pts = result.get("sweep_measured") or []
    if base is None:
        return None
    free = next((p for p in pts if not p["link_mbps"]), None)
    t_cpu = free["dcr_seconds"] if free else base["construct_s"] + base["apply_s"]
    c_over = max(0.0, base["dcr_seconds"] - base["lower_bound_s"])
    wire, canon, lat = base["wire_bytes"], base["reference_bytes"], s.latency_s
    curve = []
    for mbps in SWEEP_MBPS:
        t_link = reference_seconds(wire, mbps, lat)
        t = max(t_cpu, t_link + c_over)
        ref = reference_seconds(canon, mbps, lat)
        peers = {p: base["peers_construct_s"][p] + reference_seconds(base["peers_bytes"][p], mbps, lat)
                 + base["peers_apply_s"][p] for p in PEERS}
        serial = base["construct_s"] + t_link + base["apply_s"]
        curve.append({"link_mbps": mbps, "dcr_seconds": t, "reference_seconds": ref, "speedup": ref / t,
                      "link_bound": t_link + c_over >= t_cpu, "serial_speedup": ref / serial,
                      "peers_speedup": {p: ref / v for p, v in peers.items()}})
    crossover = wire * 8 / max(t_cpu - c_over - lat, 1e-9) / 1e6 if t_cpu > c_over + lat else None
    measured = [{"link_mbps": p["link_mbps"], "dcr_seconds": p["dcr_seconds"],
                 "reference_seconds": p["reference_seconds"], "speedup": p["speedup"],
                 "lower_bound_fraction": p["lower_bound_fraction"], "bit_exact": p["bit_exact"],
                 "change_rate": p["change_rate"], "wire_bytes": p["wire_bytes"]}
                for p in [base, *pts]]
    return {"label": "model: T(L) = max(T_cpu, wire*8/L + latency + c), anchored on measured points",
            "case": base["name"], "t_cpu_s": t_cpu, "overhead_s": c_over, "wire_bytes": wire,
            "reference_bytes": canon, "byte_ratio": canon / wire, "crossover_mbps": crossover,
            "curve": curve, "measured": measured}
