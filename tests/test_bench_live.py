"""``dcr-ray bench live`` on the tiny model: every method on HF engines that serve a closed loop of
requests while the trainer takes real AdamW steps, in place and staged; the JSON's fields, the targets'
verdicts, the table and the PNG. Speed is the benchmark's business: this checks the measurement runs and
reports what the issue asks, and that every engine ends bit-exact."""

from __future__ import annotations

import json

import pytest

from raytools import local_ray  # noqa: F401  (loopback environment before ray is imported; module-scoped Ray fixture)

from dcr_ray.cli import build_parser, main

CASE_FIELDS = ("method", "mode", "receiver", "data", "size", "pause_seconds", "trainer_stall_seconds",
               "construct_seconds", "freshness_seconds", "refit_seconds", "tokens_per_second_quiet",
               "tokens_per_second_refit", "bit_exact", "samples")


def test_the_cli_offers_bench_live_with_its_sizes_and_json():
    args = build_parser().parse_args(["bench", "live", "--quick", "--json", "x.json"])
    assert args.quick and args.json == "x.json" and args.func is not None
    from benchmarks.live.settings import LiveSettings

    s = LiveSettings.from_args(args)
    assert (s.size, s.vllm_size, s.refits) == ("small", "small", 2)
    s = LiveSettings.from_args(build_parser().parse_args(["bench", "live", "--size", "tiny"]))
    assert (s.size, s.vllm_size) == ("tiny", "tiny")
    s = LiveSettings.from_args(build_parser().parse_args(["bench", "live"]))
    assert (s.size, s.vllm_size) == ("medium", "small")  # two medium vLLM CPU engines do not fit 24 GiB


@pytest.mark.slow
def test_the_tiny_live_bench_measures_every_method_on_serving_hf_engines_and_ends_bit_exact(tmp_path, local_ray):
    from benchmarks import markdown

    path = tmp_path / "bench_live.json"  # run as a user runs it: the command line, its JSON read back
    assert main(["bench", "live", "--quick", "--size", "tiny", "--refits", "1", "--receivers", "hf", "--data",
                 "adamw", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    got = [(c["method"], c["mode"]) for c in result["cases"]]
    assert got == [("dcr", "in_place"), ("dense_sync", "n/a"), ("fetch_reload", "n/a"), ("dcr", "staged")]
    for c in result["cases"]:
        assert all(k in c for k in CASE_FIELDS), c["method"]
        assert c["bit_exact"] and c["size"] == "tiny" and len(c["samples"]) == 1
        assert c["refit_seconds"] > 0 and c["tokens_per_second_quiet"] > 0
        # every engine paused (a refit that never paused its engines did not reach them) and served again
        assert c["pause_seconds"] > 0 and c["samples"][0]["pauses"]
    names = [t["target"] for t in result["targets"]]
    assert "HF staged pause <= 0.1x dense sync's (adamw)" in names
    assert "HF staged pause <= 0.5x fetch-then-reload's (adamw)" in names
    assert all(isinstance(t["met"], bool) for t in result["targets"])
    assert result["bench"] == "live" and result["git"]["commit"]
    assert (tmp_path / "bench_live.png").stat().st_size > 1000
    md = markdown.render(result, str(path))
    assert "| hf | tiny | adamw | dcr | staged |" in md and "HF staged pause <= 0.1x dense sync's" in md
