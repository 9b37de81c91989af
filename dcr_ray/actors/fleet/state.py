"""What the coordinator's parts share: one object, handed to each part in its constructor.

The coordinator (:mod:`~dcr_ray.actors.coordinator.actor`) is composed of parts that each own their own
state and reach the shared state only through this object: the dense bootstrap
(:mod:`~dcr_ray.actors.recovery.bootstrap`), membership (:mod:`~dcr_ray.actors.coordinator.membership`: who is required,
evicted, readmitted), healing (:mod:`~dcr_ray.actors.recovery.healing`), recovery
(:mod:`~dcr_ray.actors.recovery.restarts`) and inspection (:mod:`~dcr_ray.actors.coordinator.inspection`). No part reads
another part's fields.

Invariants: ``version`` is the version the durable record names (it changes only under ``lock``, at a
commit or a resume); ``standings`` holds every engine's standing (:mod:`~dcr_ray.actors.fleet.standings`), and
``required`` (a read-only view of it) the engines that take part in the next refit, each holding
``version`` settled between refits (changed under ``lock``, only through ``standings``' methods); ``phase`` and
``progress_total`` are
written by the thread that holds ``lock``. Inspection reads all of them without the lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dcr_ray.actors.fleet.commit import CommitLog
from dcr_ray.actors.fleet.standings import Standings
from dcr_ray.actors.fleet.topology import Topology
from dcr_ray.config import RefitConfig
from dcr_ray.errors import RefitError
from dcr_ray.relay.transport import Transport
from dcr_ray.start_clock import StartClock


def _idle() -> dict:
    return {"phase": "idle", "transfer": None, "attempt": None, "target": None, "since": time.time()}


@dataclass(eq=False)
class CoordinatorState:
    """The committed version and who holds it, the topology, the record, and the lock between refits."""

    config: RefitConfig
    topology: Topology  #: engines, owners, the transport between them
    commits: CommitLog  #: the durable record
    backend_factory: Any  #: builds each started engine's backend (in the engine's process)
    lock: threading.Lock = field(default_factory=threading.Lock)  #: held by a refit, a start, a heal's join
    version: int = 0  #: the committed version
    epoch: int = 0  #: this incarnation's fencing epoch (the record refuses older ones)
    standings: Standings = field(default_factory=Standings)  #: every engine's standing (one container)
    history: list[dict] = field(default_factory=list)  #: reports of the committed refits, oldest first
    phase: dict = field(default_factory=_idle)  #: where the refit (or start-up) in flight is
    progress_total: int | None = None  #: bytes the phase in flight delivers, when known
    model_bytes: int = 0  #: canonical bytes of one engine's tensors (0 until known: a resumed coordinator)
    start: StartClock = field(default_factory=StartClock)  #: this incarnation's start-up, phase by phase

    @property
    def required(self) -> frozenset[str]:
        """The engines holding ``version`` settled, in the next refit (read-only: standings change only
        through :class:`~dcr_ray.actors.fleet.standings.Standings`' methods)."""
        return self.standings.required

    @property
    def engines(self) -> dict[str, Any]:
        return self.topology.engines

    @property
    def owners(self) -> dict[str, Any]:
        return self.topology.owners

    @property
    def transport(self) -> Transport:
        return self.topology.transport

    def incarnation(self, engine_id: str) -> int | None:
        """The epoch of engine ``engine_id``'s incarnation the coordinator holds: every call that opens,
        flushes or activates a transfer names it, and an older incarnation refuses."""
        return self.topology.epochs.get(engine_id)

    def lost(self, kind: str):
        """``lost(ids)`` for :func:`~dcr_ray.actors.fleet.calls.gather`: those of ``ids`` (engines, relays or
        owners, by ``kind``) whose node is gone (:class:`~dcr_ray.actors.fleet.nodes.NodeWatch`)."""
        nodes = self.topology.nodes
        since = nodes.now()  # the wait begins: past NodeWatch's suspicion delay its nodes are probed

        def lost(ids: list[str]) -> list[str]:
            gone = set(nodes.lost((f"{kind}:{i}" for i in ids), since=since))
            return [i for i in ids if f"{kind}:{i}" in gone]
        return lost

    def relays_lost(self) -> Exception | None:
        """For :func:`~dcr_ray.actors.fleet.calls.gather`'s ``broken``: an error when a relay of the transport
        runs on a node that is gone (the payloads it carries will not arrive: the attempt fails now)."""
        relays = self.transport.actors()
        gone = self.topology.nodes.lost(f"relay:{r}" for r in relays) if relays else []
        if not gone:
            return None
        return RefitError(f"relay(s) {sorted(k.split(':', 1)[1] for k in gone)} are on a node that is gone")

    def set_phase(self, phase: str, transfer: str | None = None, attempt: int | None = None,
                  target: int | None = None) -> None:
        """Record where the refit in flight is (``status()`` reports it while the refit runs)."""
        self.phase = {"phase": phase, "transfer": transfer, "attempt": attempt, "target": target,
                      "since": time.time()}

    def last_transfer(self) -> str:
        """The content id of the committed version: the transfer the record names (frames build on it)."""
        rec = self.commits.read()
        return rec.transfer if rec else ""
