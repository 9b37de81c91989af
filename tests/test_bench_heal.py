"""``dcr-ray bench heal --quick`` runs end to end: every heal bit-exact, a peer's heal moves nothing across
the cluster link and costs the owners nothing, a lagging engine's heal crosses no more than the deltas it
missed (it replays them from its cluster's catch-up window), and a lost cluster takes the dense model
across the link once, from a peer of another cluster (not the owners), its second engine from the first
(timings are the benchmark's, not asserted here)."""

from __future__ import annotations

import raytools  # noqa: F401

import json

import pytest

from benchmarks import heal
from dcr_ray.cli import main

pytestmark = pytest.mark.slow


def test_the_heal_benchmark_heals_every_case_exactly_and_inside_the_cluster_where_a_peer_is_left(tmp_path):
    path = tmp_path / "heal.json"  # run as a user runs it: the command line, its JSON read back
    assert main(["bench", "heal", "--quick", "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    cases = out["cases"]
    assert all(c["bit_exact"] for c in cases.values())
    rp, lag, lost = cases["recreated_with_peer"], cases["lagging_3_versions"], cases["whole_cluster_lost"]
    # the copy comes from the peer; a refit that commits while it lands is then caught up by its delta (or
    # by another copy, where the delta outweighs the model)
    assert [(h["engine"], h["sources"][0]) for h in rp["heals"]] == [("a/e1", "a/e0")]
    assert set(rp["heals"][0]["sources"][1:]) <= {"window", "a/e0"}
    assert rp["cross_cluster_bytes"] == 0 and rp["owner_bytes"] == 0 and rp["copy_bytes"] > 0
    assert lag["missed_versions"] == 3 and lag["cross_cluster_bytes"] <= 1.05 * lag["union_delta_bytes"]
    # the missed deltas replayed from the window, or the peer's dense copy where those deltas outweigh the
    # model (this benchmark's learning rate changes most elements every step)
    assert lag["heals"][0]["sources"][0] in ("window", "a/e0") and lag["owner_bytes"] == 0
    # the lost cluster's first engine copies from cluster a (across the link once, not from the owners)
    assert [(h["engine"], h["sources"][0]) for h in lost["heals"]] == [("b/e0", "a/e0"), ("b/e1", "b/e0")]
    assert lost["owner_bytes"] == 0 and lost["cross_cluster_bytes"] == lost["heals"][0]["cross_bytes"] > 0
    text = heal.format_table(out)
    assert "recreated_with_peer" in text and "targets:" in text
    # real node faults: one retry for a node lost mid-refit; a lost cluster commits for the other, which
    # serves, and heals from it (one crossing) when a node joins; everything exact (timings: the benchmark's)
    nd, cl = out["node_cases"]["node_death_mid_refit"], out["node_cases"]["cluster_lost"]
    assert nd["attempts"] <= 2 and nd["required"] == 4 and nd["bit_exact"], nd
    assert cl["next_refit_attempts"] == 1 and cl["survivors_served"] and cl["waiting_for_capacity"] == ["b"], cl
    assert cl["cross_copies"] == 1 and cl["bit_exact"], cl
    assert "node_death_mid_refit" in text and "| node dies mid-refit |" in heal.markdown(out)
    assert (tmp_path / "heal.png").stat().st_size > 0  # the command wrote its plot beside the JSON
