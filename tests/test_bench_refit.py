"""``dcr-ray bench refit``: derived numbers (projection, sweep model, checks), output, and a tiny real run."""

from __future__ import annotations

import raytools  # noqa: F401  (sets the loopback environment before ray is imported)

import argparse
import json

import pytest

from dcr_ray.bench import refit as R
from dcr_ray.cli import build_parser
from dcr_ray.testing.links import LinkModel


def _case(rate, transport="relay", link=20.0, changed_frac=None, **kw):
    canon = 1_000_000_000
    changed = int(canon / 2 * (changed_frac or rate))
    wire = int(changed * 1.3)
    lb = wire * 8 / (link * 1e6) + 0.025
    dcr = lb / 0.95
    ref = R.reference_seconds(canon, link, 0.025)
    c = {"name": f"stress-{rate:.0%}-x-{transport}", "case": f"stress-{rate:.0%}", "transport": transport,
         "link_mbps": link, "latency_s": 0.025, "change_rate": rate, "dcr_seconds": dcr, "reference_seconds": ref,
         "speedup": ref / dcr, "wire_bytes": wire, "reference_bytes": canon, "lower_bound_s": lb,
         "lower_bound_fraction": lb / dcr, "bit_exact": True, "byte_ratio": canon / wire,
         "efficiency": (ref / dcr) / (canon / wire), "construct_s": 1.0, "apply_s": 1.5, "prepare_s": 0.01,
         "commit_s": 0.1 + changed / 2 * 1e-8, "changed": changed, "owners": 2, "canonical_bytes": canon,
         "owner_peak_bytes": 1 << 30, "engine_peak_bytes": 1 << 30, "peers_bit_exact": True,
         "peers": {p: ref / 10 for p in R.PEERS}, "peers_speedup": {p: 10.0 for p in R.PEERS},
         "peers_construct_s": {p: 1.0 for p in R.PEERS}, "peers_apply_s": {p: 1.0 for p in R.PEERS},
         "peers_bytes": {p: 3 * wire for p in R.PEERS}}
    c.update(kw)
    return c


def _settings(**kw):
    a = argparse.Namespace(quick=True, size="tiny", link_mbps=20.0, latency_ms=25.0, engines=1,
                           transports="relay", real_steps=1, lr=1e-6, bucket_mib=1, seed=0, no_sweep=False,
                           no_reference_check=True, cases="stress", rates="3", baseline="mmap")
    for k, v in kw.items():
        setattr(a, k, v)
    return R.Settings.from_args(a)


def test_the_refit_bench_is_a_bench_subcommand_with_its_options():
    args = build_parser().parse_args(["bench", "refit", "--quick", "--json", "x.json", "--plot", "x.png",
                                      "--link-mbps", "50"])
    assert args.func is R.run and args.quick and args.link_mbps == 50 and args.plot == "x.png"


def test_the_reference_is_the_link_model_time_of_every_canonical_byte():
    assert R.reference_seconds(1_000_000_000, 20.0, 0.025) == pytest.approx(400.025)
    assert R.reference_seconds(123, None, 0.5) == 0.0
    # the streaming link model: splitting the bytes into payloads does not add latency per payload
    link = LinkModel(8000.0, 0.001)
    for _ in range(4):
        link.cross(250_000)
    assert link.busy_s == pytest.approx(4 * 250_000 * 8 / 8e9, rel=0.05)
    assert link.bytes == 1_000_000


def test_the_projection_scales_measured_costs_and_sits_beside_nemo_dcr():
    cases = [_case(r) for r in (0.01, 0.03, 0.05)]
    pj = R.projection(cases)
    rows = {(p["model"], p["change_rate"]): p for p in pj["rows"]}
    assert set(rows) == {(m, r) for m in R.PROJECTION_MODELS for r in (0.03, 0.05)}
    p = rows[("120B", 0.03)]
    assert p["wire_bytes"] == pytest.approx(247.2e9 / 2 * 0.03 * 1.3, rel=1e-3)
    assert p["link_s"] == pytest.approx(p["wire_bytes"] * 8 / 5e9 + 0.025)
    assert p["reference_s"] == pytest.approx(247.2e9 * 8 / 5e9 + 0.025)
    assert p["refit_s"] == pytest.approx(max(p["construct_s"], p["link_s"], p["apply_s"]) + p["finalize_s"])
    assert p["nemo_relay"] == {"refit_s": 22.6, "reference_s": 750.0, "speedup": pytest.approx(750 / 22.6)}
    # finalisation was fitted as fixed + per changed element per owner: the synthetic commit had 1e-8 s each
    assert pj["finalize_s_per_changed_per_owner"] == pytest.approx(1e-8, rel=1e-3)
    assert pj["finalize_fixed_s"] == pytest.approx(0.11, rel=1e-3)


def test_the_sweep_model_is_link_bound_on_slow_links_and_compute_bound_on_fast_ones():
    s = _settings()
    base = _case(0.03)
    free = dict(_case(0.03), link_mbps=None, dcr_seconds=3.0, reference_seconds=0.0, speedup=None,
                lower_bound_fraction=None)
    sw = R.sweep_model({"cases": [base], "sweep_measured": [free]}, s)
    assert sw["t_cpu_s"] == 3.0
    slow, fast = sw["curve"][0], sw["curve"][-1]
    assert slow["link_mbps"] == pytest.approx(10) and fast["link_mbps"] == pytest.approx(10_000)
    assert slow["link_bound"] and not fast["link_bound"]
    assert fast["dcr_seconds"] == 3.0
    assert slow["speedup"] == pytest.approx(slow["reference_seconds"] / slow["dcr_seconds"])
    assert 20 < sw["crossover_mbps"] < 100


def test_checks_table_markdown_and_json_schema_of_a_result():
    s = _settings()
    cases = [_case(0.03), _case(0.05), _case(0.03, "object_store"), _case(0.05, "object_store")]
    r = {"bench": "refit", "quick": True, "cases": cases, "summary": [], "settings":
         {k: getattr(s, k) for k in R.Settings.__dataclass_fields__}, "sweep": None,
         "projection": R.projection(cases), "checks": R.checks(cases, s), "elapsed_s": 1.0,
         "machine": {"loadavg_start": (0, 0, 0), "loadavg_end": (0, 0, 0)}}
    assert all(all(v.values()) for v in r["checks"].values())
    text = R.format_table(r)
    assert "PROJECTION" in text and "stress-3%" in text and "MISS" not in text
    md = R.markdown(r)
    assert md.count("\n| stress-") == 4
    json.dumps(r)
    for c in cases:  # the schema the issue asks for
        for k in ("name", "change_rate", "transport", "link_mbps", "dcr_seconds", "reference_seconds", "speedup",
                  "wire_bytes", "reference_bytes", "lower_bound_fraction", "bit_exact", "byte_ratio",
                  "efficiency", "peers"):
            assert k in c


@pytest.mark.slow
def test_a_tiny_refit_bench_runs_end_to_end_bit_exact_and_writes_its_outputs(tmp_path):
    import ray

    raytools.init_local_ray()
    try:
        s = _settings(no_sweep=True)
        result = R.run_bench(s)
    finally:
        ray.shutdown()
    (c,) = result["cases"]
    assert c["bit_exact"] and c["peers_bit_exact"]
    assert c["wire_bytes"] > 0 and c["reference_bytes"] == 2 * c["numel"]
    assert 0.02 < c["change_rate"] < 0.04
    assert c["lower_bound_fraction"] > 0 and c["owner_peak_bytes"] > 0 and c["engine_peak_bytes"] > 0
    R.plot(result, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
