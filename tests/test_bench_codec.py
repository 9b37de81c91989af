"""The codec benchmark's pieces: the CLI wiring, the peer encodings, and one measured stress step."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dcr_ray.bench import codec, peers
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
    json.dumps(r)  # JSON-able
    table = codec.format_table({"quick": True, "memcpy_gbps": 1.0, "cases": [r], "zstd_sweep": None,
                                "machine": {"codec_threads": 1, "loadavg_start": None},
                                "checks": codec.checks([r]), "elapsed_s": 0.0})
    assert "stress-3%" in table
