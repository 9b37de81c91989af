"""What the library default does on each case: ``CodecConfig.coding="auto"``, asked, not imitated.

The coordinator picks each refit's coding with :func:`~dcr_ray.actors.coordinator.coding.choose_coding` from
the refits it has seen. Here it is given this case as two such refits, one per coding, with what this run
measured for them (wire bytes, encode seconds as an owner's construct, decode+apply seconds on a live
receiver as an engine's apply), and a configured link (``--link-mbps``: there is no link in this
benchmark). Its answer selects which coding's measured numbers are the default's: ``default_coding``,
``default_reason`` (the library's own words), ``default_wire_bytes``, ``default_bytes_per_change``,
``default_encode_gbps`` and ``default_apply_gbps``. ``default_by_link`` repeats the question at other
links. Nothing is computed that the run did not measure; the link is the only figure given.
"""

from __future__ import annotations

#: The one cluster the library is told about.
CLUSTER = "codec-bench"
#: Links (Mbit/s) at which ``default_by_link`` asks again.
LINKS_MBPS = (10.0, 100.0, 1000.0, 10000.0)


def _as_refit(case: dict, coding: str) -> dict:
    """This case's measurement of ``coding`` as the report of one refit (the form the coordinator keeps)."""
    wire = case["wire_bytes"] if coding == "context" else case["today_wire_bytes"]
    gb = case["canonical_bytes"] / 1e9
    construct, apply = gb / case[f"{coding}_encode_gbps"], gb / case[f"{coding}_apply_gbps"]
    return {"coding": coding, "attempts": 1, "mode": "mixed", "changed": case["changed"], "wire_bytes": wire,
            "link_bytes": {CLUSTER: wire},  # the stream seconds go unread: the link is a configured figure
            "seconds": {"stream": construct + apply, "construct": construct, "apply": apply}}


def choice(case: dict, link_mbps: float):
    """The library's :class:`~dcr_ray.actors.coordinator.coding.CodingChoice` for ``case`` on ``link_mbps``."""
    from dcr_ray.actors.coordinator.coding import choose_coding
    from dcr_ray.config import CodecConfig

    history = [_as_refit(case, c) for c in ("plain", "context")]
    return choose_coding(CodecConfig(link_mbps=link_mbps), history, {CLUSTER})


def library_default(case: dict, link_mbps: float) -> dict:
    """The ``default_*`` fields of ``case`` (see the module docstring)."""
    got = choice(case, link_mbps)
    c = got.coding
    wire = case["wire_bytes"] if c == "context" else case["today_wire_bytes"]
    return {"default_coding": c, "default_reason": got.reason, "default_link_mbps": link_mbps,
            "default_wire_bytes": wire, "default_bytes_per_change": wire / max(case["changed"], 1),
            "default_over_plain": wire / case["today_wire_bytes"] if case["today_wire_bytes"] else None,
            "default_encode_gbps": case[f"{c}_encode_gbps"], "default_apply_gbps": case[f"{c}_apply_gbps"],
            "default_by_link": {f"{m:g}": choice(case, m).coding for m in LINKS_MBPS}}
