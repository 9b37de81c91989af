"""When an engine could not serve, measured on its own clock: the serving pause of each refit.

A pause opens when generation must stop serving the committed version and closes when it may go on:

- ``apply="in_place"``: from ``prepare`` of a delta transfer (writes land in live weights as frames
  arrive) to ``activate`` of the new version, or to the rollback of an abandoned transfer;
- ``apply="staged"``: inside ``activate``, after the commit record is durable, from the first write of the
  staged frames (every frame was validated and decoded while the engine served) to the end of their
  writes and the backend's flush. Nothing is written before the record, so no output ever names a policy
  that was never committed.
- an in-place engine that parked (``EngineConfig.hold_s``) serves between its park and the write-back:
  those seconds are ``parked_s``, not pause.

Generation calls already running when a pause opens finish first (their answers come from the old
version); that time is serving, not pause, so it is kept apart (``inflight``) and left out of
``pause_s``. Each closed pause keeps its seconds split into where they went (``apply``: the writes and
the backend's flush; ``commit``: the rest, payloads still arriving included), the seconds from its own
flush (every payload written) to its end (``after_apply_s``: waiting only for the other engines and the
commit record; None when it ended before a flush), the seconds it served inside the pause's transfer
with its writes set aside (``parked_s``, left out of ``pause_s``: ``EngineConfig.hold_s``), and the
seconds ``generate`` calls actually waited (``blocked``). :meth:`PauseClock.recent` is what
``EngineActor.pauses()`` returns, read by the GRPO example and ``dcr-ray bench live``.
"""

from __future__ import annotations

import collections
import threading
import time

#: Closed pauses an engine keeps.
KEPT = 256


class PauseClock:
    """The open pause (at most one, of one transfer) and the last :data:`KEPT` closed ones."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict | None = None
        self._closed: collections.deque = collections.deque(maxlen=KEPT)

    def begin(self, transfer: str, mode: str) -> None:
        """Generation stops serving for ``transfer`` now (no-op if a pause of it is open)."""
        with self._lock:
            if self._open is None or self._open["transfer"] != transfer:
                self._open = {"transfer": transfer, "mode": mode, "t0": time.perf_counter(), "at": time.time(),
                              "apply_s": 0.0, "blocked_s": 0.0, "inflight_s": 0.0}

    def flushed(self) -> None:
        """Every payload of the open pause's transfer is written (the engine's flush): from here the pause
        waits only for the others and the commit record (``after_apply_s``)."""
        with self._lock:
            if self._open is not None and self._open.get("t_flushed") is None:
                self._open["t_flushed"] = time.perf_counter()

    def park(self) -> None:
        """The engine set its applied writes aside and serves again, inside the open pause's transfer: the
        seconds until :meth:`unpark` are serving, not pause (``parked_s``)."""
        with self._lock:
            p = self._open
            if p is not None and p.get("t_parked") is None:
                now = time.perf_counter()
                p["t_parked"] = now
                if p.get("t_flushed") is not None:
                    p["after_apply_s"] = p.get("after_apply_s", 0.0) + now - p.pop("t_flushed")

    def unpark(self) -> None:
        """Activation writes the set-aside writes back: the pause goes on from here."""
        with self._lock:
            p = self._open
            if p is not None and p.get("t_parked") is not None:
                now = time.perf_counter()
                p["parked_s"] = p.get("parked_s", 0.0) + now - p.pop("t_parked")
                p["t_flushed"] = now  # from here to the end it is paused after its own apply again

    def applied(self, seconds: float) -> None:
        """The open pause spent ``seconds`` writing (and flushing the backend)."""
        with self._lock:
            if self._open is not None:
                self._open["apply_s"] += seconds

    def inflight(self, seconds: float) -> None:
        """The open pause waited ``seconds`` for generation calls that were running when it opened."""
        with self._lock:
            if self._open is not None:
                self._open["inflight_s"] += seconds

    def blocked(self, seconds: float) -> None:
        """A ``generate`` call waited ``seconds`` for the open pause (or for a pause that just closed)."""
        with self._lock:
            target = self._open if self._open is not None else (self._closed[-1] if self._closed else None)
            if target is not None:
                target["blocked_s"] += seconds

    def end(self, transfer: str, outcome: str, version: int | None) -> None:
        """The pause of ``transfer`` closes: ``outcome`` is ``activated`` (serving ``version``), ``rolled back``
        or ``abandoned`` (the engine holds no version)."""
        with self._lock:
            p = self._open
            if p is None or p["transfer"] != transfer:
                return
            self._open = None
            now = time.perf_counter()
            if p.get("t_parked") is not None:  # it ends while the writes are set aside: serving since
                p["parked_s"] = p.get("parked_s", 0.0) + now - p.pop("t_parked")
            p.setdefault("parked_s", 0.0)
            secs = now - p.pop("t0") - p["inflight_s"] - p["parked_s"]
            flushed = p.pop("t_flushed", None)
            after = p.pop("after_apply_s", None)
            if flushed is not None:
                after = (after or 0.0) + now - flushed
            p["after_apply_s"] = after
            self._closed.append({**p, "at": p["at"] + p["inflight_s"], "pause_s": secs,
                                 "commit_s": max(0.0, secs - p["apply_s"]), "outcome": outcome, "version": version})

    def recent(self, since: float = 0.0) -> list[dict]:
        """Closed pauses that began at or after ``since`` (``time.time()`` scale), oldest first."""
        with self._lock:
            return [dict(p) for p in self._closed if p["at"] >= since]
