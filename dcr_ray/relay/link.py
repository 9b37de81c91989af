"""A model of a cross-cluster link, applied where payloads cross a cluster boundary.

The emulation is a serial pipe: a payload of ``n`` bytes occupies the link for
``n * 8 / (mbps * 1e6)`` seconds plus a fixed latency, one payload at a time. dcr_ray's relay heads
and object-storage readers, and the benchmark's full-checkpoint reference, use the same model, so
their times compare on equal terms. ``busy_s`` is the link's busy time: the transport lower bound.
"""

from __future__ import annotations

import threading
import time


class LinkModel:
    """Serialises crossings and sleeps for their modelled duration (``mbps=None``: no delay)."""

    def __init__(self, mbps: float | None = None, latency_s: float = 0.0):
        self.mbps = mbps
        self.latency_s = latency_s
        self._lock = threading.Lock()
        self.busy_s = 0.0
        self.bytes = 0

    def seconds(self, nbytes: int) -> float:
        """Modelled time of one crossing of ``nbytes``."""
        if self.mbps is None:
            return 0.0
        return nbytes * 8 / (self.mbps * 1e6) + self.latency_s

    def cross(self, nbytes: int, already_s: float = 0.0) -> None:
        """Account (and wait out) one crossing; ``already_s`` of real transfer time counts towards it."""
        with self._lock:
            d = self.seconds(nbytes)
            if d > already_s:
                time.sleep(d - already_s)
            self.busy_s += max(d, already_s)
            self.bytes += nbytes
