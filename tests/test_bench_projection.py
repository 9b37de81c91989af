"""The projection benchmark's pieces: CLI wiring, a quick run whose cases are bit-exact and complete."""

from __future__ import annotations

import json

from benchmarks import projection
from dcr_ray.cli import build_parser

FIELDS = {"name", "layout", "change_rate", "direct_fraction", "projection_seconds", "gather_seconds", "speedup",
          "owner_peak_bytes", "shard_bytes", "bit_exact"}


def test_the_cli_offers_bench_projection_with_quick_and_json():
    args = build_parser().parse_args(["bench", "projection", "--quick", "--json", "x.json"])
    assert args.quick and args.json == "x.json" and args.func is not None


def test_a_quick_run_is_bit_exact_reports_every_field_and_writes_json_and_a_plot(tmp_path):
    r = projection.run(quick=True, repeats=1, rates=(0.03,))
    assert [c["name"] for c in r["cases"]] == ["dense 3%", "moe 3%"]
    for c in r["cases"]:
        assert FIELDS <= set(c)
        assert c["bit_exact"] is True
        assert c["direct_fraction"] >= 0.98 and c["owner_peak_bytes"] > 2 * c["shard_bytes"] > 0
        assert c["projection_seconds"] > 0 and c["gather_seconds"] > 0
    assert r["targets"]["bit_exact everywhere"] and r["targets"]["direct_fraction >= 0.98 (moe)"]
    table = projection.format_table(r)
    assert "dense 3%" in table and "bit_exact everywhere" in table and "met" in table
    path = tmp_path / "p.json"
    path.write_text(json.dumps(r))
    projection.plot(r, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
