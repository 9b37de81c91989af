"""Refit time projected to large models from the measured per-byte costs (a projection, not a measurement)."""

from __future__ import annotations

from benchmarks.refit.measure import reference_seconds
from benchmarks.refit.settings import TRANSPORTS

#: Projected models' BF16 canonical bytes (NeMo-DCR paper), 5 Gbit/s per node across regions, and the
#: parallelism of the NeMo-DCR testbed (32 trainer GPUs -> owners; one rollout replica = 8 GPUs that
#: apply their shards in parallel).
PROJECTION_MODELS = {"30B": 63.2e9, "120B": 247.2e9, "235B": 470.2e9, "1T": 2242e9}
PROJECTION_LINK_MBPS = 5000.0
PROJECTION_OWNERS = 32
PROJECTION_APPLIERS = 8
#: NeMo-DCR published results (refit s, reference s), relay tree unless noted.
NEMO = {
    ("120B", 0.03, "relay"): (22.6, 750.0), ("120B", 0.05, "relay"): (41.6, 750.0),
    ("120B", 0.03, "object_store"): (24.5, 750.0), ("120B", 0.05, "object_store"): (49.7, 750.0),
    ("1T", 0.03, "relay"): (150.0, 87.5 * 60),
}



def projection(cases: list[dict]) -> dict | None:
    """Projected refit time of large models from this run's measured per-byte costs (a projection).

    Inputs, from the measured stress cases: wire bytes per changed element ``b`` (per rate, relay at the
    headline link), construction throughput per owner process ``r_o`` (canonical bytes / owner / s) and
    apply time per changed element ``a`` (one engine process), each the best over all stress cases
    (the machine is shared: contention only slows a measurement down), and finalisation (prepare +
    commit) fitted as ``f0 + f1 * changed_per_owner`` over the relay cases. Then, with ``P_o`` owners and
    ``P_a`` appliers per rollout replica (the NeMo-DCR testbed: 32 trainer GPUs, 8 GPUs per replica)
    and one 5 Gbit/s link at the cluster boundary::

        T = max(canonical / (P_o r_o), changed * b * 8 / 5 Gbit/s + latency, changed * a / P_a)
            + f0 + f1 * changed / P_o

    ``floor_s`` is the link term alone (the transport lower bound). Reference: canonical bytes over
    the same link. Construction and apply costs are this machine's CPU costs, not GPU kernels'.
    """
    rel = [c for c in cases if c.get("case", "").startswith("stress") and c["transport"] == "relay"
           and c.get("link_mbps")]
    if not rel:
        return None
    xs = [c["changed"] / c["owners"] for c in rel]
    ys = [c["prepare_s"] + c["commit_s"] for c in rel]
    if len(rel) > 1 and max(xs) > min(xs):
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        f1 = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))
        f0 = max(0.0, my - f1 * mx)
    else:
        f0, f1 = ys[0], 0.0
    # per-byte costs: the best of all measured stress cases (the machine is shared; contention only slows)
    every = [c for c in cases if c.get("case", "").startswith("stress") and c.get("changed")]
    r_o = max(c["canonical_bytes"] / c["owners"] / c["construct_s"] for c in every)
    a = min(c["apply_s"] / c["changed"] for c in every)
    rows = []
    for rate in (0.03, 0.05):
        m = next((c for c in rel if c["case"] == f"stress-{rate:.0%}"), None)
        if m is None:
            continue
        b = m["wire_bytes"] / m["changed"]
        for name, canon in PROJECTION_MODELS.items():
            changed = canon / 2 * rate
            t_c = canon / (PROJECTION_OWNERS * r_o)
            t_l = reference_seconds(changed * b, PROJECTION_LINK_MBPS, m["latency_s"])
            t_a = changed * a / PROJECTION_APPLIERS
            t_f = f0 + f1 * changed / PROJECTION_OWNERS
            t = max(t_c, t_l, t_a) + t_f
            ref = reference_seconds(canon, PROJECTION_LINK_MBPS, m["latency_s"])
            row = {"model": name, "canonical_bytes": canon, "change_rate": rate, "wire_bytes": changed * b,
                   "construct_s": t_c, "link_s": t_l, "apply_s": t_a, "finalize_s": t_f, "refit_s": t,
                   "reference_s": ref, "speedup": ref / t, "floor_s": t_l, "speedup_floor": ref / t_l,
                   "bound": max((("construct", t_c), ("link", t_l), ("apply", t_a)), key=lambda x: x[1])[0]}
            for tr in TRANSPORTS:
                nemo = NEMO.get((name, rate, tr))
                if nemo:
                    row[f"nemo_{tr}"] = {"refit_s": nemo[0], "reference_s": nemo[1], "speedup": nemo[1] / nemo[0]}
            rows.append(row)
    return {"label": "PROJECTION from measured per-byte costs + link model (not measured)",
            "link_mbps": PROJECTION_LINK_MBPS, "owners": PROJECTION_OWNERS, "appliers": PROJECTION_APPLIERS,
            "construct_bytes_per_s_per_owner": r_o, "apply_s_per_changed": a, "finalize_fixed_s": f0,
            "finalize_s_per_changed_per_owner": f1, "rows": rows}


