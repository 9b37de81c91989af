"""The codec benchmark's pieces: the CLI wiring, the peer encodings, and one measured stress step."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import codec, peers
from benchmarks.codec import default
from dcr_ray.cli import build_parser, main
from dcr_ray.codec import bits_view


def test_the_cli_offers_bench_codec_with_quick_and_json():
    args = build_parser().parse_args(["bench", "codec", "--quick", "--json", "x.json"])
    assert args.quick and args.json == "x.json" and args.func is not None


def test_the_cli_without_a_command_prints_usage_and_fails(capsys):
    assert main([]) == 2
    assert "bench" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(peers.PEERS))
@pytest.mark.parametrize("positions", [
    [], [0], [3, 4, 5, 900], [0, 70_000, 70_001, 200_000, (1 << 20) - 1],
    [0xFFFF + 0x1FFFF, 0xFFFF + 0x1FFFF + 0x2FFFF],  # escaped gaps whose payload words are 0xFFFF
    list(range(0, 1 << 20, 2)),  # past AReaL's dense fallback
])
def test_each_peer_encoding_round_trips_bit_exactly(name, positions):
    n = 1 << 20
    rng = np.random.default_rng(len(positions))
    new = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    old = new.copy()
    pos = np.asarray(positions, np.int64)
    old[pos] ^= rng.integers(1, 1 << 16, len(pos), dtype=np.uint16)
    payloads = peers.encode_all(name, {"t": (pos, new)})
    tgt = {"t": old.copy()}
    peers.apply_all(name, payloads, tgt)
    assert np.array_equal(tgt["t"], new)
    assert peers.wire_bytes(payloads) >= (0 if not len(pos) else 2 * len(pos))


def test_a_stress_step_changes_exactly_the_requested_fraction():
    step = codec.stress_step(1 << 16, 0.03, seed=1)
    (old,), (new,) = step.old.values(), step.new.values()
    changed = np.count_nonzero(old != bits_view(new))
    assert changed == round(0.03 * (1 << 16))


def test_measuring_a_small_stress_step_reports_every_field_and_is_bit_exact():
    acc = codec.Acc()
    codec.measure_step(codec.stress_step(1 << 18, 0.03, seed=2), acc, repeats=1)
    r = codec.case_result("stress-3%", "stress", acc)
    assert r["bit_exact"] and r["peers_bit_exact"]
    assert r["changed"] == round(0.03 * (1 << 18))
    assert 0 < r["per_tensor_bound_bytes"] < r["wire_bytes"] < r["today_wire_bytes"] < r["overwrite_only_bytes"]
    assert r["entropy_bound_bytes"] < r["today_wire_bytes"]  # (context coding may beat the global bound)
    assert set(r["peers"]) == set(peers.PEERS)
    # both codings timed in the same run, the context receiver with and without kept class counts,
    # every repeat's seconds kept
    for k in ("plain_encode", "context_encode", "plain_apply", "context_apply", "context_apply_cold"):
        assert r[f"{k}_gbps"] > 0 and len(r["samples_s"][k]) == 1 and len(r["samples_s"][k][0]) == 1
    r.update(default.library_default(r, 100.0))
    assert r["default_coding"] in ("plain", "context") and r["default_reason"]
    assert r["default_wire_bytes"] == (r["wire_bytes"] if r["default_coding"] == "context" else r["today_wire_bytes"])
    assert r["default_encode_gbps"] == r[f"{r['default_coding']}_encode_gbps"]
    json.dumps(r)  # JSON-able
    table = codec.format_table({"quick": True, "memcpy_gbps": 1.0, "cases": [r], "zstd_sweep": None,
                                "machine": {"codec_threads": 1, "loadavg_start": None},
                                "checks": codec.checks([r]), "elapsed_s": 0.0})
    assert "stress-3%" in table


def _case(wire_plain, wire_context, enc=(4.0, 1.0), app=(10.0, 2.0)):
    """A measured case as bench codec reports it: 1 GB canonical, 10 M changes."""
    return {"changed": 10_000_000, "canonical_bytes": 1e9, "today_wire_bytes": wire_plain, "wire_bytes": wire_context,
            "plain_encode_gbps": enc[0], "context_encode_gbps": enc[1], "plain_apply_gbps": app[0],
            "context_apply_gbps": app[1]}


def test_the_default_columns_are_the_librarys_own_choice_on_the_stated_link():
    case = _case(14e6, 8e6)  # plain: 0.35 s of codec; context: 1.5 s of codec, 43% fewer bytes
    slow = default.library_default(case, 10.0)  # 11.2 s vs 6.4 s on the link: the link bounds the refit
    assert slow["default_coding"] == "context" and slow["default_wire_bytes"] == 8e6
    assert slow["default_over_plain"] == 8e6 / 14e6 and slow["default_encode_gbps"] == 1.0
    assert "the link bounds the refit" in slow["default_reason"]
    fast = default.library_default(case, 1000.0)
    assert fast["default_coding"] == "plain" and fast["default_apply_gbps"] == 10.0
    assert fast["default_by_link"] == {"10": "context", "100": "plain", "1000": "plain", "10000": "plain"}


def test_a_runs_tables_are_rendered_from_its_json_alone_with_every_target_met_or_unmet():
    from benchmarks.markdown import render

    acc = codec.Acc()
    codec.measure_step(codec.stress_step(1 << 16, 0.03, seed=3), acc, repeats=1)
    r = codec.case_result("stress-3%", "stress", acc)
    r.update(default.library_default(r, 100.0))
    result = json.loads(json.dumps({"bench": "codec", "cases": [r], "settings": {"link_mbps": 100.0},
                                    "checks": {**codec.checks([r]), "a target nobody met": {"x": False}},
                                    "git": {"commit": "0123456789abcdef", "dirty": False},
                                    "machine": {"loadavg_start": [0.5], "loadavg_end": [0.7]}, "elapsed_s": 60}))
    md = render(result, "run.json")
    assert md.count("| stress-3% |") == 3  # bytes, throughput, the library default
    assert "| a target nobody met | **unmet**: x |" in md and "| bit_exact | met |" in md
    assert "commit 0123456789" in md and "dcr-ray bench markdown run.json" in md
    with pytest.raises(ValueError, match="not the JSON of dcr-ray bench codec, refit, peers, live, startup or scale"):
        render({"bench": "heal"})
