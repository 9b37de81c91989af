"""What the peers' ways run inside an engine actor (``engine.__ray_call__.remote(fn, ...)``), through the
engine's own loader, under the engine's own pause (:meth:`~dcr_ray.actors.engine.actor.EngineActor.hold` / ``release``: the
clock that times dcr_ray's pauses), draining or in flight as the peer pauses (:mod:`.peers`).

The engine's own loader (:func:`load_tensors`):

- ``transformers``: the model's ``load_state_dict`` (every tensor copied into its parameter);
- vLLM: vLLM's own in-place reload of the whole model (``Worker.reload_weights``: its layerwise reload
  around the model's ``load_weights``, which repacks the CPU kernels' weights), then its prefix cache
  reset. That is what a dense NCCL broadcast's receiver and SkyRL's receiver run.

SkyRL's receiver (:func:`skyrl_start`, :func:`skyrl_fetch`, :func:`skyrl_reload`) runs where SkyRL runs it:
in a vLLM engine, its own ``DeltaWeightTransferEngine`` in the worker (``fetch_weights`` while serving,
then ``start_weight_update`` / ``receive_weights`` / ``finish_weight_update`` in the pause); in a
``transformers`` engine, its ``LocalCheckpointStore`` in the engine actor, reloaded into
``load_state_dict``.

:func:`exact` checks what the engine serves: a ``transformers`` engine's parameters against the trainer's
bits on integer views; a vLLM engine's served fingerprint (every parameter and each linear kernel's output
on a probe: :func:`dcr_ray.engines.vllm.serving.served_digests`) against the fingerprint after a dense
load of the trainer's bits through dcr_ray's own vLLM path.
"""

from __future__ import annotations

import os
import time


def _is_vllm(backend) -> bool:
    return hasattr(backend, "llm")


def _state(refs: list) -> dict:
    import ray

    state = {}
    for part in ray.get(list(refs)):
        state.update(part)
    return state


def _worker_reload(worker, items: list) -> None:
    worker.reload_weights(weights_iterator=items)


def load_tensors(engine, tensors: dict) -> None:
    """(Run in an engine actor, under a hold.) Every tensor through the engine's own loader (module doc)."""
    b = engine.backend
    if _is_vllm(b):
        with b.step_lock:
            b.llm.collective_rpc(_worker_reload, args=(list(tensors.items()),))
            b.llm.reset_prefix_cache()
        return
    res = b.model.load_state_dict(dict(tensors), strict=False)
    if res.unexpected_keys:
        raise ValueError(f"the model has no parameters named {res.unexpected_keys[:5]}")


def hold(engine, label: str, switch: str = "drain") -> None:
    engine.hold(label, switch)


def release(engine, label: str) -> None:
    engine.release(label)


def pull_and_load(engine, refs: list) -> None:
    """(Run in an engine actor, under a hold.) The trainer's tensors from the object store into the loader."""
    load_tensors(engine, _state(refs))


def write_checkpoint(engine, refs: list, directory: str) -> None:
    """(Run in an engine actor, while it serves.) The trainer's tensors as a local safetensors checkpoint."""
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in _state(refs).items()}, os.path.join(directory, "model.safetensors"))


def reload_checkpoint(engine, directory: str, label: str) -> None:
    """(Run in an engine actor.) Drain, load the local checkpoint through the engine's loader, resume."""
    from safetensors.torch import load_file

    hold(engine, label, "drain")
    try:
        load_tensors(engine, load_file(os.path.join(directory, "model.safetensors")))
    finally:
        release(engine, label)


# -- SkyRL's receiver --------------------------------------------------------------------------------
def skyrl_start(engine, base: str, local: str, prefer_own: bool = True) -> str:
    """(Run in an engine actor.) SkyRL's receiver over the base checkpoint, its local checkpoint in ``local``."""
    from benchmarks.peers import skyrl_code, skyrl_vllm

    b = engine.backend
    if _is_vllm(b):
        with b.step_lock:
            return b.llm.collective_rpc(skyrl_vllm.worker_start, args=(base, local, prefer_own))[0]
    code = skyrl_code.load(prefer_own=prefer_own)
    engine._bench_skyrl = code.Store(base, local)
    return code.peer_code


def skyrl_fetch(engine, version: int, sync_dir: str) -> float:
    """(Run in an engine actor, while it serves.) SkyRL's fetch of ``version``: the delta into its cache,
    XORed into the local checkpoint, re-hashed. Returns its seconds."""
    from benchmarks.peers import skyrl_vllm

    t = time.perf_counter()
    b = engine.backend
    if _is_vllm(b):
        b.llm.collective_rpc(skyrl_vllm.worker_fetch, args=(version, sync_dir))
    else:
        engine._bench_skyrl.fetch(version, sync_dir=sync_dir)
    return time.perf_counter() - t


def skyrl_reload(engine, version: int, label: str = "skyrl_delta") -> None:
    """(Run in an engine actor.) SkyRL's pause, in keep mode (the running requests held at a step boundary,
    not drained): every tensor of its local checkpoint through the loader, then the same requests resume."""
    from benchmarks.peers import skyrl_vllm

    b = engine.backend
    hold(engine, label, "in_flight")
    try:
        if _is_vllm(b):
            with b.step_lock:
                b.llm.collective_rpc(skyrl_vllm.worker_reload, args=(version,))
                b.llm.reset_prefix_cache()
        else:
            store = engine._bench_skyrl
            store.validate_ready(version)
            load_tensors(engine, dict(store.iter_tensors()))
    finally:
        release(engine, label)


# -- what it serves ----------------------------------------------------------------------------------
def exact(engine, refs: list) -> bool:
    """(Run in an engine actor, between refits.) Whether the engine serves exactly the trainer's bits (module doc)."""
    import torch

    state = _state(refs)
    b = engine.backend
    if _is_vllm(b):
        from dcr_ray.engines.vllm.serving import served_digests

        hold(engine, "bench_check", "in_flight")  # nothing decodes while the reference loads
        try:
            with b.step_lock:
                got = served_digests(b.llm)
                b.load_dense(state.items())
                return got == served_digests(b.llm)
        finally:
            release(engine, "bench_check")
    held = b.tensors()
    return sorted(held) == sorted(state) and all(
        torch.equal(held[n].view(torch.int16), t.view(torch.int16)) for n, t in state.items())
