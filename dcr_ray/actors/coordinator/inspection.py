"""What the coordinator tells about itself while it runs: ``status()`` and ``progress()``.

Both read the coordinator's shared state (:class:`~dcr_ray.actors.fleet.state.CoordinatorState`)
without its lock, so they answer while a refit or start-up is in flight; they change nothing. A part of
:class:`~dcr_ray.actors.coordinator.actor.CoordinatorActor`; :mod:`dcr_ray.status` and :mod:`dcr_ray.progress`
format what it returns for people.
"""

from __future__ import annotations

from dataclasses import asdict

from dcr_ray.actors.fleet.calls import gather
from dcr_ray.actors.fleet.state import CoordinatorState
from dcr_ray.actors.recovery.healing import Healing
from dcr_ray.actors.recovery.outages import Outages

#: ``status(detail=True)`` waits this long for each engine's state, and lists this many past refits.
STATUS_TIMEOUT_S = 10.0
STATUS_HISTORY = 10
#: How long a progress poll waits for the engines' counters.
PROGRESS_TIMEOUT_S = 2.0


class Inspection:
    """``status`` and ``progress`` of the coordinator, read from its shared state and its healing table."""

    def __init__(self, state: CoordinatorState, healer: Healing, outages: Outages):
        self._shared = state
        self._healer = healer
        self._outages = outages

    def progress(self) -> dict:
        """Lock-free: the phase in flight, and the decompressed bytes the engines in it validated so
        far with the total expected (``None`` when unknown, e.g. a delta refit before owners diffed), and
        the payloads each engine in it applied (``engines``).
        The driver's progress bar polls it (:mod:`dcr_ray.progress`)."""
        s = self._shared
        phase = dict(s.phase)
        done, engines = 0, {}
        if phase.get("transfer"):
            got, _, _ = gather({e: h.progress.remote() for e, h in s.engines.items()}, PROGRESS_TIMEOUT_S,
                               "progress")
            mine = {e: p for e, p in got.items() if p["transfer"] == phase["transfer"]}
            done = sum(p["raw_bytes"] for p in mine.values())
            engines = {e: p["payloads"] for e, p in mine.items()}
        return {"phase": phase, "bytes": done, "total": s.progress_total, "engines": engines}

    def status(self, detail: bool = False) -> dict:
        """The committed version and record, the required engines and every engine's standing
        (``standings``: :class:`~dcr_ray.actors.fleet.standings.Standing`, the heal's steps included), the refit in
        flight (``phase``), the engines healing in the background (``healing``, and the last completed heals in
        ``healed``), the
        clusters waiting for capacity (``capacity``: since when, and what their actors ask of a node) and,
        with ``detail``, each engine's state, the relays per cluster and the last refits
        (:mod:`dcr_ray.status` formats it for ``dcr-ray status``)."""
        s = self._shared
        rec = s.commits.read()
        out = {"version": s.version, "epoch": s.epoch, "required": sorted(s.required),
               "standings": s.standings.as_dict(), "engines": sorted(s.engines), "owners": sorted(s.owners),
               "clusters": list(s.topology.clusters), "transport": s.transport.kind,
               "commit_record": None if rec is None else asdict(rec), "phase": dict(s.phase),
               "capacity": self._outages.status(), **self._healer.status()}
        if detail:
            states, dead, errors = gather({e: h.state.remote() for e, h in s.engines.items()}, STATUS_TIMEOUT_S,
                                          "status", s.lost("engine"))
            for e in dead:
                states[e] = {"engine": e, "phase": "dead"}
            for e in errors:
                states[e] = {"engine": e, "phase": "not answering"}
            for e, st in states.items():
                st["required"] = e in s.required
                standing = s.standings.of(e)
                st["standing"] = standing.value if standing is not None else None
                st.setdefault("cluster", s.topology.engine_cluster.get(e))
            out["engine_states"] = [states[e] for e in sorted(states)]
            relays: dict[str, list[str]] = {}
            for rid in s.transport.actors():
                relays.setdefault(rid.split("/")[0], []).append(rid)
            out["relays"] = relays
            out["last_refits"] = list(s.history[-STATUS_HISTORY:])
            out["startup"] = self.startup()
        return out

    def startup(self) -> dict:
        """Where start-up time went, per actor (:mod:`~dcr_ray.start_clock`): the coordinator's phases
        (``construct``, ``spawn``, ``attach owners``, ``engines up``, ``bootstrap``), and each engine's and
        relay's ``worker`` (process start, imports, arguments), ``backend`` and ``kernels`` seconds.
        Lock-free; an actor that does not answer within the status timeout is left out."""
        s = self._shared
        infos, _, _ = gather({e: h.info.remote() for e, h in s.engines.items()}, STATUS_TIMEOUT_S, "status",
                             s.lost("engine"))
        try:
            relays = {r["relay"]: r.get("start") for r in s.transport.stats()}
        except Exception:  # noqa: BLE001 - a transport without relays, or a dead one: no relay rows
            relays = {}
        return {"coordinator": s.start.report(), "engines": {e: i.get("start") for e, i in sorted(infos.items())},
                "relays": {r: v for r, v in sorted(relays.items()) if v is not None}}
