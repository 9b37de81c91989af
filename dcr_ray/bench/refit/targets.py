"""What the stress cases should reach at the headline link: checked per case and reported, never asserted."""

from __future__ import annotations

from dcr_ray.bench.refit.settings import Settings

#: Minimum speedup at 3% and 5%, efficiency (speedup / byte ratio) and transport lower bound / refit time.
TARGETS = {"speedup_3pct_min": 40.0, "speedup_5pct_min": 25.0, "efficiency_min": 0.85,
           "lower_bound_fraction_min": 0.90}


def checks(cases: list[dict], s: Settings) -> dict:
    """Targets per headline case (stress cases at the headline link): {target: {case: passed}}."""
    head = [c for c in cases if c.get("case", "").startswith("stress") and c["link_mbps"] == s.link_mbps]
    t = TARGETS
    out = {
        "speedup>=40x@3%": {c["name"]: c["speedup"] >= t["speedup_3pct_min"] for c in head
                            if c["case"] == "stress-3%"},
        "speedup>=25x@5%": {c["name"]: c["speedup"] >= t["speedup_5pct_min"] for c in head
                            if c["case"] == "stress-5%"},
        "efficiency>=0.85": {c["name"]: c["efficiency"] >= t["efficiency_min"] for c in head},
        "lower_bound>=90%": {c["name"]: c["lower_bound_fraction"] >= t["lower_bound_fraction_min"] for c in head},
        "bit_exact": {c["name"]: c["bit_exact"] for c in cases},
        "peers_bit_exact": {c["name"]: c["peers_bit_exact"] for c in cases if "peers_bit_exact" in c},
    }
    return out
