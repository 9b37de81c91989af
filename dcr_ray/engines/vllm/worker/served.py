"""What a vLLM worker serves: a fingerprint that sees packed kernel state, and a snapshot that puts it back.

Parameters and buffers are not all a vLLM worker serves with. On CPU, vLLM's linear layers hand their
weights to a packed GEMM (oneDNN or a packed copy) held in a closure (``layer.cpu_linear``), and leave
an empty ``weight`` parameter behind; a digest of parameters alone cannot see those weights. So:

:func:`served_fingerprint`
    The digest of every parameter and buffer (integer views) *and*, for every linear or LM-head layer,
    the digest of what the layer's own kernel computes on a fixed probe input (``quant_method.apply``,
    local to the rank, no collective). Same weights through the same kernel give the same bits, so two
    fingerprints are equal exactly when the worker serves the same thing, as far as any layer shows.
:class:`ServedSnapshot`
    Everything a reload may rebind or overwrite, kept before a check that must reload (the start-up
    self-check feeds the checkpoint's bits through the reload path): each module's attributes (the
    packed-kernel closures among them), its parameter/buffer/submodule tables, and the bits and storage
    binding of every parameter and buffer. :meth:`ServedSnapshot.restore` puts all of it back; the
    caller proves the result with :func:`served_fingerprint` before saying "nothing changed".

Memory: the snapshot holds one host copy of the worker's parameters and buffers until it is dropped
(the start-up check drops it on return), besides the packed state the reload replaced.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from dcr_ray.engines.vllm.worker.storage import storage_digests

#: Rows of the probe input each linear layer computes on (a few rows reach every packed column block).
PROBE_ROWS = 3
_CONTAINERS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def _probe_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, int]]:
    """``(path, layer, input width)`` of every layer whose served weights may live outside its parameters:
    vLLM's linear layers and (tied or not) LM heads."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    out = []
    for path, mod in model.named_modules():
        if isinstance(mod, LinearBase):
            width = getattr(mod, "input_size_per_partition", None) or getattr(mod, "input_size", None)
        elif isinstance(mod, ParallelLMHead):
            width = getattr(mod, "embedding_dim", None)
        else:
            continue
        if getattr(mod, "quant_method", None) is not None and width:
            out.append((path, mod, int(width)))
    return out


@torch.no_grad()
def probe_digests(model: torch.nn.Module) -> dict[str, str]:
    """``"probe:<layer path>"`` -> digest of the layer's kernel output on a fixed input (seeded by the
    layer's path, in the layer's parameter dtype). A kernel that raises is recorded by its error type,
    so it still compares."""
    out = {}
    for path, mod, width in _probe_layers(model):
        dtype = getattr(mod, "params_dtype", None) or torch.get_default_dtype()
        device = next((p.device for p in mod.parameters(recurse=False)), torch.device("cpu"))
        seed = int.from_bytes(hashlib.blake2b(path.encode(), digest_size=4).digest(), "little")
        x = torch.randn(PROBE_ROWS, width, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)
        h = hashlib.blake2b(digest_size=16)
        try:
            y = mod.quant_method.apply(mod, x, None)
            y = (y[0] if isinstance(y, tuple) else y).detach().contiguous().cpu()
            h.update(f"{y.dtype}{tuple(y.shape)}".encode())
            h.update(y.view(torch.uint8).numpy().tobytes())
        except Exception as e:  # noqa: BLE001 - a layer that cannot compute alone still compares by its error
            h.update(f"error:{type(e).__name__}".encode())
        out[f"probe:{path}"] = h.hexdigest()
    return out


def served_fingerprint(model: torch.nn.Module) -> dict[str, str]:
    """Digests of every parameter and buffer and of every linear layer's probe output (see the module
    docstring): equal fingerprints mean the worker serves the same bits."""
    return {**storage_digests(model), **probe_digests(model)}


class ServedSnapshot:
    """The state a reload may change, kept so :meth:`restore` can put it back exactly (see the module
    docstring). Take it right before the reload; drop it when no longer needed."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._modules: list[tuple[torch.nn.Module, dict[str, Any], dict[str, Any]]] = []
        self._tensors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        seen: set[int] = set()
        for mod in model.modules():
            attrs = {k: v for k, v in mod.__dict__.items() if k not in _CONTAINERS}
            tables = {k: (set(v) if isinstance(v, set) else dict(v)) for k, v in mod.__dict__.items()
                      if k in _CONTAINERS}
            self._modules.append((mod, attrs, tables))
            for t in list(mod._parameters.values()) + list(mod._buffers.values()):
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                data = t.data  # the storage it is bound to now (a reload may rebind it)
                self._tensors.append((t, data, data.detach().to("cpu", copy=True)))

    @torch.no_grad()
    def restore(self) -> None:
        """Every module's attributes and tables as they were, every parameter and buffer bound to its
        storage again and holding its bits again."""
        for mod, attrs, tables in self._modules:
            for k in [k for k in mod.__dict__ if k not in _CONTAINERS and k not in attrs]:
                del mod.__dict__[k]
            mod.__dict__.update(attrs)
            for k, saved in tables.items():
                live = mod.__dict__.get(k)
                if live is None:
                    mod.__dict__[k] = type(saved)(saved)
                else:
                    live.clear()
                    live.update(saved)
        for t, data, bits in self._tensors:
            if t.data.data_ptr() != data.data_ptr() or t.data.shape != data.shape or t.data.dtype != data.dtype:
                t.data = data
            _copy_bits(data, bits)


def _copy_bits(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.numel() == 0:
        return
    if dst.dtype == torch.bool or dst.element_size() not in (1, 2, 4, 8):
        dst.copy_(src.to(dst.device))
        return
    from dcr_ray.engines.vllm.worker.storage import int_view

    int_view(dst).copy_(int_view(src).to(dst.device))
