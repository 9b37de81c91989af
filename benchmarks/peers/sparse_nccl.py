"""vLLM 0.32 ``sparse_nccl``: per changed element an int32 flat index and the value in the parameter's dtype,
uncompressed, broadcast over NCCL after the names, dtypes, shapes and counts went by RPC.

NCCL does not run on CPU, so the wire bytes are counted from that format (``peer_code="format"``); the
message here carries the same streams behind the bench's per-tensor header. The apply is vLLM's own:
the receiver gathers every tensor's patch, as its ``receive_weights`` does, and hands them to
``vllm.model_executor.model_loader.checkpoint_weight_patch.load_checkpoint_weight_patches`` with the
engine's loader as ``model.load_weights`` (it validates NaN values, index bounds and duplicates of all
patches before it loads any, builds a NaN-filled checkpoint-shaped tensor per patch, and masks
``Tensor.copy_``). vLLM computes no diff: the sender's positions and values come from the bench (numpy).
"""

from __future__ import annotations

import numpy as np

from benchmarks.peers.container import unpack


def encode(old: np.ndarray, new: np.ndarray) -> bytes | None:
    """int32 flat indices then the new values' bits, or None when no bit changed."""
    pos = np.flatnonzero(np.bitwise_xor(old, new))
    if not len(pos):
        return None
    return pos.astype("<i4").tobytes() + new[pos].tobytes()


def patches(message: bytes, params: dict) -> list:
    """Every tensor's ``CheckpointWeightPatch``, gathered before any is applied (vLLM receives all first)."""
    import torch
    from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch

    out = []
    for name, numel, stream in unpack(message):
        p = params[name]
        w = p.element_size()
        if len(stream) % (4 + w) or numel != p.numel():
            raise ValueError(f"{name}: a patch of {len(stream)} bytes for {numel} elements does not fit the format")
        n = len(stream) // (4 + w)
        idx = torch.from_numpy(np.frombuffer(stream[:4 * n], "<i4").copy())
        vals = torch.from_numpy(np.frombuffer(stream[4 * n:], f"<i{w}").copy()).view(p.dtype)
        out.append(CheckpointWeightPatch(name=name, shape=tuple(p.shape), dtype=p.dtype, values=vals, indices=idx))
    return out


def apply(message: bytes, engine) -> None:
    """vLLM's apply of the message's patches through the engine's loader."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import load_checkpoint_weight_patches

    load_checkpoint_weight_patches(engine, patches(message, engine.params))
