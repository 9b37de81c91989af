"""Emulation of a cross-cluster link, applied where payloads cross a cluster boundary.

The emulation is a streaming pipe: a payload of ``n`` bytes *serialises* onto the link for
``n * 8 / (mbps * 1e6)`` seconds, one payload at a time, and arrives ``latency_s`` (one-way
propagation) after its serialisation ends. Propagation of one payload overlaps the serialisation of the
next (a long-lived connection keeps the pipe full), so ``k`` back-to-back payloads of ``N`` bytes in
all take ``N * 8 / bw + latency_s``, however the bytes are split. dcr_ray's relay heads and
object-storage readers, and the benchmark's full-checkpoint reference, use the same model, so their
times compare on equal terms. ``busy_s`` is the link's serialisation time: ``busy_s + latency_s`` is
the transport lower bound of everything that crossed it.
"""

from __future__ import annotations

import threading
import time


class LinkModel:
    """Serialises crossings and sleeps for their modelled duration (``mbps=None``: no delay)."""

    def __init__(self, mbps: float | None = None, latency_s: float = 0.0):
        self.mbps = mbps
        self.latency_s = latency_s if mbps is not None else 0.0
        self._lock = threading.Lock()
        self.busy_s = 0.0
        self.bytes = 0

    def serialise_s(self, nbytes: int) -> float:
        """Time ``nbytes`` occupy the link (no latency)."""
        if self.mbps is None:
            return 0.0
        return nbytes * 8 / (self.mbps * 1e6)

    def seconds(self, nbytes: int) -> float:
        """Modelled time of one isolated crossing of ``nbytes`` (serialisation + latency)."""
        if self.mbps is None:
            return 0.0
        return self.serialise_s(nbytes) + self.latency_s

    def cross(self, nbytes: int) -> None:
        """Account (and wait out) one crossing of ``nbytes`` that are ready to send.

        The local copy that made the bytes available (a Ray object pull, a file read) happened before
        and is not subtracted: with several payloads in flight it overlaps other payloads'
        serialisation, so subtracting it would let the emulated link run faster than its bandwidth.
        """
        with self._lock:  # one payload serialises at a time
            d = self.serialise_s(nbytes)
            if d > 0:
                time.sleep(d)
            self.busy_s += d
            self.bytes += nbytes
        if self.latency_s > 0:  # propagation: overlaps the next payload's serialisation
            time.sleep(self.latency_s)
