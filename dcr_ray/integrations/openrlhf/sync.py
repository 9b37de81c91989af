"""The drop-in replacement for OpenRLHF's ``broadcast_to_vllm``: one ``refit.remote()``.

OpenRLHF 0.11 syncs weights in three layers, all replaced by :func:`refit_vllm_engines`:

``BasePPOTrainer.broadcast_to_vllm`` (the controller, ``ppo_trainer.py``)
    wakes the engines' weights when sleep mode is on, then calls ``broadcast_to_vllm`` on every policy rank.
``ActorPPOTrainer.broadcast_to_vllm`` (each policy rank, ``ray/ppo_actor.py``)
    per parameter: gather (ZeRO-3 / AutoTP), then ``update_weight`` over NCCL (or
    ``update_weight_cuda_ipc``) on every engine, whose ``WorkerWrap`` loads it with ``load_weights``.
``TrainingActor.broadcast_to_vllm`` (async mode, ``ppo_trainer_async.py``)
    takes the ``VLLMLock`` so no generation overlaps the sync, and with partial rollouts pauses the
    engines' generation (``pause_generation``: requests kept, not aborted) and resumes it afterwards.

:func:`refit_vllm_engines` keeps what the controller and the async trainer do around the sync (wake the
weights, lock, pause, resume, release, in that order, and the release and resume also when the refit
fails) and puts one ``ray.get(refit.remote())`` where the per-parameter broadcast was: the policy ranks
(owners) diff their shares against the last committed version and only the changed bits travel; every
engine ends with exactly the bits a dense load of the new policy gives, and the refit returns only after
the joint commit. Engines' prefix caches are reset by the refit itself (dcr_ray's flush).

:class:`DcrBroadcastMixin` is the same as a method: mix it into ``PPOTrainer`` or the async
``TrainingActor`` (see :func:`dcr_trainer`) and OpenRLHF's own ``train_step`` / ``fit`` call it.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import ray

from dcr_ray.errors import ConfigError

log = logging.getLogger(__name__)


def _engine_call(engines: Sequence[Any], method: str, **kwargs) -> None:
    """OpenRLHF's ``batch_vllm_engine_call`` when importable (it is the call OpenRLHF makes), else the same fan-out."""
    try:
        from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call
    except ImportError:  # pragma: no cover - OpenRLHF absent: same semantics, rank-0 check aside
        ray.get([getattr(e, method).remote(**kwargs) for e in engines])
        return
    batch_vllm_engine_call(list(engines), method, **kwargs)


def refit_vllm_engines(refit: Any, vllm_engines: Sequence[Any], *, enable_sleep: bool = False,
                       vllm_lock: Any = None, pause: bool = False):
    """Refit OpenRLHF's vLLM engines to the policy ranks' current weights; returns the ``RefitReport``.

    ``refit``: the :class:`dcr_ray.Refit` of the topology (``dcr_ray.Refit.get()`` finds it from any
    actor). ``vllm_engines``: OpenRLHF's engine handles (the same ones the topology adopted).
    ``enable_sleep``: OpenRLHF's ``args.vllm.enable_sleep`` (wake the weights first, KV cache stays
    asleep as in OpenRLHF). ``vllm_lock``: async mode's ``VLLMLock`` actor (held for the whole sync).
    ``pause``: async mode's ``partial_rollout_enable`` (pause generation around the refit, requests kept).

    Order: wake weights -> acquire lock -> pause -> refit -> resume -> release; resume and release run
    even when the refit raises (the engines then still serve the last committed version, see dcr_ray's
    recovery), so generation never stays paused or locked.
    """
    if refit is None or not hasattr(refit, "remote"):
        raise ConfigError("refit_vllm_engines needs the dcr_ray.Refit returned by dcr_ray.launch(...) "
                          "(or dcr_ray.Refit.get())")
    engines = list(vllm_engines or [])
    if pause and not engines:
        raise ConfigError("pause=True (partial rollouts) needs the vLLM engine handles to pause")
    if enable_sleep and engines:
        _engine_call(engines, "wake_up", tags=["weights"])
    if vllm_lock is not None:
        ray.get(vllm_lock.acquire.remote())
    try:
        if pause:
            _engine_call(engines, "pause_generation")
        try:
            report = ray.get(refit.remote())
        finally:
            if pause:
                _engine_call(engines, "resume_generation")
    finally:
        if vllm_lock is not None:
            ray.get(vllm_lock.release.remote())
    log.info("dcr_ray refit to version %s: %s", getattr(report, "version", "?"), report)
    return report


class DcrBroadcastMixin:
    """Replaces ``broadcast_to_vllm`` on OpenRLHF's ``PPOTrainer`` (sync) or ``TrainingActor`` (async).

    Reads what OpenRLHF's own method reads: ``self.vllm_engines``, ``self.args.vllm.enable_sleep``, and
    in async mode ``self.vllm_lock`` and ``self._partial_rollout``. The topology is
    ``self.dcr_refit`` when set, else ``dcr_ray.Refit.get()`` (the one ``dcr_ray.launch`` started).
    """

    dcr_refit: Any = None
    dcr_last_report: Any = None

    def broadcast_to_vllm(self) -> None:
        import dcr_ray

        if self.dcr_refit is None:
            self.dcr_refit = dcr_ray.Refit.get()
        vllm_args = getattr(getattr(self, "args", None), "vllm", None)
        self.dcr_last_report = refit_vllm_engines(
            self.dcr_refit, self.vllm_engines,
            enable_sleep=bool(getattr(vllm_args, "enable_sleep", False)),
            vllm_lock=getattr(self, "vllm_lock", None),
            pause=bool(getattr(self, "_partial_rollout", False)))


def dcr_trainer(trainer_cls: Any, **ray_options: Any) -> Any:
    """A Ray actor class: OpenRLHF's ``PPOTrainer`` or async ``TrainingActor`` (a Ray ``ActorClass`` or a
    plain class) whose ``broadcast_to_vllm`` is :class:`DcrBroadcastMixin`'s."""
    base = getattr(trainer_cls, "__ray_actor_class__", trainer_cls)
    cls = base if issubclass(base, DcrBroadcastMixin) else type(  # pickled by value to the workers
        f"Dcr{base.__name__}", (DcrBroadcastMixin, base), {})
    return ray.remote(**ray_options)(cls) if ray_options else ray.remote(cls)


__all__ = ["DcrBroadcastMixin", "dcr_trainer", "refit_vllm_engines"]
