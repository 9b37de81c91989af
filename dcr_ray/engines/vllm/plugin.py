"""vLLM plugin (entry point ``vllm.general_plugins`` -> ``dcr``): registers the ``dcr`` weight-transfer
backend and the ``dcr_unpacked`` load format (vLLM-CPU with its weights left unpacked,
:mod:`~dcr_ray.engines.vllm.worker.unpacked`) in every vLLM process, engine core and tensor-parallel
workers included, and gives vLLM's
workers the method ``dcr_transfer_status`` that the driver reads each call's outcome with
(``collective_rpc("dcr_transfer_status", args=(nonce,))``; see :mod:`~dcr_ray.engines.vllm.worker.transfer`).

It also registers the trainer side, :class:`~dcr_ray.integrations.vllm.trainer.DcrTrainerWeightTransferEngine`,
in vLLM's ``WeightTransferTrainerFactory`` (so a vLLM-style trainer can say ``backend="dcr"``), and
teaches vLLM's ``HTTPVLLMWeightSyncClient`` to send ``update_info["frames"]`` (bytes, which JSON cannot
carry) as the ``frames_b64`` strings the backend reads. A trainer process that never starts a vLLM
engine gets all three by importing :mod:`dcr_ray.integrations.vllm.trainer` (or by calling
``vllm.plugins.load_general_plugins()``).

It also runs :func:`~dcr_ray.engines.vllm.compat.prepare_cpu_process` in each of those processes: the
llvmlite shim (a Ray worker forked by :mod:`dcr_ray.prefork` has numba loaded before vLLM starts) and
torch's AMX initialisation. Ray runs a ``worker_process_setup_hook`` given in a job's ``runtime_env`` only,
never one given to a single actor, and an ``AsyncLLM`` in a Ray actor (OpenRLHF's rollout actor, for one)
has vLLM *spawn* its engine core as a fresh process: a plugin is the one place that reaches them all.
vLLM runs plugins once per process, so :func:`~dcr_ray.engines.vllm.compat.start_llm` still applies the
llvmlite shim before each engine it starts (numba may have loaded since).
Without AMX permission, an AMX kernel that does not ask for it (vLLM's CPU attention picks AMX from the
CPU's flags alone) kills the process with SIGILL, and the actor sees only ``EngineDeadError``. oneDNN asks
for the permission itself when it first uses AMX, so without the plugin the death depends on which kernel
runs first.

vLLM loads general plugins only when ``VLLM_PLUGINS`` is unset or names them (``VLLM_PLUGINS=dcr``).

On a vLLM release outside :data:`~dcr_ray.engines.vllm.compat.SUPPORTED_VLLM` the plugin logs one warning and
changes nothing in vLLM but one name: vLLM calls every installed plugin unguarded in every process, so a raise
here would stop every vLLM process of the environment, those that never ask for ``dcr`` included. Backend
``dcr`` is then a stand-in (:mod:`~dcr_ray.engines.vllm.unsupported`) that raises
:class:`~dcr_ray.errors.UnsupportedRuntimeError`, naming the supported range, when someone asks for it
(``weight_transfer_config={"backend": "dcr"}``, on either side); starting an engine through dcr_ray raises the
same (:func:`~dcr_ray.engines.vllm.compat.start_llm`).
"""

from __future__ import annotations

import base64
import logging
from typing import Any

log = logging.getLogger(__name__)

#: The name both halves are registered under: ``weight_transfer_config={"backend": BACKEND_NAME}``.
BACKEND_NAME = "dcr"
#: ``LLM(load_format=UNPACKED_LOAD_FORMAT)``: vLLM-CPU keeps unquantized weights unpacked
#: (:mod:`~dcr_ray.engines.vllm.worker.unpacked`).
UNPACKED_LOAD_FORMAT = "dcr_unpacked"
_unpacked_registered = False


def register() -> None:
    """Register :class:`~dcr_ray.engines.vllm.worker.transfer.DcrWeightTransferEngine` and its trainer twin as
    backend ``dcr`` and the load format ``dcr_unpacked``, let vLLM's HTTP client send frames, add
    ``dcr_transfer_status`` to vLLM's worker base class, and make this process ready for a CPU engine
    (:func:`~dcr_ray.engines.vllm.compat.prepare_cpu_process`; all idempotent). On an unsupported vLLM release: one warning, and ``dcr`` names the stand-in that refuses
    (:func:`register_unsupported`); nothing else changes."""
    from dcr_ray.engines.vllm.compat import check_vllm_version, prepare_cpu_process
    from dcr_ray.errors import UnsupportedRuntimeError

    try:
        check_vllm_version()
    except UnsupportedRuntimeError as e:
        register_unsupported(e)
        return
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    prepare_cpu_process()  # AMX and the llvmlite shim; nothing CUDA-related, so a later fork is unaffected

    try:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, "dcr_ray.engines.vllm.worker.transfer",
                                                    "DcrWeightTransferEngine")
    except ValueError:  # already registered in this process
        pass
    register_trainer()
    register_unpacked_loader()
    try:
        from vllm.v1.worker.worker_base import WorkerBase
    except ImportError:  # a vLLM without v1 workers: the driver finds no status and says so
        return
    if not hasattr(WorkerBase, "dcr_transfer_status"):
        WorkerBase.dcr_transfer_status = dcr_transfer_status


