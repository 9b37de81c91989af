"""The link table: the 3% relay refit measured at every link of the run, beside its measured references.

Nothing here is modelled: each row is a refit measured at that link (the headline case and the cases of
``--links``), with the uncompressed checkpoint and dcr_ray's dense refit measured at the same link
(:mod:`.reference`). The link-model formula of the canonical bytes is listed beside them for comparison.
It shows where the link stops deciding: on a slow link a refit moves ``byte ratio`` times fewer bytes
than the reference, on a fast one this machine's CPU (construction, apply) sets both times.
"""

from __future__ import annotations

from benchmarks.refit.settings import Settings

#: Per row, copied from its case.
ROW_KEYS = ("link_mbps", "change_rate", "dcr_seconds", "ready_for_next_seconds", "promote_seconds",
            "reference_seconds", "measured_reference_seconds", "measured_reference_bytes",
            "measured_dense_refit_seconds", "measured_dense_refit_bytes", "speedup", "speedup_vs_measured_reference",
            "speedup_vs_measured_dense_refit", "byte_ratio", "lower_bound_fraction", "construct_s", "apply_s",
            "wire_bytes", "bit_exact", "dirty_pages", "changed_pages")


def link_table(result: dict, s: Settings) -> dict | None:
    """Rows of the 3% relay case by link (headline first, then ``--links``; ``link_mbps`` None = no link)."""
    head = next((c for c in result.get("cases", []) if c.get("case") == "stress-3%" and c["transport"] == "relay"
                 and c["link_mbps"] == s.link_mbps), None)
    rows = ([head] if head else []) + list(result.get("link_cases") or [])
    if not rows:
        return None
    measured = sorted(({k: c.get(k) for k in ROW_KEYS} | {"headline": c is head} for c in rows),
                      key=lambda r: r["link_mbps"] or float("inf"))
    return {"label": "measured: the 3% relay refit at each link, references measured at the same link",
            "case": rows[0]["name"], "measured": measured}
