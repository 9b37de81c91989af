"""Where an actor's start-up time goes, from its process's birth to the moment it can take part in a refit.

Each dcr_ray actor keeps one :class:`StartClock`. It is created first thing in the actor's
``__init__``, so its first interval, ``worker``, is everything Ray did before the actor's code ran: the
worker process starting, importing the actor's module and unpickling its arguments (which imports
whatever they need, e.g. ``transformers`` for an engine factory). Later intervals are named by the
actor (``backend``: the engine's model built; ``kernels``: its numba kernels loaded, on a background
thread, so it overlaps the others). ``dcr-ray status`` shows them per actor and
``dcr-ray bench startup`` sums them per kind of actor.
"""

from __future__ import annotations

import time


def process_started() -> float:
    """Wall-clock time this process was created (``time.time()`` scale)."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - without psutil the first interval starts at __init__
        return time.time()


class StartClock:
    """Named start-up intervals of one actor, in seconds (see the module docstring)."""

    def __init__(self) -> None:
        now = time.time()
        self.born = process_started()
        self.seconds: dict[str, float] = {"worker": max(0.0, now - self.born)}
        self._last = now

    def mark(self, name: str) -> None:
        """The interval since the previous mark (or the clock's creation) is ``name``."""
        now = time.time()
        self.seconds[name] = self.seconds.get(name, 0.0) + (now - self._last)
        self._last = now

    def add(self, name: str, seconds: float) -> None:
        """An interval measured elsewhere (e.g. on another thread): ``name`` took ``seconds``."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def report(self) -> dict:
        """``{"born": process creation time, "seconds": {interval: s}}``."""
        return {"born": self.born, "seconds": {k: round(v, 4) for k, v in self.seconds.items()}}
