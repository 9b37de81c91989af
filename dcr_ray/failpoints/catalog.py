"""Every failpoint of the library: its name, the role whose process hits it, the protocol step, and what
makes a refit reach it.

Each name here is written exactly once in the library, as one line at its step (``failpoint("engine.apply")``,
or ``failpoints.each(backend, "engine.park")`` for a step that writes frame by frame through a backend):
``tests/test_failpoints.py`` reads the sources and checks that the two sets are the same, so a new step of the
protocol gets its failpoint, and its row here, the day it is written. ``dcr-ray chaos --enumerate`` fires
each one (:mod:`benchmarks.chaos_matrix`).

``trigger`` says what a refit needs for the point to be reached:

==============  ===============================================================================================
``refit``       any refit (a quiet one)
``retry``       a refit whose first attempt fails after the engines wrote (abort, rollback, relay repair run)
``abandon``     a refit whose every attempt fails (the owners discard, engines are restored)
``restart``     the coordinator restarts before the refit (it resumes from the record and re-wires the relays)
``respawn``     an engine died before the refit: it is re-created and heals from a peer after the commit
``lag``         an engine missed a refit (drained), then rejoins: it replays the deltas it missed
``evict``       an engine hung past the stage timeout in the refit before: this refit readmits it
``bootstrap``   a dense bootstrap of an engine by the owners (``CoordinatorActor.bootstrap_dense``)
==============  ===============================================================================================

``repeats``: hit more than once per refit in one process (per frame, per child, per engine), so a fault may
land mid-stream; ``modes`` / ``transports``: the apply modes and transports whose refits reach it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["owner", "relay", "engine", "coordinator"]
Trigger = Literal["refit", "retry", "abandon", "restart", "respawn", "lag", "evict", "bootstrap"]
BOTH_MODES = ("in_place", "staged")
BOTH_TRANSPORTS = ("relay", "object_store")


@dataclass(kw_only=True, slots=True, frozen=True)
class Point:
    name: str
    role: Role
    """The kind of process that hits it (``owner``: the trainer actor that holds the owner)."""
    step: str
    """What the process is about to do (or just did) when it hits the point."""
    trigger: Trigger = "refit"
    repeats: bool = False
    modes: tuple[str, ...] = BOTH_MODES
    transports: tuple[str, ...] = BOTH_TRANSPORTS


def _points(*rows: Point) -> dict[str, Point]:
    return {p.name: p for p in rows}


RELAY_ONLY = ("relay",)
STORE_ONLY = ("object_store",)

#: Every failpoint, by name.
POINTS: dict[str, Point] = _points(
    # -- owners: diff, stream, promote ------------------------------------------------------------------
    Point(name="owner.stream", role="owner", step="a stream call begins (before the diff or the retry's re-send)"),
    Point(name="owner.diff", role="owner", step="after the diff read every tensor of the trainer"),
    Point(name="owner.send.before", role="owner", step="before each frame is handed to the transport",
          repeats=True),
    Point(name="owner.send.after", role="owner", step="after each frame was handed to the transport",
          repeats=True),
    Point(name="owner.drain", role="owner", step="before waiting for the transport to take every frame"),
    Point(name="owner.promote", role="owner", step="before the committed changed set is promoted"),
    Point(name="owner.promote.write", role="owner", step="the promote's writes into the baseline"),
    Point(name="owner.discard", role="owner", step="before an abandoned changed set is dropped",
          trigger="abandon"),
    Point(name="owner.bootstrap", role="owner", step="before a dense bootstrap stream", trigger="bootstrap"),
    # -- relays: receive, forward, wiring, the window -----------------------------------------------------
    Point(name="relay.push", role="relay", step="a head relay receives a payload (before it pulls it)",
          repeats=True, transports=RELAY_ONLY),
    Point(name="relay.pulled", role="relay", step="after the payload crossed into the cluster, before fan-out",
          repeats=True, transports=RELAY_ONLY),
    Point(name="relay.forward", role="relay", step="before forwarding a payload to each child",
          repeats=True, transports=RELAY_ONLY),
    Point(name="relay.subforward", role="relay", step="a sub-relay receives a payload to route",
          repeats=True, transports=RELAY_ONLY),
    Point(name="relay.wire", role="relay", step="a relay is given its children (wiring)", trigger="restart",
          repeats=True, transports=RELAY_ONLY),
    Point(name="relay.keep", role="relay", step="after a commit, before the committed payloads enter the window",
          transports=RELAY_ONLY),
    Point(name="relay.release", role="relay", step="before a transfer's payload copies are dropped",
          trigger="retry", transports=RELAY_ONLY),
    Point(name="transport.wire", role="coordinator", step="before waiting for a cluster's relays to be wired",
          trigger="restart", repeats=True, transports=RELAY_ONLY),
    # -- object storage ---------------------------------------------------------------------------------
    Point(name="objstore.put", role="owner", step="before each frame is written to the store", repeats=True,
          transports=STORE_ONLY),
    Point(name="objstore.read", role="engine", step="before an engine reads a delivered frame from the store",
          repeats=True, transports=STORE_ONLY),
    Point(name="objstore.keep", role="coordinator", step="after a commit, before the committed objects enter the "
          "window", transports=STORE_ONLY),
    # -- engines: open, apply, flush, park, write-back, activate, abort, rollback, staged write, heal -------
    Point(name="engine.prepare", role="engine", step="an attempt opens (prepare)"),
    Point(name="engine.deliver", role="engine", step="a payload arrives (before it is read and validated)",
          repeats=True),
    Point(name="engine.apply", role="engine", step="before each validated frame is written in place",
          repeats=True, modes=("in_place",)),
    Point(name="engine.stage", role="engine", step="before each frame is decoded and kept for activation",
          repeats=True, modes=("staged",)),
    Point(name="engine.flush", role="engine", step="a flush begins (before it waits for the payloads)"),
    Point(name="engine.flush.backend", role="engine", step="every payload applied, before the backend's flush "
          "and the acknowledgement"),
    Point(name="engine.park", role="engine", step="each write that sets an applied refit aside to serve",
          repeats=True, modes=("in_place",)),
    Point(name="engine.write_back", role="engine", step="each write that puts set-aside writes back at activate",
          repeats=True, modes=("in_place",)),
    Point(name="engine.activate", role="engine", step="an activation begins (after the record)"),
    Point(name="engine.staged_write", role="engine", step="each staged frame written at activate",
          repeats=True, modes=("staged",)),
    Point(name="engine.abort", role="engine", step="an attempt is closed (abort)", trigger="retry"),
    Point(name="engine.rollback", role="engine", step="each write of an in-place rollback from the undo record",
          trigger="retry", repeats=True, modes=("in_place",)),
    Point(name="engine.snapshot", role="engine", step="a peer hands its committed bits to a healing engine",
          trigger="respawn"),
    Point(name="engine.heal_from", role="engine", step="a healing engine loads a peer's copy", trigger="respawn"),
    Point(name="engine.catch_up", role="engine", step="before each missed delta is replayed", trigger="lag"),
    # -- the coordinator: each step of an attempt, the record, sweeps, healing, resume --------------------
    Point(name="coordinator.refit", role="coordinator", step="a refit call holds the lock, before anything"),
    Point(name="coordinator.sweep", role="coordinator", step="each sweep for lost nodes and capacity",
          repeats=True),
    Point(name="coordinator.prepare.before", role="coordinator", step="before the engines open the attempt"),
    Point(name="coordinator.prepare.after", role="coordinator", step="after every engine opened the attempt"),
    Point(name="coordinator.stream.before", role="coordinator", step="before the owners stream"),
    Point(name="coordinator.stream.after", role="coordinator", step="after every owner streamed"),
    Point(name="coordinator.flush.before", role="coordinator", step="before the engines flush"),
    Point(name="coordinator.flush.after", role="coordinator", step="after every engine acknowledged"),
    Point(name="coordinator.record.before", role="coordinator", step="before the commit record is written"),
    Point(name="coordinator.record.after", role="coordinator", step="after the commit record is durable"),
    Point(name="coordinator.promote", role="coordinator", step="before the owners promote and engines activate"),
    Point(name="coordinator.activate.before", role="coordinator", step="before waiting for the activations"),
    Point(name="coordinator.activate.after", role="coordinator", step="after the activations answered"),
    Point(name="coordinator.keep", role="coordinator", step="before the committed payloads enter the windows"),
    Point(name="coordinator.abort", role="coordinator", step="before a failed attempt is closed on the engines",
          trigger="retry"),
    Point(name="coordinator.repair", role="coordinator", step="before dead relays are re-created between attempts",
          trigger="retry"),
    Point(name="coordinator.discard", role="coordinator", step="before the owners drop an abandoned changed set",
          trigger="abandon"),
    Point(name="coordinator.restore", role="coordinator", step="before engines an abandoned refit left dirty are "
          "restored", trigger="abandon"),
    Point(name="coordinator.readmit", role="coordinator", step="an evicted engine answered again: before it is "
          "readmitted", trigger="evict"),
    Point(name="coordinator.heal.recreate", role="coordinator", step="before a dead engine is re-created",
          trigger="respawn"),
    Point(name="coordinator.heal.round", role="coordinator", step="each healing round of an engine",
          trigger="respawn"),
    Point(name="coordinator.heal.join", role="coordinator", step="a healed engine joins the required set",
          trigger="respawn"),
    Point(name="coordinator.resume", role="coordinator", step="a restarted coordinator fenced the record, before "
          "it finds the actors", trigger="restart"),
    Point(name="coordinator.resume.owners", role="coordinator", step="a resume settled the owners, before the "
          "engines", trigger="restart"),
    Point(name="coordinator.resume.engine", role="coordinator", step="a resume settles each engine's open transfer",
          trigger="restart", repeats=True),
    Point(name="coordinator.bootstrap", role="coordinator", step="before a dense bootstrap's engines open",
          trigger="bootstrap"),
)

ROLES: tuple[str, ...] = ("owner", "relay", "engine", "coordinator")
