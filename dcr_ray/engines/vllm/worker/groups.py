"""Fused-group reload: which checkpoint tensors a reload must carry together, and the post-load steps
vLLM's ``reload_weights`` leaves out.

vLLM's CPU backend repacks Linear weights for its GEMM kernels after loading, so its parameters are not
bit-addressable. The backend keeps the canonical tensors in host memory, applies frames there, and
pushes the touched tensors through vLLM's in-place ``reload_weights`` — the model's own loader and
post-processing. ``reload_weights`` processes a vLLM *module* once all its weights arrived, so a push
must carry every checkpoint tensor that module loads: all of q/k/v (weights and biases) of a fused
``qkv_proj``, gate and up of a ``gate_up_proj``. A push of only part of a module would make vLLM
process it with uninitialized elements (on vLLM 0.32 that gives wrong outputs that later full reloads
do not repair), so :func:`fused_groups` derives the groups from the model itself — its
``hf_to_vllm_mapper`` (checkpoint name -> vLLM parameter name) and ``packed_modules_mapping`` (fused
module -> its checkpoint parts) — with no per-model rules here. Names it cannot resolve join a group
with every tensor (a full dense reload: slow but exact).

A reload must equal a fresh load, so after it the worker runs what a fresh start runs and the reload
skips: :func:`reprocess_moe_experts` (the fused-experts post-load step) and :func:`reprocess_aliases`
(modules that only *alias* a reloaded parameter, e.g. a tied ``lm_head``). The backend proves the
result per model at start-up by comparing :func:`~dcr_ray.engines.vllm.worker.served.served_fingerprint`
before and after a reload of the checkpoint's own bits.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable

import torch

from dcr_ray.engines.vllm.worker.storage import storage_key

#: vLLM loggers whose per-layer warnings are expected when only some modules are reloaded on purpose.
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")

_IGNORED = object()


def _map_hf_name(model: torch.nn.Module, name: str):
    """The vLLM parameter name ``name`` loads into (``_IGNORED`` when the model's mapper drops it)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        fn = getattr(mapper, "map_name", None) or getattr(mapper, "_map_name", None)
        if fn is not None:
            mapped = fn(name)
            if mapped is None:
                return _IGNORED
            name = mapped
    packed = getattr(model, "packed_modules_mapping", None) or {}
    part_to_fused = {part: fused for fused, parts in packed.items() for part in parts}
    mod, _, leaf = name.rpartition(".")
    pieces = mod.split(".")
    if pieces and pieces[-1] in part_to_fused:
        pieces[-1] = part_to_fused[pieces[-1]]
    return ".".join(pieces) + "." + leaf if mod else name


def fused_groups(model: torch.nn.Module, names: Iterable[str]) -> dict[str, Any]:
    """Group checkpoint ``names`` by the vLLM module that loads them.

    Returns ``{"groups": [[name, ...], ...], "ignored": [...], "unresolved": [...]}``: each group holds
    every given checkpoint tensor of one vLLM module (a reload must carry whole groups); ``ignored``
    names are dropped by the model's own name mapper (its loader never reads them); ``unresolved``
    names map to no module of the model and were put into one group with *all* names.
    """
    names = list(names)
    by_module: dict[str, list[str]] = {}
    ignored, unresolved = [], []
    for n in names:
        mapped = _map_hf_name(model, n)
        if mapped is _IGNORED:
            ignored.append(n)
            continue
        mod = loading_module(model, mapped)
        if mod is None:
            unresolved.append(n)
            continue
        by_module.setdefault(mod, []).append(n)
    groups = list(by_module.values())
    if unresolved:
        groups = [[n for n in names if n not in set(ignored)]]
    return {"groups": groups, "ignored": ignored, "unresolved": unresolved}


def whole_groups(names: Iterable[str], groups: list[list[str]], group_of: dict[str, int],
                 order: Iterable[str]) -> list[str]:
    """``names`` grown to the whole fused groups they belong to (``group_of``: name -> index into
    ``groups``), listed in ``order`` (checkpoint order); names in no group (ignored by the loader) drop
    out. A reload must carry whole groups: a fused module is rebuilt from all its checkpoint tensors."""
    want: set[str] = set()
    for n in names:
        if n in group_of:
            want.update(groups[group_of[n]])
    return [n for n in order if n in want]


def _is_moe_layer(module: torch.nn.Module) -> bool:
    """A vLLM fused-experts layer: it holds the expert weights itself and its quant method is a
    ``FusedMoEMethodBase`` (the one with a ``moe_kernel``)."""
    qm = module.__dict__.get("quant_method") or module._modules.get("quant_method")
    return qm is not None and hasattr(qm, "moe_kernel") and next(module.parameters(recurse=False), None) is not None


def loading_module(model: torch.nn.Module, vllm_name: str) -> str | None:
    """The path of the module that loads the vLLM parameter ``vllm_name`` (None: no such module).

    Usually the name's parent. Expert weights are the exception: a checkpoint's
    ``mlp.experts.3.gate_proj.weight`` loads into slices of the one fused-experts layer below
    ``mlp.experts`` (its ``w13_weight``), so a path that resolves no module is walked up to the
    nearest ancestor that holds exactly one fused-experts layer, and resolves to that layer.
    """
    pieces = vllm_name.split(".")[:-1]
    for end in range(len(pieces), -1, -1):
        path = ".".join(pieces[:end])
        try:
            module = model.get_submodule(path) if path else model
        except AttributeError:
            continue
        if end == len(pieces):
            return path
        moe = [sub for sub, m in module.named_modules() if _is_moe_layer(m)]
        if len(moe) != 1:
            return None
        return ".".join(p for p in (path, moe[0]) if p)
    return None


def reloaded_modules(model: torch.nn.Module, names: Iterable[str]) -> set[str]:
    """Paths of the modules a reload of checkpoint ``names`` loads into (mapper-ignored names skipped;
    a name no module resolves counts as its parameter's parent path)."""
    modules = set()
    for name in names:
        mapped = _map_hf_name(model, name)
        if mapped is not _IGNORED:
            mod = loading_module(model, mapped)
            modules.add(mapped.rpartition(".")[0] if mod is None else mod)
    return modules


def reprocess_moe_experts(model: torch.nn.Module, loaded_modules: set[str]) -> list[str]:
    """Finish the post-load processing vLLM skips for fused-experts layers on a weight *update*.

    vLLM's unquantized fused-MoE method runs its experts' ``process_weights_after_loading`` (on CPU:
    the prepack into the grouped-GEMM layout) on the first load only; on a reload it copies the
    freshly loaded, unprocessed bits into the processed storage. Running that step now, on each
    reloaded fused-experts layer, gives exactly what a fresh load gives. The start-up self-check of
    :class:`~dcr_ray.engines.vllm.worker.receiver.MirrorReceiver` proves it per model, so a vLLM that stops skipping it
    (and would then be processed twice) is refused before it serves.
    """
    done = []
    for path in sorted(loaded_modules):
        try:
            layer = model.get_submodule(path) if path else model
        except AttributeError:
            continue
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and callable(getattr(experts, "process_weights_after_loading", None)):
            experts.process_weights_after_loading(layer)
            done.append(path)
    return done


def reprocess_aliases(model: torch.nn.Module, loaded_modules: set[str]) -> list[str]:
    """Re-run the post-load processing of modules that share a parameter with a reloaded module.

    vLLM's reload does not process a module that only *aliases* a reloaded parameter (tied
    embeddings: ``lm_head`` shares ``embed_tokens.weight`` and no checkpoint name loads it), so its
    kernel-format state (on CPU the packed GEMM weight) would keep the old values; a fresh start
    processes it after loading. Only modules whose own parameter still aliases freshly loaded
    (model-format) storage qualify, so the processing sees exactly what it saw at start-up. Returns
    the modules processed.
    """
    fresh = set()
    for path in loaded_modules:
        try:
            mod = model.get_submodule(path) if path else model
        except AttributeError:
            continue
        for p in mod.parameters(recurse=False):
            k = storage_key(p)
            if k is not None:
                fresh.add(k)
    done = []
    for path, mod in model.named_modules():
        if path in loaded_modules:
            continue
        qm = getattr(mod, "quant_method", None)
        if qm is None or not callable(getattr(qm, "process_weights_after_loading", None)):
            continue
        if any(storage_key(p) in fresh for p in mod.parameters(recurse=False)):
            qm.process_weights_after_loading(mod)
            if hasattr(mod, "update_param_tp_status"):
                mod.update_param_tp_status()
            done.append(path)
    return done


def reload_groups(model: torch.nn.Module, vllm_config: Any, items: Iterable[tuple[str, torch.Tensor]],
                  names: list[str] | None = None) -> dict[str, Any]:
    """Push whole fused groups of checkpoint tensors through vLLM's in-place reload, then run the
    post-load steps a fresh load runs and the reload skips (fused experts, aliasing modules).

    ``items`` must hold every checkpoint tensor of each module they touch (see :func:`fused_groups`);
    given their ``names`` beforehand, they may be a generator (read one at a time, as the loader takes them).
    Returns ``{"tensors": n, "reprocessed": [module paths]}``.
    """
    from vllm.config import set_current_vllm_config

    from dcr_ray.engines.vllm.compat import reload_weights

    if names is None:
        items = list(items)
        names = [name for name, _ in items]
    modules = reloaded_modules(model, names)
    with set_current_vllm_config(vllm_config):
        with quiet_partial_reload():
            reload_weights(vllm_config, model, items)
        experts = reprocess_moe_experts(model, modules)
        again = reprocess_aliases(model, modules)
    return {"tensors": len(names), "reprocessed": again + experts}


@contextlib.contextmanager
def quiet_partial_reload():
    """Silence vLLM's per-layer "Failed to load weights" warnings while reloading chosen modules only."""
    saved = []
    for name in _RELOAD_LOGGERS:
        lg = logging.getLogger(name)
        saved.append((lg, lg.level))
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in saved:
            lg.setLevel(level)
