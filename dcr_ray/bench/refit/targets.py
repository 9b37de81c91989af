"""What the run should reach: checked per case and reported, never asserted.

Speedups are against the full-checkpoint reference *measured* through the same system and link
(:mod:`.reference`), at the headline link; a speedup against the link-model formula is reported but
is not a target. Dirtied baseline pages are checked on every case with a memory-mapped baseline.
"""

from __future__ import annotations

from dcr_ray.bench.refit.settings import Settings

#: Minimum speedup against the measured reference at 3% and 5% (headline link), and the most baseline
#: pages a promote may dirty per page that holds a change.
TARGETS = {"speedup_3pct_min": 40.0, "speedup_5pct_min": 25.0, "dirty_per_changed_page_max": 1.5,
           "experts_fixed_cost_max_s": 0.5}


def checks(cases: list[dict], s: Settings, link_cases: list[dict] | None = None) -> dict:
    """Targets per case: {target: {case name: passed}}."""
    head = [c for c in cases if c.get("case", "").startswith("stress") and c["link_mbps"] == s.link_mbps]
    every = list(cases) + list(link_cases or [])
    t = TARGETS

    def vs_ref(c):
        return c.get("speedup_vs_measured_reference") or 0.0

    return {
        "speedup>=40x@3% (measured reference)": {c["name"]: vs_ref(c) >= t["speedup_3pct_min"] for c in head
                                                 if c["case"] == "stress-3%"},
        "speedup>=25x@5% (measured reference)": {c["name"]: vs_ref(c) >= t["speedup_5pct_min"] for c in head
                                                 if c["case"] == "stress-5%"},
        "dirty_pages<=1.5x changed_pages": {
            c["name"]: c["dirty_pages"] <= t["dirty_per_changed_page_max"] * c["changed_pages"]
            for c in every if c.get("dirty_pages") is not None},
        "10^5 tensors: owner construct <= 0.5 s": {c["name"]: c["construct_s"] <= t["experts_fixed_cost_max_s"]
                                                    for c in cases if c.get("case") == "experts"},
        "10^5 tensors: engine apply <= 0.5 s": {c["name"]: c["apply_s"] <= t["experts_fixed_cost_max_s"]
                                                for c in cases if c.get("case") == "experts"},
        "bit_exact": {c["name"]: c["bit_exact"] for c in every},
        "peers_bit_exact": {c["name"]: c["peers_bit_exact"] for c in cases if "peers_bit_exact" in c},
    }
