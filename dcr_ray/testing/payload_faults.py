"""Payload faults for failure drills: a transport whose sinks drop, duplicate, reorder or delay frames.

:class:`PayloadFaults` wraps a real transport (relay tree or object storage) and changes only the owner
side: every stream's sink is a :class:`FaultySink`. The fault to inject is armed from outside with
:func:`arm` (a small file at ``signal``, a path every owner process can read: one machine, or a shared
mount) and hits the first frame one owner sends in attempt 0 of a transfer:

* ``drop``: the frame is never sent. Engines wait for it until the stage timeout, the attempt fails,
  and the retry (OVERWRITE of the whole changed set) must still commit bit-exact.
* ``duplicate``: the frame is sent twice; engines apply it once (payload ids are journaled).
* ``reorder``: the frame is held back and sent after the owner's next one (or at drain).
* ``delay``: the frame waits :data:`DELAY_S` before it is sent.

Retries are untouched, so an armed fault costs at most one attempt. :func:`disarm` removes it.
"""

from __future__ import annotations

import os
import time

PAYLOAD_FAULTS = ("drop", "duplicate", "reorder", "delay")
#: How long a ``delay`` fault holds its frame.
DELAY_S = 1.5


def arm(signal: str, kind: str, producer: str) -> None:
    """Make the next streams' first attempt-0 frame of owner ``producer`` suffer ``kind``."""
    if kind not in PAYLOAD_FAULTS:
        raise ValueError(f"payload fault must be one of {PAYLOAD_FAULTS}, got {kind!r}")
    tmp = f"{signal}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{kind} {producer}")
    os.replace(tmp, signal)  # readers see the whole plan or none


def disarm(signal: str) -> None:
    """Remove an armed fault (no-op when none is armed)."""
    try:
        os.remove(signal)
    except FileNotFoundError:
        pass


def _armed(signal: str) -> tuple[str, str] | None:
    try:
        with open(signal) as f:
            kind, producer = f.read().split()
    except (FileNotFoundError, ValueError):
        return None
    return kind, producer


class FaultySink:
    """An owner's sink that injects the armed fault into its first attempt-0 frame (see module doc)."""

    def __init__(self, inner, signal: str):
        self.inner = inner
        self.signal = signal
        self._plan: tuple[str, str] | None | bool = False  # read at the first send of this stream
        self._held = None

    def send(self, frame: bytes, key) -> None:
        if self._plan is False:
            self._plan = _armed(self.signal)
        if self._held is not None:  # reorder: the held frame goes after this one
            self.inner.send(frame, key)
            self._release()
            return
        plan = self._plan
        if plan is None or key.attempt != 0 or key.payload != 0 or plan[1] != key.producer:
            self.inner.send(frame, key)
            return
        kind = plan[0]
        if kind == "drop":
            return
        if kind == "reorder":
            self._held = (frame, key)
            return
        if kind == "delay":
            time.sleep(DELAY_S)
        self.inner.send(frame, key)
        if kind == "duplicate":
            self.inner.send(frame, key)

    def _release(self) -> None:
        frame, key = self._held
        self._held = None
        self.inner.send(frame, key)

    def drain(self) -> None:
        if self._held is not None:
            self._release()
        self.inner.drain()


class PayloadFaults:
    """A transport (see :class:`~dcr_ray.relay.transport.Transport`) whose sinks are :class:`FaultySink`;
    everything else is ``inner``'s (default: the transport ``config`` names)."""

    def __init__(self, config, signal: str, inner=None):
        from dcr_ray.relay.transport import make_transport

        self.inner = inner if inner is not None else make_transport(config)
        self.kind = self.inner.kind
        self.signal = signal

    def sink(self, targets, required, *, every_cluster: bool = False):
        return FaultySink(self.inner.sink(targets, required, every_cluster=every_cluster), self.signal)

    def __getattr__(self, name: str):
        if name.startswith("__") or "inner" not in self.__dict__:  # pickling looks up dunders first
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)


__all__ = ["DELAY_S", "PAYLOAD_FAULTS", "FaultySink", "PayloadFaults", "arm", "disarm"]
