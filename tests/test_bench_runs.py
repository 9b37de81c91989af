"""Each ``dcr-ray bench`` command runs end to end from the command line and writes its JSON.

The benchmarks are what users run first to judge the system, so a run that crashes is a bug even when
every library test passes. Each test here goes through ``dcr_ray.cli.main`` with the benchmark's quick
settings on the tiny model, for every transport it offers (``bench refit``: the relay tree and object
storage, each behind an emulated link), and reads back the JSON it wrote. ``bench live``, ``bench heal``
and ``bench peers`` run the same way in their own test modules (``test_bench_live.py``,
``test_bench_heal.py``, ``test_bench_peers.py``), whose assertions read the JSON those runs wrote.
"""

from __future__ import annotations

from raytools import local_ray  # noqa: F401  (loopback environment before ray is imported; module-scoped Ray fixture)

import json

import pytest

from dcr_ray.cli import main

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("transport", ["relay", "object_store"])
def test_bench_refit_quick_runs_on_the_tiny_model_over_each_transport_behind_an_emulated_link(
        transport, tmp_path, local_ray):
    out = tmp_path / "refit.json"
    rc = main(["bench", "refit", "--quick", "--size", "tiny", "--transports", transport, "--cases", "stress,adamw",
               "--rates", "3", "--no-sweep", "--no-codings", "--link-mbps", "200", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert {c["transport"] for c in result["cases"]} == {transport}
    assert {c["case"].split("-")[0] for c in result["cases"]} == {"stress", "adamw"}
    for c in result["cases"]:
        assert c["bit_exact"] and c["link_mbps"] == 200 and c["wire_bytes"] > 0, c["name"]
        assert c["lower_bound_s"] > c["latency_s"], c["name"]  # the payloads paid the emulated link


def test_bench_codec_quick_runs_and_writes_its_json(tmp_path):
    out = tmp_path / "codec.json"
    assert main(["bench", "codec", "--quick", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["bench"] == "codec" and result["cases"]
    assert (tmp_path / "codec.png").stat().st_size > 0


def test_bench_startup_runs_both_worker_starts_and_writes_its_json(tmp_path):
    out = tmp_path / "startup.json"
    assert main(["bench", "startup", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"ordinary", "prefork"}
    for mode, run in result["runs"].items():
        assert run["topology_up_s"] > 0 and len(run["refit_s"]) == 5, mode
    # started the ordinary way, the relays hold no model and load neither torch nor transformers; engines do
    imports = result["runs"]["ordinary"]["imports"]
    assert not {"torch", "transformers"} & set(imports["relays"]), imports
    assert {"torch", "transformers"} <= set(imports["engines"]), imports
    # and an earlier run given with --before is reported beside this one's ordinary topology (from the JSON alone:
    # what --before adds to a run, without starting a third topology)
    from benchmarks.startup import markdown, targets

    later = {**result, "before": {**{k: result[k] for k in ("git", "loadavg_start", "loadavg_end")},
                                  "ordinary": result["runs"]["ordinary"]}}
    assert any(t["target"].startswith("(reported) ordinary topology up, before") and t["value"] == 1.0
               for t in targets(later))
    assert "| ordinary topology | before | after |" in markdown(later)
