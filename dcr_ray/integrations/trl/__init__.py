"""TRL's AsyncGRPO with bit-exact delta syncs: ``AsyncGRPOTrainer(..., weight_transfer=DcrWeightTransfer(...))``.

TRL 1.16's ``AsyncGRPOTrainer`` takes any object implementing its ``WeightTransferProtocol``; its own
broadcasts every tensor over NCCL. :class:`DcrWeightTransfer` sends only the bits that changed, over the
vLLM server's HTTP weight-transfer routes, and leaves the server with exactly the bits a dense load of the
trainer's tensors gives. The server runs with the ``dcr`` weight-transfer backend (registered by dcr_ray's
vLLM plugin) and ``VLLM_SERVER_DEV_MODE=1``. See ``docs/guide_trl.md``.

===========================  ====================================================  ====================
piece                        what it is                                            module
===========================  ====================================================  ====================
:class:`DcrWeightTransfer`   the protocol object TRL calls                         :mod:`.transfer`
:class:`TrlDcrConfig`        its settings (checkpoint, server URL(s), codec, ...)  :mod:`.config`
``ApplyPause``               TRL's ``pause()`` kept as intent, taken around the    :mod:`.pause`
                             apply only
``TrlServerCalls``           the HTTP calls: weight transfer, pause/resume,        :mod:`.server_calls`
                             ``/health``, the prefix-cache reset
===========================  ====================================================  ====================

Importing this package imports neither TRL (the protocol is structural) nor vLLM; :class:`DcrWeightTransfer`
imports vLLM on first use.
"""

from __future__ import annotations

from dcr_ray.integrations.trl.config import TrlDcrConfig


def __getattr__(name: str):
    """:class:`DcrWeightTransfer`, imported on first use (it imports vLLM's weight-transfer API)."""
    if name == "DcrWeightTransfer":
        from dcr_ray.integrations.trl.transfer import DcrWeightTransfer

        return DcrWeightTransfer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DcrWeightTransfer", "TrlDcrConfig"]
