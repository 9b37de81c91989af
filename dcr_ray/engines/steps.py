"""Decoding steps and the version each one reads: the gate a version switch waits at, and answers' spans.

A backend that can switch versions in flight (``EngineBackend.switches_in_flight``) decodes step by step
and passes through its :class:`StepGate` around every step that reads the weights (a prefill, a decoding
step)::

    version = gate.enter()   # waits while a switch writes; the weights now hold ``version``
    ... one forward pass ...
    gate.leave()

The engine actor hands the backend a gate bound to its own state (``EngineConfig(switch="in_flight")``):
a write waits only for the steps in progress, and steps wait while it writes. So every step reads one
committed version, and a running request goes on, with the KV cache it holds, under the next version.
Without an engine (a backend used on its own, or ``switch="drain"``), the gate is :data:`OPEN`: it never
waits and names no version (None); the engine then names the version it admitted the call at.

Every continuation carries ``versions``: spans ``(version, first token index)`` in token order, as vLLM's
``WeightVersionSpan`` (whose ``end`` is the next span's start). Token ``i`` of a continuation was produced
by the step that read ``version`` of the last span whose start is ``<= i``.
"""

from __future__ import annotations

from typing import Protocol


class StepGate(Protocol):
    """Where a decoding step waits for a version switch (see the module doc)."""

    def enter(self) -> int | None:
        """Wait until the weights may be read; returns the version they hold (None: not known here)."""

    def leave(self) -> None:
        """The step that :meth:`enter` admitted no longer reads the weights."""


class _Open:
    """A gate that never waits and names no version."""

    def enter(self) -> int | None:
        return None

    def leave(self) -> None:
        pass

    def __repr__(self) -> str:
        return "OPEN"


#: The gate of a backend no engine gates: steps never wait.
OPEN: StepGate = _Open()


class Spans:
    """Builds one continuation's spans from the version of each step that produced its tokens."""

    def __init__(self) -> None:
        self.spans: list[tuple[int | None, int]] = []
        self.tokens = 0

    def add(self, version: int | None, n: int = 1) -> None:
        """``n`` more tokens, produced by a step that read ``version``."""
        if n <= 0:
            return
        if not self.spans or self.spans[-1][0] != version:
            self.spans.append((version, self.tokens))
        self.tokens += n


def fill_spans(spans: list, version: int | None) -> list[tuple[int | None, int]]:
    """``spans`` with every unknown version (None: an ungated step) named ``version``, adjacent equal
    versions merged; ``[(version, 0)]`` when there are none (no token, or a backend that keeps no spans)."""
    out: list[tuple[int | None, int]] = []
    for v, start in spans or [(None, 0)]:
        v = version if v is None else v
        if not out or out[-1][0] != v:
            out.append((v, int(start)))
    return out
