"""The OpenRLHF recipe: refit OpenRLHF 0.11's vLLM engines with dcr_ray instead of ``broadcast_to_vllm``.

OpenRLHF hard-wires weight sync (``broadcast_to_vllm``: per parameter, NCCL broadcast or CUDA IPC, into
``WorkerWrap.update_weight``); there is no plug-in point, so the recipe swaps three classes/functions at
the places a user's launch script names them, and keeps everything else of OpenRLHF:

============================  ===============================================  =============================
OpenRLHF                      recipe                                           module
============================  ===============================================  =============================
``create_vllm_engines``       :func:`create_vllm_engines` (same arguments;     :mod:`.engines`
                              engines started with the ``dcr`` backend)
engine handles                :func:`adopt_vllm_engines` ->                    :mod:`.engines`
                              ``ClusterSpec(adopt=...)``
``PolicyModelActor``          :func:`dcr_policy_actor` (ranks become owners,   :mod:`.policy`
                              :class:`PolicyOwnerMixin`)
``broadcast_to_vllm``         :func:`refit_vllm_engines` /                     :mod:`.sync`
                              :class:`DcrBroadcastMixin` via :func:`dcr_trainer`
============================  ===============================================  =============================

Async mode's lock and pause/resume around the sync are kept (:func:`refit_vllm_engines`). See
``docs/guide_openrlhf.md`` for the lines a user changes and what is GPU-only, and
``examples/openrlhf_refit.py`` for a CPU-runnable run.

Importing this package imports neither OpenRLHF nor vLLM; :mod:`.engines` (and the names from it) does.
"""

from __future__ import annotations

from dcr_ray.integrations.openrlhf.policy import PolicyOwnerMixin, dcr_policy_actor, hf_model
from dcr_ray.integrations.openrlhf.sync import DcrBroadcastMixin, dcr_trainer, refit_vllm_engines

_FROM_ENGINES = {"DCR_WEIGHT_TRANSFER", "DcrRolloutRayActor", "DcrRolloutRayActorRemote", "adopt_vllm_engines",
                 "create_vllm_engines"}


def __getattr__(name: str):
    """Names from :mod:`.engines`, imported on first use (it imports OpenRLHF and vLLM)."""
    if name in _FROM_ENGINES:
        from dcr_ray.integrations.openrlhf import engines

        return getattr(engines, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted({"DcrBroadcastMixin", "PolicyOwnerMixin", "dcr_policy_actor", "dcr_trainer", "hf_model",
                  "refit_vllm_engines", *_FROM_ENGINES})
