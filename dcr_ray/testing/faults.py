"""Fault injection for tests and failure drills (real engines, real frames, one injected fault).

``FlakyEngine(inner, fail_after=n)`` builds the ``inner`` engine backend and makes its apply fail once,
*after* ``n`` frames of a transfer were applied in place: the engine then holds a partially applied
XOR delta, which is exactly the state a retry must repair.

``StallingEngine(inner, stall_s)`` builds the ``inner`` backend and makes its first flush after the
bootstrap sleep ``stall_s`` seconds (an engine that is alive but hung, holding its lock).

``StallOnSignal(inner, signal, stall_s)`` builds the ``inner`` backend; a flush hangs for ``stall_s``
seconds when the file ``signal`` names this engine (the file is consumed): a stall armed from outside
at a chosen refit.

Both take ``release=PATH``: the stall then ends as soon as :func:`release_stall` is called with that path
(``stall_s`` stays its upper bound), so a drill waits exactly as long as its story needs instead of
sleeping out a margin. :func:`release_stall` returns once the stalled flush has finished.

``SlowStartEngine(inner, delay_s)`` builds the ``inner`` backend ``delay_s`` seconds late (an engine
whose start-up outlasts a launch's timeout).

``TrainerThatKillsTheCoordinatorAtPromote`` is a real :class:`~dcr_ray.testing.trainer.TinyTrainer`
owner whose first promote kills the coordinator's process (Ray restarts it): a coordinator that dies
right after its commit record is written.

``TrainerThatFailsToPromoteOnce`` is a real :class:`~dcr_ray.testing.trainer.TinyTrainer` owner whose first
promote fails: the failure lands right after the commit record is written, a moment a test cannot hit
by killing an actor from outside.
"""

from __future__ import annotations

from dcr_ray.codec import DecodedFrame
from dcr_ray.engines.base import EngineBackend, TensorBackend
from dcr_ray.errors import BaselineError, FrameError
from dcr_ray.testing.trainer import TinyTrainer


class InjectedFault(FrameError):
    """The fault a :class:`FlakyEngine` injects."""


class _FlakyBackend(TensorBackend):
    """A :class:`TensorBackend` around another (every hook forwarded) whose apply fails once."""

    def __init__(self, inner: EngineBackend, fail_after: int):
        if not isinstance(inner, TensorBackend):
            raise TypeError(f"fault injection wraps a TensorBackend (e.g. HFEngine's), got {type(inner).__name__}")
        self.inner = inner
        self.fail_after = fail_after
        self.applied = 0
        self.failed = False

    def tensors(self):
        return self.inner.tensors()

    def _maybe_fail(self, frame: DecodedFrame) -> None:
        if frame.meta.base >= 0 and not self.failed and self.applied >= self.fail_after:
            self.failed = True
            raise InjectedFault(f"injected fault after {self.applied} applied frames")

    def _count(self, frame: DecodedFrame) -> None:
        if frame.meta.base >= 0:  # not the bootstrap's
            self.applied += 1

    def apply(self, frame: DecodedFrame) -> None:
        self._maybe_fail(frame)
        self.inner.apply(frame)
        self._count(frame)

    def apply_with_undo(self, frame: DecodedFrame, undo) -> None:
        self._maybe_fail(frame)
        self.inner.apply_with_undo(frame, undo)
        self._count(frame)

    def flush(self) -> None:
        self.inner.flush()

    def undo_tensors(self):
        return self.inner.undo_tensors()

    def load_dense(self, tensors) -> None:
        self.inner.load_dense(tensors)

    # the optional hooks go to the wrapped backend (the base class's defaults would shadow them)
    @property
    def applies_packs(self) -> bool:
        return self.inner.applies_packs

    def tensor_specs(self):
        return self.inner.tensor_specs()

    def generate(self, *args, **kwargs):
        return self.inner.generate(*args, **kwargs)

    def rollback(self) -> bool:
        return self.inner.rollback()

    def activate(self, version: int) -> None:
        self.inner.activate(version)

    def abandon(self) -> None:
        self.inner.abandon()

    def matches_digests(self, version: int, digests):
        return self.inner.matches_digests(version, digests)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class FlakyEngine:
    """Engine factory: ``inner()`` with one injected apply failure after ``fail_after`` frames."""

    def __init__(self, inner, fail_after: int = 1):
        self.inner = inner
        self.fail_after = fail_after

    def __call__(self) -> EngineBackend:
        return _FlakyBackend(self.inner(), self.fail_after)


#: How often a stalled flush looks for its release file.
RELEASE_POLL_S = 0.05


def stalled_flush(inner: EngineBackend, stall_s: float, release: str | None) -> None:
    """Hang ``stall_s`` seconds (or until the file ``release`` appears), then flush ``inner``; a release
    file is removed once the flush is done: that is :func:`release_stall`'s answer."""
    import os
    import time

    deadline = time.monotonic() + stall_s
    while time.monotonic() < deadline and not (release and os.path.exists(release)):
        time.sleep(RELEASE_POLL_S if release else max(0.0, deadline - time.monotonic()))
    try:
        inner.flush()
    finally:
        if release:
            try:
                os.remove(release)
            except FileNotFoundError:
                pass


