"""CPU seconds each actor spent on a refit: process CPU time read inside every actor, before and after.

Wall seconds say how long a refit took on this machine; CPU seconds say what it cost each actor, which
is what a deployment with a core (or a node) per actor would wait for. :meth:`CpuClock.start` reads
``time.process_time()`` (user + system time of every thread of the process: an owner's codec threads,
a relay's Ray threads, an engine's apply threads) inside each owner, relay and required engine through
Ray's ``__ray_call__`` (no method of theirs is needed); :meth:`CpuClock.stop` reads it again and returns
the differences per role and actor. Both reads are issued without waiting, and only ``stop`` waits, at
most :data:`READ_TIMEOUT_S`: an actor that does not answer (dead, or a trainer busy elsewhere) is left
out of the result rather than holding the refit.

What it counts: everything the process did between the two reads (the refit's work, and Ray's own
threads; an owner's background promote of the previous version when it overlaps). What it does not: CPU
outside the actor's process, e.g. the workers of a vLLM engine (their own processes) or the engine an
adopted proxy drives. The coordinator starts the clock before ``prepare`` and stops it after ``activate``.
"""

from __future__ import annotations

import time

import ray

#: How long ``stop`` waits for the actors' readings (a reading takes milliseconds; only an actor that hangs
#: makes the refit's answer wait this long, after its commit).
READ_TIMEOUT_S = 2.0
#: Roles in the order reports list them.
ROLES = ("owners", "relays", "engines")


def process_cpu_seconds(_actor=None) -> float:
    """CPU seconds of this process so far (all threads); ``_actor`` is the instance ``__ray_call__`` passes."""
    return time.process_time()


class CpuClock:
    """Process CPU time of a refit's actors between :meth:`start` and :meth:`stop`."""

    def __init__(self, actors: dict[str, dict[str, object]]):
        self._actors = actors
        self._start = {role: {a: _read(h) for a, h in hs.items()} for role, hs in actors.items()}

    @classmethod
    def start(cls, topology, engines) -> "CpuClock":
        """Start reading every owner and relay of ``topology`` and the engines ``engines`` (ids)."""
        relays = topology.transport.actors()
        return cls({"owners": {o: ep.handle for o, ep in topology.owners.items()}, "relays": dict(relays),
                    "engines": {e: topology.engines[e] for e in engines if e in topology.engines}})

    def stop(self) -> dict[str, dict[str, float]]:
        """``{role: {actor id: CPU seconds since start}}`` for every actor that answered both reads."""
        end = {role: {a: _read(h) for a, h in hs.items()} for role, hs in self._actors.items()}
        refs = [r for side in (self._start, end) for rs in side.values() for r in rs.values() if r is not None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=READ_TIMEOUT_S)
        out: dict[str, dict[str, float]] = {}
        for role in ROLES:
            got = {}
            for a, r0 in self._start.get(role, {}).items():
                t0, t1 = _value(r0), _value(end[role].get(a))
                if t0 is not None and t1 is not None:
                    got[a] = max(0.0, t1 - t0)
            out[role] = got
        return out


def _read(handle):
    """A reading of ``handle``'s process CPU time (an ObjectRef), or None if the call cannot be made."""
    try:
        return handle.__ray_call__.remote(process_cpu_seconds)
    except Exception:  # not an actor handle (a test double) or a dead actor's handle
        return None


def _value(ref) -> float | None:
    if ref is None:
        return None
    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return None
    try:
        return float(ray.get(ref))
    except Exception:  # the actor died or refused: left out
        return None
