"""What an engine's parts share: one object, handed to each part in its constructor.

The engine actor (:mod:`~dcr_ray.actors.engine.actor`) is composed of parts, as the coordinator is: the refit
protocol (:mod:`~dcr_ray.actors.engine.receive`), serving (:mod:`~dcr_ray.actors.engine.serving`), digest
membership (:mod:`~dcr_ray.actors.engine.digests`), the copy from a peer (:mod:`~dcr_ray.actors.engine.peer_copy`)
and the catch-up by missed deltas (:mod:`~dcr_ray.actors.engine.catchup`). Each owns its own state and
reaches the shared state only through this object, whose methods are the steps more than one part
takes, written once:

- :meth:`EngineContext.become_ready`: the engine holds committed version v of content id (after a
  commit, a digest match, a verified copy, a replayed delta);
- :meth:`EngineContext.mark_dirty`: its bits match no version;
- :meth:`EngineContext.decode` and :meth:`EngineContext.write`: the one path from a validated frame into
  the backend (with the undo record of the transfer in flight);
- :meth:`EngineContext.quiesce`: wait until no generation reads the weights, before the first write: the
  decoding steps in progress (``EngineConfig(switch="in_flight")``, :mod:`~dcr_ray.actors.engine.switch`),
  or every generate call running (``"drain"``).

Invariants: ``state`` changes only through :class:`~dcr_ray.actors.engine.state.EngineState`'s
transitions, under ``lock``; ``serving`` counts the generate calls running now and ``stepping`` the
decoding steps reading the weights now; no write starts while the one its switch mode waits for is above
zero; the journal (``applied``) names the payloads of the open transfer
that were applied or staged, with their digests.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dcr_ray import metrics
from dcr_ray.actors.engine.attempt import Attempt
from dcr_ray.actors.engine.pause import PauseClock
from dcr_ray.actors.engine.state import EngineState
from dcr_ray.codec import PayloadKey, decode_frame
from dcr_ray.codec.decoding import context
from dcr_ray.codec.decoding.undo import UndoLog
from dcr_ray.codec.format import BOOTSTRAP_BASE
from dcr_ray.config import RefitConfig
from dcr_ray.engines.base import EngineBackend, TensorBackend, WireBackend
from dcr_ray.errors import EngineStateError

log = logging.getLogger("dcr_ray.actors.engine.actor")


def _counters() -> dict[str, int]:
    return {"applied": 0, "duplicate": 0, "stale": 0, "rejected": 0, "rollbacks": 0}


class CpuParts:
    """Thread CPU seconds of the engine's payload path, always counted (two clock reads per part and frame):
    ``deliver`` (a payload's whole validate-and-apply once its bytes arrived) and its parts ``open`` (digest
    and header), ``decode`` and ``apply`` (the writes), with ``calls`` (payloads delivered)."""

    def __init__(self):
        self.totals = {"deliver": 0.0, "open": 0.0, "decode": 0.0, "apply": 0.0, "calls": 0}

    def timed(self, part: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, its thread CPU seconds added to ``part``."""
        t = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            self.totals[part] += time.thread_time() - t