def release_stall(release: str, timeout_s: float = 60.0) -> None:
    """End the stall of a :class:`StallingEngine` or :class:`StallOnSignal` built with ``release``: create
    the file and return once the stalled flush has finished (the engine answers calls again)."""
    import os
    import time

    with open(release, "w"):
        pass
    deadline = time.monotonic() + timeout_s
    while os.path.exists(release):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no stalled flush took the release {release} within {timeout_s} s")
        time.sleep(RELEASE_POLL_S)


class _StallingBackend(_FlakyBackend):
    def __init__(self, inner: EngineBackend, stall_s: float, release: str | None = None):
        super().__init__(inner, fail_after=1 << 30)
        self.stall_s = stall_s
        self.release = release
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1
        if self.flushes == 2:  # the first flush is the dense bootstrap's
            return stalled_flush(self.inner, self.stall_s, self.release)
        self.inner.flush()


class StallingEngine:
    """Engine factory: ``inner()`` whose first flush after the bootstrap hangs for ``stall_s`` seconds
    (with ``release``, until :func:`release_stall` of that path, at most ``stall_s``); with ``only``,
    just in the engine of that id (e.g. ``"a/e1"``), the others are plain ``inner()``."""

    def __init__(self, inner, stall_s: float, only: str | None = None, release: str | None = None):
        self.inner = inner
        self.stall_s = stall_s
        self.only = only
        self.release = release

    def __call__(self) -> EngineBackend:
        if self.only is not None:
            import ray

            if not (ray.get_runtime_context().get_actor_name() or "").endswith(self.only):
                return self.inner()
        return _StallingBackend(self.inner(), self.stall_s, self.release)


class _SignalledStallBackend(_FlakyBackend):
    def __init__(self, inner: EngineBackend, signal: str, stall_s: float, release: str | None = None):
        super().__init__(inner, fail_after=1 << 30)  # never fails an apply
        self.signal = signal
        self.stall_s = stall_s
        self.release = release

    def flush(self) -> None:
        import os

        import ray

        me = ray.get_runtime_context().get_actor_name() or ""
        try:
            with open(self.signal) as f:
                target = f.read().strip()
        except FileNotFoundError:
            target = ""
        if target and me.endswith(target):
            try:
                os.remove(self.signal)
            except FileNotFoundError:
                return self.inner.flush()  # another flush of this engine took it
            return stalled_flush(self.inner, self.stall_s, self.release)
        self.inner.flush()


class StallOnSignal:
    """Engine factory: ``inner()`` whose flush hangs ``stall_s`` seconds when the file ``signal``
    holds this engine's id (e.g. ``a/e1``); the stall consumes the file. With ``release``, the stall
    ends at :func:`release_stall` of that path (at most ``stall_s``)."""

    def __init__(self, inner, signal: str, stall_s: float, release: str | None = None):
        self.inner = inner
        self.signal = signal
        self.stall_s = stall_s
        self.release = release

    def __call__(self) -> EngineBackend:
        return _SignalledStallBackend(self.inner(), self.signal, self.stall_s, self.release)


class SlowStartEngine:
    """Engine factory: ``inner()``, built after sleeping ``delay_s`` seconds."""

    def __init__(self, inner, delay_s: float):
        self.inner = inner
        self.delay_s = delay_s

    def __call__(self) -> EngineBackend:
        import time

        time.sleep(self.delay_s)
        return self.inner()


class TrainerThatFailsToPromoteOnce(TinyTrainer):
    """A :class:`~dcr_ray.testing.trainer.TinyTrainer` whose first ``dcr_promote`` raises."""

    _promote_failed = False

    def dcr_promote(self, version: int) -> int:
        if not self._promote_failed:
            self._promote_failed = True
            raise BaselineError(f"injected fault: promote to v{version} failed")
        return super().dcr_promote(version)


class TrainerThatKillsTheCoordinatorAtPromote(TinyTrainer):
    """A :class:`~dcr_ray.testing.trainer.TinyTrainer` whose first ``dcr_promote`` kills the coordinator
    before promoting: by default so that Ray restarts it (it resumes from the record); with
    ``for_good=True`` with ``no_restart=True`` (gone for good: ``launch(..., resume=True)`` carries on)."""

    _killed = False

    def __init__(self, *args, for_good: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self._for_good = for_good

    def dcr_promote(self, version: int) -> int:
        if not self._killed:
            import ray

            from dcr_ray.options import COORDINATOR_NAME, NAMESPACE

            self._killed = True
            ray.kill(ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE), no_restart=self._for_good)
        return super().dcr_promote(version)
