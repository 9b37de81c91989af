"""Fault injection for tests and failure drills (real engines, real frames, one injected fault).

``FlakyEngine(inner, fail_after=n)`` builds the ``inner`` engine backend and makes its apply fail once,
*after* ``n`` frames of a transfer were applied in place: the engine then holds a partially applied
XOR delta, which is exactly the state a retry must repair.

``TrainerThatFailsToPromoteOnce`` is a real :class:`~dcr_ray.testing.trainer.TinyTrainer` owner whose first
promote fails: the failure lands right after the commit record is written, a moment a test cannot hit
by killing an actor from outside.
"""

from __future__ import annotations

from dcr_ray.codec import DecodedFrame
from dcr_ray.engines.base import EngineBackend
from dcr_ray.errors import BaselineError, FrameError
from dcr_ray.testing.trainer import TinyTrainer


class InjectedFault(FrameError):
    """The fault a :class:`FlakyEngine` injects."""


class _FlakyBackend(EngineBackend):
    def __init__(self, inner: EngineBackend, fail_after: int):
        self.inner = inner
        self.fail_after = fail_after
        self.applied = 0
        self.failed = False

    def tensors(self):
        return self.inner.tensors()

    def apply(self, frame: DecodedFrame) -> None:
        boot = frame.meta.base < 0
        if not boot and not self.failed and self.applied >= self.fail_after:
            self.failed = True
            raise InjectedFault(f"injected fault after {self.applied} applied frames")
        self.inner.apply(frame)
        if not boot:
            self.applied += 1

    def flush(self) -> None:
        self.inner.flush()

    def undo_tensors(self):
        return self.inner.undo_tensors()

    def load_dense(self, tensors) -> None:
        self.inner.load_dense(tensors)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class FlakyEngine:
    """Engine factory: ``inner()`` with one injected apply failure after ``fail_after`` frames."""

    def __init__(self, inner, fail_after: int = 1):
        self.inner = inner
        self.fail_after = fail_after

    def __call__(self) -> EngineBackend:
        return _FlakyBackend(self.inner(), self.fail_after)


class TrainerThatFailsToPromoteOnce(TinyTrainer):
    """A :class:`~dcr_ray.testing.trainer.TinyTrainer` whose first ``dcr_promote`` raises."""

    _promote_failed = False

    def dcr_promote(self, version: int) -> int:
        if not self._promote_failed:
            self._promote_failed = True
            raise BaselineError(f"injected fault: promote to v{version} failed")
        return super().dcr_promote(version)
