"""The catch-up window: the committed payloads of the last few versions, kept inside a cluster.

An engine that fell k versions behind (evicted as hung, restarted from an older snapshot) needs only
what it missed: the payloads of the k transfers committed since the version it holds. Each cluster's
transport keeps them after their commit (the relay tree in its head relay, object storage under the
transfer's prefix), bounded in bytes (:attr:`~dcr_ray.config.TransportConfig.catchup_window_bytes`),
and :meth:`CatchUpWindow.since` answers with the chain of steps from a held version to the newest.

A step is kept only whole (every payload of the attempt the record committed) and only in commit
order: a step whose base is not the newest kept target breaks the chain, so everything older is
dropped (it could never be replayed past the gap). The chain each step names is what an engine checks
before it writes anything: base version and base content id (the transfer that produced it), the
committed attempt, and the exact set of payload keys.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True, slots=True)
class CommittedStep:
    """One committed transfer ``base -> target``, as the commit record and the engines' acks name it."""

    transfer: str
    """The transfer id (the commit record's ``transfer``; the content id of ``target``)."""
    attempt: int
    """The attempt whose payloads every required engine applied."""
    base: int
    target: int
    base_id: str
    """The content id of ``base`` (the transfer that produced it) the frames are bound to."""
    keys: list[tuple] = field(default_factory=list)
    """Every payload key of the committed attempt (``PayloadKey`` tuples)."""
    payloads: list[Any] = field(default_factory=list)
    """What an engine reads, one per key in key order: a Ray ``ObjectRef`` or a stored frame's path."""
    nbytes: int = 0
    """Wire bytes of the payloads."""

    def header(self) -> dict:
        """The step without its payloads (what a log line or a status row shows)."""
        return {"transfer": self.transfer, "attempt": self.attempt, "base": self.base, "target": self.target,
                "base_id": self.base_id, "payloads": len(self.keys), "bytes": self.nbytes}


class CatchUpWindow:
    """Committed steps in commit order, at most ``max_bytes`` of payloads (oldest dropped first).

    ``on_drop(step)`` is called for each step that leaves (object storage deletes its objects).
    """

    def __init__(self, max_bytes: int, on_drop=None):
        self.max_bytes = max_bytes
        self.on_drop = on_drop
        self.steps: deque[CommittedStep] = deque()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.steps)

    def add(self, step: CommittedStep) -> bool:
        """Keep ``step`` (the newest commit); returns False when it does not fit the window at all."""
        if self.steps and (step.base, step.base_id) != (self.steps[-1].target, self.steps[-1].transfer):
            self.clear()  # a gap: nothing older can be replayed past it
        if step.nbytes > self.max_bytes:
            self.clear()
            self._drop(step)
            return False
        self.steps.append(step)
        while self.nbytes > self.max_bytes:
            self._drop(self.steps.popleft())
        return True

    def since(self, version: int, version_id: str | None) -> list[CommittedStep] | None:
        """The steps from content ``(version, version_id)`` to the newest kept one (``[]`` when it is
        the newest), or None when the window does not reach back to it."""
        if self.steps and (self.steps[-1].target, self.steps[-1].transfer) == (version, version_id):
            return []
        for i, s in enumerate(self.steps):
            if (s.base, s.base_id) == (version, version_id):
                return list(self.steps)[i:]
        return None

    def clear(self) -> None:
        while self.steps:
            self._drop(self.steps.popleft())

    def _drop(self, step: CommittedStep) -> None:
        if self.on_drop is not None:
            self.on_drop(step)
