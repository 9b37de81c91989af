"""Generation pauses for the apply only: TRL's ``pause()`` is kept as an intent, and taken around the apply.

TRL 1.16's ``AsyncGRPOTrainer._sync_weight_merged`` calls, on the main process::

    weight_transfer.pause()                 # before anything is sent
    accelerator.wait_for_everyone()
    weight_transfer.send_weights(iterator)  # every rank iterates (FSDP2 full_tensor() is a collective)
    accelerator.wait_for_everyone()
    weight_transfer.resume()
    model_version += 1; rollout_worker.update_model_version(model_version)

TRL's NCCL client pauses the server at ``pause()``, so generation stops for the whole send. The ``dcr``
transfer's frames only reach the workers' host mirrors until ``finish_weight_update`` reloads the touched
groups (:mod:`~dcr_ray.engines.vllm.worker.receiver`), so the server may go on generating with the weights it
serves while the trainer diffs, encodes and streams. :class:`ApplyPause` therefore only *records* TRL's
``pause()``; the real pause (TRL's ``/pause?mode=keep``) is taken by :meth:`ApplyPause.around_apply`, which
the sender enters around the apply (finish, version label, prefix-cache reset), and released as soon as
the apply returns or fails, as dcr_ray's ``EngineConfig(apply="staged")`` engines do.

What TRL's ordering forces: the diff can only start inside ``send_weights`` (the iterator exists only
there, and on FSDP2 it is a collective every rank runs), so the pause cannot be decided before it; a
``pause()`` without a following apply (a sync in which no bit changed, e.g. the cold sync at train begin)
pauses nothing. TRL moves the rollout worker's version (the tag a new prompt group carries) only after
``resume()``; groups started between the end of the apply and that bump are tagged with the old version
though the new weights generate them, so TRL counts their staleness one too high (its ``max_staleness``
filter is then stricter, never looser). TRL's NCCL path has the same window, from its ``resume()`` to the
bump, only shorter: it does not include the second barrier.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from dcr_ray.integrations.trl.server_calls import TrlServerCalls


class ApplyPause:
    """TRL's pause as an intent (:meth:`request`), taken around the apply only (:meth:`around_apply`)."""

    def __init__(self, calls: TrlServerCalls):
        self.calls = calls
        self.requested = False
        """TRL called ``pause()`` and the sync it announced has not ended."""
        self.paused = False
        """The servers are paused by this object now."""
        self.last_pause_s = 0.0
        """Seconds the last apply kept generation paused (the trainer's clock, from the pause request
        to the resume's answer: an upper bound of the server's pause)."""

    def request(self) -> None:
        """TRL's ``pause()``: a sync follows; pause generation around its apply."""
        self.requested = True

    @contextlib.contextmanager
    def around_apply(self) -> Iterator[None]:
        """Entered by the sender around the apply of a sync that sent frames: the servers pause (if TRL
        asked for a pause) and resume when the apply returns or raises."""
        if not self.requested:
            yield
            return
        t0 = time.perf_counter()
        self.last_pause_s = 0.0
        self.calls.pause()
        self.paused = True
        try:
            yield
        finally:
            try:
                self.calls.resume()  # a failure here propagates; paused stays True and release() tries again
                self.paused = False
            finally:
                self.last_pause_s = time.perf_counter() - t0

    def release(self) -> None:
        """TRL's ``resume()``: the sync ended. Resumes the servers only if an apply left them paused (its
        resume failed); otherwise they are generating already."""
        self.requested = False
        if self.paused:
            self.calls.resume()
            self.paused = False


__all__ = ["ApplyPause"]