#: Change rates the projection reports beside the scale sweep's own (1%), as :func:`projection` does.
PROJECTION_RATES = (0.03, 0.05)
#: What a GPU deployment changes among the projection's inputs: the two CPU rates measured here. The link,
#: the wire bytes per change (the codec's output does not depend on where it runs) and the coordinator's
#: fixed costs stay.
GPU_INPUTS = {
    "construct_bytes_per_s_per_owner": "the owners' diff + encode rate (canonical bytes per second per owner): on "
                                       "GPUs a kernel over HBM (benchmarks/cuda 'kernels' measures it); here an "
                                       "owner process's CPU",
    "apply_s_per_changed": "an engine's apply time per changed element: on GPUs a scatter kernel (benchmarks/cuda "
                           "'patch' measures one); here an engine process's CPU",
}


def bytes_per_change_of_refit(refit: dict) -> dict[float, float]:
    """Wire bytes per changed element of a ``dcr-ray bench refit`` run's relay stress cases at its headline
    link, by change rate (``{0.03: 1.25, ...}``): what the scale sweep (1% only) does not measure."""
    link = refit.get("settings", {}).get("link_mbps")
    out = {}
    for c in refit.get("cases", []):
        if (c.get("case", "").startswith("stress") and c["transport"] == "relay" and c.get("link_mbps") == link
                and c.get("changed")):
            out[round(float(c["case"].split("-")[1].rstrip("%")) / 100, 6)] = c["wire_bytes"] / c["changed"]
    return out