@dataclass(eq=False)
class EngineContext:
    """One engine's backend, phase and journal, and the lock that orders every change of them."""

    engine_id: str
    cluster: str
    config: RefitConfig
    backend: EngineBackend
    reader: Any  #: the transport's engine side: what ``deliver`` is given -> frame bytes
    specs: dict  #: canonical name -> (wire dtype, shape), what every frame is validated against
    state: EngineState = field(default_factory=EngineState)
    lock: threading.Condition = field(default_factory=threading.Condition)
    applied: dict[PayloadKey, bytes] = field(default_factory=dict)  #: journal of the open transfer -> digest
    undo: UndoLog = field(default_factory=UndoLog)  #: inverse of the in-place writes of the transfer in flight
    stats: dict = field(default_factory=_counters)
    pause: PauseClock = field(default_factory=PauseClock)  #: when generation could not serve, per refit
    serving: int = 0  #: generate calls running now (a draining write starts only at 0)
    stepping: int = 0  #: decoding steps reading the weights now (no write starts while > 0)
    quiescing: bool = False  #: a write waits for the steps in progress: no new one enters
    held: str | None = None  #: generation held for an operation outside the refit protocol (its label)
    held_drains: bool = False  #: that hold waits for the generate calls running (their steps go on meanwhile)
    cpu: CpuParts = field(default_factory=CpuParts)  #: thread CPU seconds of the payload path
    epoch: int | None = None  #: this incarnation's epoch (None: calls are not fenced)

    @property
    def tags(self) -> dict[str, str]:
        """The tags of every metric this engine records."""
        return {"cluster": self.cluster, "engine": self.engine_id}

    @property
    def staged(self) -> bool:
        """Whether deltas are staged while the engine serves (``EngineConfig.apply="staged"``)."""
        return self.config.engines.apply == "staged"

    @property
    def in_flight(self) -> bool:
        """Whether a write waits only for the decoding steps in progress (``EngineConfig.switch="in_flight"``
        and a backend that decodes through its step gate), not for the generate calls running."""
        return self.config.engines.switch == "in_flight" and self.backend.switches_in_flight

    def may_step(self) -> bool:
        """Whether a decoding step may read the weights now: they hold the committed version (the phase
        serves it, no hold is on) and no write is quiescing. Call with ``lock`` held."""
        st = self.state
        return (not st.paused and (self.held is None or self.held_drains) and not self.quiescing
                and st.why is None and st.version is not None)

    def count(self, name: str, n: int = 1) -> None:
        self.stats[name] = self.stats.get(name, 0) + n

    def fence(self, epoch: int | None, call: str) -> None:
        """Refuse ``call`` addressed to another incarnation of this engine (``epoch``: the one the caller
        means; None: any). Nothing changes."""
        if epoch is not None and epoch != self.epoch:
            raise EngineStateError(f"engine {self.engine_id}: {call} for incarnation {epoch} refused by incarnation "
                                   f"{self.epoch}: this actor was replaced, it takes no part in refits or heals")

    # -- steps several parts take ---------------------------------------------------------------------
    def become_ready(self, version: int, version_id: str | None, *, counter: str | None = None,
                     verified: bool = False) -> None:
        """Hold committed ``version`` of content ``version_id``, settled: the journal and undo record of
        the transfer that got it there are dropped, the backend tags its outputs with it, the version
        metric moves and every waiter (generation, flush) wakes. ``verified``: the bits were checked
        against the version's digests (the only way besides a dense bootstrap out of dirty bits). Call
        with ``lock`` held."""
        if verified:
            self.state.restore(version, version_id)
        else:
            self.state.activate(version, version_id)
        self.applied.clear()
        self.undo.clear()
        self.backend.activate(version)
        if counter is not None:
            self.count(counter)
        metrics.record("engine_version", version, tags=self.tags)
        self.lock.notify_all()

    def mark_dirty(self, why: str) -> None:
        """This engine's weights match no version (``why``): it refuses deltas and generation until a dense
        bootstrap or a verified copy. Its undo record and any open update of the backend's own are dropped.
        Call with ``lock`` held."""
        self.undo.clear()
        try:  # a backend with an open update of its own closes it unapplied
            self.backend.abandon()
        except Exception as e:  # dirty either way: only a dense bootstrap trusts these weights again
            log.warning("engine %s: closing the backend's open update failed (%r)", self.engine_id, e)
        self.state.dirty(why)
        self.lock.notify_all()

    def decode(self, header, attempt: Attempt):
        """Validate and decode a frame of ``attempt`` completely (nothing is written)."""
        # a frame closes once its raw size reaches the bucket, so it holds under two buckets
        return self.cpu.timed("decode", decode_frame, header, shapes=self.specs, expect_base=attempt.base,
                              expect_base_id=attempt.base_id,
                              max_raw_bytes=max(self.config.codec.bucket_bytes * 2, 1 << 20),
                              keep_packs=self.backend.applies_packs)

    def write(self, data: bytes, frame) -> None:
        """Write a validated frame (its thread CPU seconds counted as ``apply``): see :meth:`_write`."""
        self.cpu.timed("apply", self._write, data, frame)

    def _write(self, data: bytes, frame) -> None:
        """Write a validated frame: decoded into the backend (keeping the bits it replaces while an undo
        record is kept), or as wire bytes to a backend that forwards them to an engine of its own (adopted
        and vLLM engines, whose workers validate them again). Call with ``lock`` held, after :meth:`quiesce`."""
        backend = self.backend
        if isinstance(backend, WireBackend):
            backend.apply_wire(bytes(data), frame)
            return
        assert isinstance(backend, TensorBackend)
        cur = self.state.attempt
        if cur is not None and self.keeps_undo(cur):
            # the inverse is in the record before the first write, and covers each write as it lands
            backend.apply_with_undo(frame, self.undo.open(cur.transfer, frame))
            return
        backend.apply(frame)

    def keeps_undo(self, attempt: Attempt) -> bool:
        """Whether writes of ``attempt`` keep the bits they replace (in-place rollback of a delta into a
        backend that can read its tensors)."""
        backend = self.backend
        return (self.config.engines.rollback == "in_place" and attempt.base != BOOTSTRAP_BASE
                and isinstance(backend, TensorBackend) and backend.undo_tensors() is not None)

    def prepare_ahead(self, frame) -> list:
        """What of a staged frame's write only reads, done outside the lock while the engine serves the
        bits it will replace (nothing writes them before the commit): its class-order positions. Their
        class counts are renewed after the write, outside the pause: the items that need it are returned
        (their ranks set aside, so the write itself does not renew them) for :meth:`renew_counts`."""
        if not isinstance(self.backend, TensorBackend):
            return []
        context.resolve(frame.items, self.backend.tensors())
        renew = [(it, it.ranks) for it in frame.items if it.ranks is not None]
        for it, _ in renew:
            it.ranks = None
        return renew

    def renew_counts(self, renew: list) -> None:
        """The kept class counts of staged class-order items, from the bits now written (a hint for the
        next refit's walk, never trusted: called after the pause, without the lock)."""
        if not renew or not isinstance(self.backend, TensorBackend):
            return
        for it, ranks in renew:
            it.ranks = ranks
        context.written([it for it, _ in renew], self.backend.tensors())

    def quiesce(self, drain: bool | None = None) -> None:
        """Wait until no generation reads the weights: in flight, until the decoding steps in progress end
        (new ones wait from here; the requests they belong to resume after the write), else (``drain``, or
        a backend without a step gate) until every generate call running has answered (new ones wait while
        the engine is paused). Call with ``lock`` held; it is released while waiting. The wait is serving
        (those steps and calls read the old bits), not pause: an open pause keeps it apart."""
        drain = not self.in_flight if drain is None else drain or not self.in_flight
        if not (self.serving if drain else self.stepping):
            return
        t = time.perf_counter()
        self.quiescing = not drain
        try:
            while self.serving if drain else self.stepping:
                self.lock.wait(1.0)
        finally:
            self.quiescing = False
        self.pause.inflight(time.perf_counter() - t)
