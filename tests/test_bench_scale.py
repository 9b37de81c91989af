"""``dcr-ray bench scale``: the fitting (slopes, R², growth exponents), the targets and the projection on
synthetic numbers, the sweep's plan, and (slow) the ``--quick`` sweep end to end on a real Ray."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import scale as S
from benchmarks.scale import fit, plan

GB = 1e9
MiB = 1 << 20


def _point(size, clusters=1, engines=1, *, s_per_changed_gb=2.0, fixed_s=0.1, owner_extra_per_share=1.0,
           engine_extra=10 * MiB, relay_extra=5 * MiB, coord_extra=20 * MiB, owner_cpu_per_engine=0.0,
           s_per_engine=0.0, relay_children=None):
    """A measured point as :mod:`benchmarks.scale.measure` records it, from a model that is linear in its work:
    the owner holds one baseline of its share, the engine a small buffer, the relay and coordinator fixed."""
    n = plan.numel(size)
    model, share = 2 * n, n  # two owners: half the model each
    changed = n // 100
    refit = fixed_s + s_per_changed_gb * 2 * changed / GB + s_per_engine * (engines - 1)
    e = clusters * engines

    def role(extra, k=1, **more):
        each = {f"a{i}": {"start": 300 * MiB, "peak": 300 * MiB + extra, "peak_above_start": extra,
                          "added_by_refit": extra // 10, **more} for i in range(k)}
        return {"each": each, "peak_max": 300 * MiB + extra, "peak_above_start_max": extra,
                "added_by_refit_max": extra // 10}

    relays = clusters * (1 if engines <= 4 else 3)
    return {
        "key": plan.Point(size, clusters, engines).key, "size": size, "clusters": clusters,
        "engines_per_cluster": engines, "engines": e, "owners": 2, "ok": True, "bit_exact": True,
        "numel": n, "model_bytes": model, "owner_share_bytes": share, "changed": changed, "changed_bytes": 2 * changed,
        "change_rate": 0.01, "wire_bytes": int(1.2 * changed), "refit_s": refit, "ready_s": refit + 0.01,
        "phases": {"prepare": 0.01, "commit": 0.02 + 1e-9 * changed / 2},
        "cpu_s": {"owner": {"sum": 2 * (0.5 * share / GB + owner_cpu_per_engine * engines),
                            "max": 0.5 * share / GB + owner_cpu_per_engine * engines},
                  "relay": {"sum": 0.01 * e, "max": 0.01 + 0.1 * 2 * changed / GB},
                  "coordinator": {"sum": 0.02, "max": 0.02},
                  "engine": {"sum": e * 3 * 2 * changed / GB, "max": 0.01 + 3 * 2 * changed / GB}, "ray": {"sum": 0.1}},
        "derived_streamed_s": 0.5 * share / GB + owner_cpu_per_engine * engines,
        "memory": {"owner": role(int(owner_extra_per_share * share) + 50 * MiB, 2),
                   "relay": role(relay_extra, relays, children=relay_children or min(engines, 4)),
                   "coordinator": role(coord_extra), "engine": role(model + engine_extra, e)},
        "store": {"peak_above_before_bytes": 3 * changed, "created_bytes": 3 * changed, "peak_bytes": 4 * changed},
        "links": {"boundary": {f"head{i}": int(1.2 * changed) for i in range(clusters)}},
    }


def _run(quick=False, **kw):
    """A whole synthetic run of the plan (every point linear in its work unless ``kw`` says otherwise)."""
    p = plan.Plan.of(quick)
    sweeps = {name: [pt.key for pt in pts] for name, pts in p.sweeps().items()}
    points = {pt.key: _point(pt.size, pt.clusters, pt.engines, **kw) for pt in p.points()}
    r = {"bench": "scale", "quick": quick, "change_rate": 0.01, "sweeps": sweeps, "order": list(points),
         "points": points, "skipped": {}, "machine": {"cpus": 2}, "git": {"commit": "0" * 40},
         "settings": {"owners": 2, "bucket_bytes": 16 * MiB, "fanout_size": p.fanout_size,
                      "projection_latency_s": 0.025}}
    from benchmarks.scale.runner import derive

    return derive(r)


def test_a_straight_line_is_fitted_with_its_slope_intercept_and_an_r2_of_one():
    f = fit.linear([1, 2, 3, 4], [3, 5, 7, 9])
    assert f["slope"] == pytest.approx(2) and f["intercept"] == pytest.approx(1) and f["r2"] == pytest.approx(1)
    assert f["n"] == 4


def test_r2_is_the_share_of_the_spread_the_line_explains():
    f = fit.linear([1, 2, 3, 4], [1, 3, 2, 4])
    assert f["slope"] == pytest.approx(0.8) and f["r2"] == pytest.approx(0.64)
    flat = fit.linear([1, 2, 3], [5, 5, 5])  # nothing varies, nothing to explain: the slope says it is flat
    assert flat["slope"] == pytest.approx(0, abs=1e-12) and flat["r2"] is None


def test_fewer_than_two_distinct_x_give_no_line_and_no_exponent():
    assert fit.linear([2], [1]) is None and fit.linear([2, 2], [1, 3]) is None
    assert fit.exponent([0, 1], [1, 2]) is None  # x = 0 has no logarithm: one usable point left


def test_a_power_law_is_fitted_with_its_exponent():
    xs = [1, 2, 4, 8, 16]
    assert fit.exponent(xs, [3 * x ** 2 for x in xs]) == pytest.approx(2)
    assert fit.exponent(xs, [3 * x for x in xs]) == pytest.approx(1)


def test_a_quadratic_term_is_flagged_faster_than_linear_and_a_line_with_a_fixed_cost_is_not():
    xs = [0.02, 0.08, 0.4, 1.2, 2.4]
    quad = fit.series("q", xs, [0.3 * x * x + 0.1 for x in xs], x="GB", y="s", floor=0.05)
    lin = fit.series("l", xs, [0.5 + 2 * x for x in xs], x="GB", y="s", floor=0.05)
    # the fixed cost hides the square among the small points (exponent over all points < 1.15), not at the top
    assert quad["superlinear"] and quad["exponent"] < fit.SUPERLINEAR < quad["exponent_top"]
    assert not lin["superlinear"] and lin["exponent"] < 1 and lin["fit"]["r2"] == pytest.approx(1)
    assert fit.flags({"q": quad, "l": lin}) == ["q"]


def test_a_series_under_its_noise_floor_is_never_flagged_however_steep():
    s = fit.series("coord", [0.02, 2.4], [1e5, 9e6], x="GB", y="bytes", floor=fit.NOISE_FLOOR_BYTES)
    assert s["exponent"] < 1.15 or not s["superlinear"]
    steep = fit.series("coord", [1, 2, 4], [1e3, 4e3, 16e3], x="GB", y="bytes", floor=fit.NOISE_FLOOR_BYTES)
    assert steep["exponent"] == pytest.approx(2) and not steep["superlinear"]


def test_a_run_that_grows_linearly_with_bounded_buffers_meets_every_target():
    r = _run()
    t = r["targets"]
    assert {k: v["met"] for k, v in t.items()} == {k: True for k in t}, t
    assert r["superlinear"] == [] and r["targets_met"]
    f = r["fits"]
    assert f["refit_s_per_changed_gb"]["fit"]["slope"] == pytest.approx(2.0)
    assert f["refit_s_per_changed_gb"]["fit"]["r2"] == pytest.approx(1.0)
    # the engine holds its model: one model GB per model GB, and the owners one share per share GB
    assert f["engine_memory_per_model_gb"]["fit"]["slope"] == pytest.approx(1e9, rel=1e-6)
    assert f["owner_memory_per_share_gb"]["fit"]["slope"] == pytest.approx(1e9, rel=1e-6)
    assert f["coordinator_memory_per_model_gb"]["fit"]["slope"] == pytest.approx(0, abs=1)


def test_an_owner_holding_two_copies_of_its_share_beside_its_tensors_misses_its_target_at_the_largest_model():
    t = _run(owner_extra_per_share=3.0)["targets"]["owner_memory"]
    assert t["met"] is False and t["at"] == "1.2B/c1/e1"
    assert t["value"] > t["limit"] and len(t["every"]) == len(plan.SIZES)


def test_memory_that_grows_with_the_square_of_the_model_is_flagged():
    r = _run()
    pts = r["points"]
    for k in r["sweeps"]["size"]:  # a relay that keeps (model GB)² worth of copies
        pts[k]["memory"]["relay"]["peak_above_start_max"] = int(0.4 * (pts[k]["model_bytes"] / GB) ** 2 * GB)
    from benchmarks.scale.runner import derive

    r = derive(r)
    assert "relay_memory_per_model_gb" in r["superlinear"]


def test_engines_that_cost_the_refit_and_the_owners_miss_the_per_engine_targets():
    t = _run(s_per_engine=0.5, owner_cpu_per_engine=0.3)["targets"]
    assert t["engine_added_cost"]["met"] is False and t["engine_added_cost"]["value"] > 0.1
    assert t["engine_added_cost"]["s_per_engine"] == pytest.approx(0.5)
    assert t["owners_flat_in_engines"]["met"] is False
    # with a core per actor the owners are the busiest actors, and they pay per engine here
    assert t["engine_added_cost_derived"]["met"] is False


def test_a_target_whose_sweep_did_not_run_is_reported_as_not_measured():
    r = _run()
    r["sweeps"]["engines"] = []
    from benchmarks.scale.runner import derive

    t = derive(r)["targets"]
    assert t["engine_added_cost"]["met"] is None and t["owners_flat_in_engines"]["met"] is None
    assert t["engine_added_cost_derived"]["met"] is None
    assert t["owner_memory"]["met"] is True  # the other targets stand


def test_a_points_figures_are_the_median_time_and_cpu_of_its_refits_and_their_largest_memory():
    import types

    from benchmarks.scale import measure

    roles = {"owner": {"owner0": (1, None), "owner1": (2, None)}, "relay": {"c0/head": (3, None)},
             "coordinator": {"coordinator": (4, None)}, "engine": {"c0/e0": (5, None)}}
    ids = ["owner/owner0", "owner/owner1", "relay/c0/head", "coordinator/coordinator", "engine/c0/e0"]

    def refit(k, store=True):
        return {"refit_s": 1.0 + k, "driver_s": 1.1 + k, "ready_s": 1.2 + k,
                "phases": {"total": 1.0 + k, "prepare": 0.01, "commit": 0.1, **({"release": 0.5} if k else {})},
                "changed": 100, "numel": 10000, "wire_bytes": 120 + k, "payloads": 2,
                "cpu": {i: 0.1 * (j + 1) + k for j, i in enumerate(ids)}, "ray_cpu": 0.05,
                "peak": {i: 1000 + 100 * k for i in ids}, "before": {i: 900 for i in ids},
                "hwm": {i: 1100 for i in ids},
                "store": {"before": 10, "peak": 50 + k, "created": 40, "spilled": 0} if store else None,
                "boundary": {"head0": 120 + k}, "engine_bytes": {"c0/e0": 120 + k}, "relay_in": {"c0/head": 120 + k}}

    topo = types.SimpleNamespace(numel=10000, owner_share_bytes=12000)
    got = measure._summarise([refit(0), refit(2), refit(1, store=False)], roles, {i: 500 for i in ids},
                             {"c0/head": 1}, topo, {"owner/owner0": 5000})
    assert got["refit_s"] == 2.0 and got["wire_bytes"] == 121 and got["changed_bytes"] == 200
    assert got["cpu_s"]["owner"] == {"sum": pytest.approx(2.3), "max": pytest.approx(1.2),
                                     "each": {"owner0": pytest.approx(1.1), "owner1": pytest.approx(1.2)}}
    assert got["cpu_s"]["engine"]["max"] == pytest.approx(1.5) and got["derived_streamed_s"] == pytest.approx(1.5)
    eng = got["memory"]["engine"]["each"]["c0/e0"]  # the largest peak of the three, against the start
    assert (eng["peak"], eng["peak_above_start"], eng["added_by_refit"]) == (1200, 700, 300)
    assert got["memory"]["owner"]["each"]["owner0"]["launch_hwm"] == 5000
    assert got["memory"]["relay"]["each"]["c0/head"]["children"] == 1
    # a refit whose store counters could not be read is left out of the store's figures, and a phase that
    # not every refit reported is left out of the phases
    assert got["store"]["refits_read"] == 2 and got["store"]["peak_above_before_bytes"] == 42
    assert "release" not in got["phases"] and got["links"]["boundary"] == {"head0": 121}


def test_the_sweeps_share_their_points_and_the_largest_model_runs_last():
    p = plan.Plan.of(quick=False)
    pts = p.points()
    assert len(pts) == len(set(pts)) == 10  # 5 sizes + engines 2,4,8 + clusters 2,4 (of 2 engines)
    assert pts[-1] == plan.Point("1.2B", 1, 1)
    sw = p.sweeps()
    assert plan.Point("200M", 1, 1) in sw["size"] and plan.Point("200M", 1, 1) in sw["engines"]
    assert plan.Point("200M", 1, 2) in sw["engines"] and plan.Point("200M", 1, 2) in sw["clusters"]
    q = plan.Plan.of(quick=True).points()
    assert sorted(pt.key for pt in q) == sorted(["10M/c1/e1", "10M/c1/e2", "10M/c2/e1", "40M/c1/e1"])


def test_the_models_have_the_element_counts_they_are_named_after():
    # 40M, 200M and 600M are ModelSpec's small, medium and large (BENCHMARKS.md: 40.4 M, 207 M, 602 M)
    assert plan.numel("40M") == 40_387_072 and plan.numel("200M") == 207_143_936
    assert plan.numel("600M") == 601_734_656
    assert 9.5e6 < plan.numel("10M") < 10.5e6 and 1.15e9 < plan.numel("1.2B") < 1.25e9
    assert all(math.prod(s) > 0 for s in plan.shapes("10M").values())
    with pytest.raises(ValueError):
        plan.shapes("7B")


def test_the_memory_estimate_scales_what_a_measured_point_held_above_its_starts_linearly_in_elements():
    big = plan.Point("1.2B", 1, 1)
    got = plan.estimate_bytes(big, {"600M": (10 * GB, 2 * GB), "10M": (3 * GB, 2 * GB)})
    assert got == pytest.approx(2 * GB + 8 * GB * plan.numel("1.2B") / plan.numel("600M"))
    assert plan.estimate_bytes(big) > 4 * 2 * plan.numel("1.2B")  # before any point: per-byte constants


def test_the_projection_is_recomputed_from_the_slopes_and_takes_gpu_rates_in_place_of_the_cpu_ones():
    from benchmarks.refit.large_models import GPU_INPUTS, PROJECTION_MODELS, projection_from_scale

    r = _run()
    # a refit run's bytes per change at 3% join the sweep's own 1% (its 1% and 0.01% do not replace them)
    pr = projection_from_scale(r, bytes_per_change={0.03: 1.25, 0.01: 9.9, 0.0001: 3.4})
    assert pr["label"].startswith("PROJECTION") and set(pr["gpu_inputs"]) == set(GPU_INPUTS)
    assert {(x["model"], x["change_rate"]) for x in pr["rows"]} == {
        (m, rate) for m in PROJECTION_MODELS for rate in (0.01, 0.03)}
    # the owners' CPU slope is 0.5 s per share GB: 2 GB/s per owner; the engine's 3 s per changed GB
    assert pr["construct_bytes_per_s_per_owner"] == pytest.approx(2e9)
    assert pr["apply_s_per_changed"] == pytest.approx(6e-9)
    assert pr["bytes_per_change"][0.01] == pytest.approx(1.2, rel=1e-3)
    fast = projection_from_scale(r, construct_bytes_per_s_per_owner=1e12, apply_s_per_changed=1e-12)
    assert fast["inputs_from"] == {"construct_bytes_per_s_per_owner": "given", "apply_s_per_changed": "given"}
    slow_rows = {x["model"]: x for x in pr["rows"] if x["change_rate"] == 0.01}
    assert all(x["refit_s"] <= slow_rows[x["model"]]["refit_s"] for x in fast["rows"])
    assert all(x["bound"] in ("link", "relay") for x in fast["rows"])


def test_bytes_per_change_are_read_from_a_refit_runs_relay_stress_cases():
    from benchmarks.refit.large_models import bytes_per_change_of_refit

    refit = {"settings": {"link_mbps": 1000.0}, "cases": [
        {"case": "stress-3%", "transport": "relay", "link_mbps": 1000.0, "changed": 100, "wire_bytes": 125},
        {"case": "stress-3%", "transport": "relay", "link_mbps": 100.0, "changed": 100, "wire_bytes": 999},
        {"case": "stress-5%", "transport": "object_store", "link_mbps": 1000.0, "changed": 100, "wire_bytes": 999},
        {"case": "adamw", "transport": "relay", "link_mbps": 1000.0, "changed": 100, "wire_bytes": 999}]}
    assert bytes_per_change_of_refit(refit) == {0.03: 1.25}


def test_the_table_names_every_point_series_target_and_skipped_point():
    from benchmarks.scale.report import format_table

    r = _run(quick=True)
    r["skipped"] = {"1.2B/c1/e1": "estimated peak 30 GiB > 90% of MemAvailable"}
    r["order"].append("1.2B/c1/e1")
    text = format_table(r)
    for key in r["points"]:
        assert key in text
    assert "refit_s_per_changed_gb" in text and "engine_added_cost" in text and "skipped 1.2B/c1/e1" in text
    assert "PROJECTION" in text
    json.dumps(r)  # the result is JSON as it stands


def test_a_scale_runs_markdown_tables_are_rendered_from_its_json_alone():
    from benchmarks.markdown import render

    r = json.loads(json.dumps(_run(engine_extra=900 * MiB)))  # as read back from the file
    md = render(r, "scale.json")
    assert md.count("| 200M/c1/e8 |") == 1 and "| refit_s_per_changed_gb | changed GB | 2 |" in md
    assert "- NOT MET      engine_memory" in md and "- met          owner_memory" in md
    assert "PROJECTION" in md and "dcr-ray bench markdown scale.json" in md


def test_an_earlier_runs_json_is_rederived_from_its_points_without_measuring(tmp_path, capsys):
    from dcr_ray.cli import main

    r = _run()
    for key in ("fits", "targets", "projection", "superlinear"):
        r.pop(key)
    src, out = tmp_path / "run.json", tmp_path / "again.json"
    src.write_text(json.dumps(r))
    assert main(["bench", "scale", "--from", str(src), "--json", str(out)]) == 0
    again = json.loads(out.read_text())
    assert again["targets"]["refit_time_linear"]["met"] is True and again["projection"]["rows"]
    assert "fitted series:" in capsys.readouterr().out and (tmp_path / "again.png").stat().st_size > 0


def test_the_scale_bench_is_a_bench_subcommand_with_its_options():
    from dcr_ray.cli import build_parser

    a = build_parser().parse_args(["bench", "scale", "--quick", "--json", "x.json", "--sizes", "10M,40M"])
    assert a.quick and a.json == "x.json" and S._sizes(a.sizes) == ("10M", "40M") and not a.no_memory_guard
    with pytest.raises(ValueError):
        S._sizes("10M,7B")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_quick_sweep_measures_every_role_at_every_point_bit_exactly(tmp_path, single_node_ray):
    from dcr_ray.cli import main

    path = tmp_path / "scale.json"  # run as a user runs it: the command line, its JSON read back
    assert main(["bench", "scale", "--quick", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert set(r["points"]) == {"10M/c1/e1", "10M/c1/e2", "10M/c2/e1", "40M/c1/e1"} and not r["skipped"]
    for p in r["points"].values():
        assert p["ok"] and p["bit_exact"], p.get("error")
        assert p["change_rate"] == pytest.approx(0.01, rel=0.05)
        for role in fit.ROLES:  # every role's process was read: CPU, and memory against its start
            assert p["cpu_s"][role]["max"] >= 0 and p["memory"][role]["peak_above_start_max"] is not None
        # every cluster's boundary carried the refit's payloads once, and every engine received them
        assert all(b == p["wire_bytes"] for b in p["links"]["boundary"].values()), p["links"]
        assert len(p["links"]["engines"]) == p["engines"] and p["store"]["created_bytes"] > 0
    assert r["fits"]["refit_s_per_changed_gb"]["fit"] is not None and r["projection"]["rows"]
    assert set(r["targets"]) >= {"owner_memory", "engine_memory", "relay_memory", "coordinator_memory",
                                 "refit_time_linear", "engine_added_cost", "engine_added_cost_derived",
                                 "owners_flat_in_engines"}
    assert (tmp_path / "scale.png").stat().st_size > 0


@pytest.fixture
def single_node_ray():
    """The shared single-node Ray of the test run (:func:`raytools.local_ray`), used only by the slow test."""
    import raytools

    if not raytools.ray.is_initialized() or sum(n["Alive"] for n in raytools.ray.nodes()) != 1:
        raytools.init_local_ray()
    yield
    raytools.sweep_actors()
