"""What the coordinator tells about itself while it runs: ``status()`` and ``progress()``.

Both read the coordinator's state without its lock, so they answer while a refit or start-up is in
flight (a mixin of :class:`~dcr_ray.actors.coordinator.CoordinatorActor`; :mod:`dcr_ray.status` and
:mod:`dcr_ray.progress` format them for people).
"""

from __future__ import annotations

from dataclasses import asdict

from dcr_ray.actors.calls import gather

#: ``status(detail=True)`` waits this long for each engine's state, and lists this many past refits.
STATUS_TIMEOUT_S = 10.0
STATUS_HISTORY = 10
#: How long a progress poll waits for the engines' counters.
PROGRESS_TIMEOUT_S = 2.0


class Inspection:
    """``status`` and ``progress`` of the coordinator (reads ``phase``, ``engines``, ``commits``, ...)."""

    def progress(self) -> dict:
        """Lock-free: the phase in flight, and the decompressed bytes the engines in it validated so
        far with the total expected (``None`` when unknown, e.g. a delta refit before owners diffed).
        The driver's progress bar polls it (:mod:`dcr_ray.progress`)."""
        phase = dict(self.phase)
        done = 0
        if phase.get("transfer"):
            got, _, _ = gather({e: h.progress.remote() for e, h in self.engines.items()}, PROGRESS_TIMEOUT_S,
                               "progress")
            done = sum(p["raw_bytes"] for p in got.values() if p["transfer"] == phase["transfer"])
        return {"phase": phase, "bytes": done, "total": self._progress_total}

    def status(self, detail: bool = False) -> dict:
        """The committed version and record, the required engines, the refit in flight (``phase``), the
        engines healing in the background (``healing``, and the last completed heals in ``healed``) and,
        with ``detail``, each engine's state, the relays per cluster and the last refits
        (:mod:`dcr_ray.status` formats it for ``dcr-ray status``)."""
        rec = self.commits.read()
        out = {"version": self.version, "epoch": self.epoch, "required": sorted(self.required),
               "engines": sorted(self.engines), "owners": sorted(self.owners),
               "clusters": list(self.topology.clusters), "transport": self.transport.kind,
               "commit_record": None if rec is None else asdict(rec), "phase": dict(self.phase),
               **self.healer.status()}
        if detail:
            states, dead, errors = gather({e: h.state.remote() for e, h in self.engines.items()}, STATUS_TIMEOUT_S,
                                          "status")
            for e in dead:
                states[e] = {"engine": e, "phase": "dead"}
            for e in errors:
                states[e] = {"engine": e, "phase": "not answering"}
            for e, st in states.items():
                st["required"] = e in self.required
                st.setdefault("cluster", self.topology.engine_cluster.get(e))
            out["engine_states"] = [states[e] for e in sorted(states)]
            relays: dict[str, list[str]] = {}
            for rid in self.transport.actors():
                relays.setdefault(rid.split("/")[0], []).append(rid)
            out["relays"] = relays
            out["last_refits"] = list(self.history[-STATUS_HISTORY:])
        return out