def register_unsupported(error: Exception) -> None:
    """On an unsupported vLLM: log ``error`` once, and register backend ``dcr`` (both sides) as the stand-in of
    :mod:`~dcr_ray.engines.vllm.unsupported`, so asking for it raises ``error``'s message instead of vLLM's
    "invalid backend". Never raises: a vLLM whose registries changed shape gets the warning alone."""
    log.warning("dcr_ray: %s. The dcr weight-transfer backend is not registered; vLLM runs without it.", error)
    try:
        from vllm.distributed.weight_transfer import factory
    except Exception:  # a vLLM without the weight-transfer registries: nothing to register
        return
    for registry, cls in (("WeightTransferEngineFactory", "DcrWeightTransferEngine"),
                          ("WeightTransferTrainerFactory", "DcrTrainerWeightTransferEngine")):
        try:
            getattr(factory, registry).register_engine(BACKEND_NAME, "dcr_ray.engines.vllm.unsupported", cls)
        except Exception:  # already registered, or another shape: the warning is what is left
            pass


def register_unpacked_loader() -> None:
    """Register the load format :data:`UNPACKED_LOAD_FORMAT` (vLLM-CPU keeps its weights unpacked,
    :class:`~dcr_ray.engines.vllm.worker.unpacked.UnpackedCpuModelLoader`). Idempotent."""
    global _unpacked_registered
    if _unpacked_registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    from dcr_ray.engines.vllm.worker.unpacked import UnpackedCpuModelLoader

    register_model_loader(UNPACKED_LOAD_FORMAT)(UnpackedCpuModelLoader)
    _unpacked_registered = True


def register_trainer() -> None:
    """The trainer-side half of :func:`register` (no worker is touched): the ``dcr`` entry of vLLM's
    ``WeightTransferTrainerFactory`` and the HTTP client's frame encoding. Idempotent; an unsupported vLLM
    release raises :class:`~dcr_ray.errors.UnsupportedRuntimeError`."""
    from dcr_ray.engines.vllm.compat import check_vllm_version

    check_vllm_version()
    from vllm.distributed.weight_transfer import clients
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    try:
        WeightTransferTrainerFactory.register_engine(BACKEND_NAME, "dcr_ray.integrations.vllm.trainer",
                                                     "DcrTrainerWeightTransferEngine")
    except ValueError:  # already registered in this process
        pass
    original = getattr(clients, "_json_safe_update_info", None)
    if original is not None and not getattr(original, "_dcr_frames", False):
        def json_safe_update_info(update_info: dict[str, Any]) -> dict[str, Any]:
            return original(frames_as_base64(update_info))

        json_safe_update_info._dcr_frames = True  # type: ignore[attr-defined]
        clients._json_safe_update_info = json_safe_update_info


def frames_as_base64(update_info: Any) -> Any:
    """``update_info`` with its ``frames`` (bytes) moved into ``frames_b64`` (base64 strings), the form the
    ``dcr`` backend reads from JSON; anything without byte frames is returned as it is."""
    if not isinstance(update_info, dict):
        return update_info
    frames = update_info.get("frames")
    if (not isinstance(frames, (list, tuple)) or not frames
            or not all(isinstance(f, (bytes, bytearray, memoryview)) for f in frames)):
        return update_info  # nothing to encode (or not frame bytes: the backend refuses them, saying why)
    out = {k: v for k, v in update_info.items() if k != "frames"}
    out["frames_b64"] = list(update_info.get("frames_b64") or []) + [base64.b64encode(f).decode("ascii")
                                                                     for f in frames]
    return out


def dcr_transfer_status(worker: Any, nonce: str | None = None) -> dict[str, Any]:
    """(A vLLM worker method.) The outcome of the last weight-transfer call on this worker's ``dcr``
    engine (:meth:`~dcr_ray.engines.vllm.worker.transfer.DcrWeightTransferEngine.transfer_status`), plus this
    worker's ``rank``, whether vLLM's weight-update ``session`` is open, and ``nonce`` echoed back (the
    driver's proof that this reply answers its own request). Never raises."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if hasattr(engine, "transfer_status"):
        status = engine.transfer_status()
    else:
        status = {"seq": -1, "op": None, "ok": False,
                  "error": "this vLLM worker has no dcr weight-transfer engine (start the engine with "
                           "weight_transfer_config={'backend': 'dcr'})"}
    return {**status, "rank": getattr(worker, "rank", None), "nonce": nonce,
            "session": bool(getattr(worker, "_weight_update_active", False))}
