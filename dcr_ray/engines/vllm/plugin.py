"""vLLM plugin (entry point ``vllm.general_plugins`` -> ``dcr``): registers the ``dcr`` weight-transfer
backend in every vLLM process, engine core and tensor-parallel workers included, and gives vLLM's
workers the method ``dcr_transfer_status`` that the driver reads each call's outcome with
(``collective_rpc("dcr_transfer_status", args=(nonce,))``; see :mod:`~dcr_ray.engines.vllm.transfer`).

vLLM loads general plugins only when ``VLLM_PLUGINS`` is unset or names them (``VLLM_PLUGINS=dcr``).
"""

from __future__ import annotations

from typing import Any


def register() -> None:
    """Register :class:`~dcr_ray.engines.vllm.transfer.DcrWeightTransferEngine` as backend ``dcr`` and add
    ``dcr_transfer_status`` to vLLM's worker base class (both idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine("dcr", "dcr_ray.engines.vllm.transfer", "DcrWeightTransferEngine")
    except ValueError:  # already registered in this process
        pass
    try:
        from vllm.v1.worker.worker_base import WorkerBase
    except ImportError:  # a vLLM without v1 workers: the driver finds no status and says so
        return
    if not hasattr(WorkerBase, "dcr_transfer_status"):
        WorkerBase.dcr_transfer_status = dcr_transfer_status


def dcr_transfer_status(worker: Any, nonce: str | None = None) -> dict[str, Any]:
    """(A vLLM worker method.) The outcome of the last weight-transfer call on this worker's ``dcr``
    engine (:meth:`~dcr_ray.engines.vllm.transfer.DcrWeightTransferEngine.transfer_status`), plus this
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
