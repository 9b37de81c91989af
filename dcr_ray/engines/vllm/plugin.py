"""vLLM plugin (entry point ``vllm.general_plugins`` -> ``dcr``): registers the ``dcr`` weight-transfer
backend in every vLLM process, engine core and tensor-parallel workers included.

vLLM loads general plugins only when ``VLLM_PLUGINS`` is unset or names them (``VLLM_PLUGINS=dcr``).
"""

from __future__ import annotations


def register() -> None:
    """Register :class:`~dcr_ray.engines.vllm.transfer.DcrWeightTransferEngine` as backend ``dcr`` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine("dcr", "dcr_ray.engines.vllm.transfer", "DcrWeightTransferEngine")
    except ValueError:  # already registered in this process
        pass