def projection_from_scale(scale: dict, *, bytes_per_change: dict | None = None,
                          construct_bytes_per_s_per_owner: float | None = None,
                          apply_s_per_changed: float | None = None) -> dict | None:
    """The 30B-1T projection of :func:`projection` recomputed from the *slopes* ``dcr-ray bench scale``
    measured over model sizes (a projection, not a measurement), instead of one size's best case.

    Inputs, each a least-squares slope of the scale run's size sweep (``scale["fits"]``):

    - ``r_o`` = 1 / (slowest owner's CPU seconds per GB of its share): the owners' diff + encode rate;
    - ``a``   = slowest engine's CPU seconds per changed GB, per changed BF16 element: the apply rate;
    - ``r``   = slowest relay's CPU seconds per changed GB: the head relay's pull and re-put, a stage of its own;
    - ``b``   = wire bytes per changed GB, per changed element, at the sweep's change rate (1%); other rates
      take ``bytes_per_change`` (``{rate: bytes per changed element}``, e.g. :func:`bytes_per_change_of_refit`
      of a refit run; those at :data:`PROJECTION_RATES` are used), since bytes per change depend on the rate;
    - ``f0 + f1 * changed_per_owner``: prepare + commit against changed elements per owner over the size points.

    With :data:`PROJECTION_OWNERS` owners, :data:`PROJECTION_APPLIERS` appliers per rollout replica and one
    :data:`PROJECTION_LINK_MBPS` link at the cluster boundary (the stages stream, so the slowest decides)::

        T = max(canonical / (P_o r_o), changed * b * 8 / 5 Gbit/s + latency, changed * 2 * r,
                changed * a / P_a) + f0 + f1 * changed / P_o

    The two rates a GPU changes (:data:`GPU_INPUTS`: ``r_o`` and ``a``) can be given instead of the CPU
    slopes (``construct_bytes_per_s_per_owner``, ``apply_s_per_changed``); the result says which were used.
    Returns None when the scale run has no size slopes.
    """
    fits = scale.get("fits") or {}

    def slope(name):
        f = (fits.get(name) or {}).get("fit")
        return None if f is None else max(0.0, f["slope"])

    owner, engine = slope("owner_cpu_s_per_share_gb"), slope("engine_cpu_s_per_changed_gb")
    relay, wire = slope("relay_cpu_s_per_changed_gb"), slope("wire_bytes_per_changed_gb")
    if None in (owner, engine, wire):
        return None
    r_o = construct_bytes_per_s_per_owner or (1e9 / owner if owner else float("inf"))
    a = apply_s_per_changed if apply_s_per_changed is not None else engine * 2 / 1e9
    r = (relay or 0.0) / 1e9
    rate0 = scale.get("change_rate", 0.01)
    # this run's own bytes per change at its rate; the given ones at the rates the refit projection reports
    bpc = {**{round(k, 6): v for k, v in (bytes_per_change or {}).items() if round(k, 6) in PROJECTION_RATES},
           round(rate0, 6): wire * 2 / 1e9}
    size = [scale["points"][k] for k in scale.get("sweeps", {}).get("size", [])
            if scale["points"].get(k, {}).get("ok")]
    xs = [p["changed"] / p["owners"] for p in size]
    ys = [p["phases"]["prepare"] + p["phases"]["commit"] for p in size]
    from benchmarks.scale.fit import linear

    fin = linear(xs, ys)
    f0, f1 = (max(0.0, fin["intercept"]), max(0.0, fin["slope"])) if fin else ((ys[0] if ys else 0.0), 0.0)
    lat = scale.get("settings", {}).get("projection_latency_s", 0.025)
    rows = []
    for rate, b in sorted(bpc.items()):
        for name, canon in PROJECTION_MODELS.items():
            changed = canon / 2 * rate
            t_c = canon / (PROJECTION_OWNERS * r_o)
            t_l = reference_seconds(changed * b, PROJECTION_LINK_MBPS, lat)
            t_r = changed * 2 * r
            t_a = changed * a / PROJECTION_APPLIERS
            t_f = f0 + f1 * changed / PROJECTION_OWNERS
            t = max(t_c, t_l, t_r, t_a) + t_f
            ref = reference_seconds(canon, PROJECTION_LINK_MBPS, lat)
            row = {"model": name, "canonical_bytes": canon, "change_rate": rate, "wire_bytes": changed * b,
                   "construct_s": t_c, "link_s": t_l, "relay_s": t_r, "apply_s": t_a, "finalize_s": t_f,
                   "refit_s": t, "reference_s": ref, "speedup": ref / t, "floor_s": t_l, "speedup_floor": ref / t_l,
                   "bound": max((("construct", t_c), ("link", t_l), ("relay", t_r), ("apply", t_a)),
                                key=lambda x: x[1])[0]}
            nemo = NEMO.get((name, rate, "relay"))
            if nemo:
                row["nemo_relay"] = {"refit_s": nemo[0], "reference_s": nemo[1], "speedup": nemo[1] / nemo[0]}
            rows.append(row)
    return {"label": "PROJECTION from the scale sweep's measured slopes + link model (not measured)",
            "link_mbps": PROJECTION_LINK_MBPS, "latency_s": lat, "owners": PROJECTION_OWNERS,
            "appliers": PROJECTION_APPLIERS, "construct_bytes_per_s_per_owner": r_o, "apply_s_per_changed": a,
            "relay_s_per_changed_byte": r, "bytes_per_change": bpc, "finalize_fixed_s": f0,
            "finalize_s_per_changed_per_owner": f1,
            "inputs_from": {"construct_bytes_per_s_per_owner": "given" if construct_bytes_per_s_per_owner
                            else "measured CPU slope", "apply_s_per_changed": "given" if apply_s_per_changed
                            is not None else "measured CPU slope"},
            "gpu_inputs": GPU_INPUTS, "rows": rows}
