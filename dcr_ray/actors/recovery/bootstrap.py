"""The dense bootstrap: engines that hold nothing usable get the committed version from the owners.

Used at start-up (every engine), after an abandoned refit (engines that could not roll back in
place, :mod:`~dcr_ray.actors.coordinator.membership`) and by healing when no peer and no catch-up window can hand
the version over (:mod:`~dcr_ray.actors.recovery.healing`). Protocol, one bootstrap transfer
``boot<v>-<id>``::

    digest check   adopted engines that already serve v (their backend matches the owners' box
                   digests) join as they are, without frames
    prepare        every other engine opens (transfer, 0) from no version (``BOOTSTRAP_BASE``)
    stream         every owner sends its committed bits densely through the transport
    flush          every engine ACKs having applied all payload keys
    activate       every engine holds v (its content id: the record's transfer) and joins ``required``

Any failure leaves those engines holding no version (aborted final) and raises; the caller decides.
The caller holds the coordinator's lock (the owners stream their committed baseline, which a refit's
promote would replace under the stream). Every wait watches the nodes: an engine or owner whose node is
gone, or a relay on such a node, fails it at once; a heal passes the stage timeout as its bound, so the
lock is never held longer than one stage (start-up and a rejoin allow ``start_timeout_s``).
"""

from __future__ import annotations

import logging
import uuid

from dcr_ray.actors.fleet.calls import get_all
from dcr_ray.actors.fleet.state import CoordinatorState
from dcr_ray.codec.format import BOOTSTRAP_BASE
from dcr_ray.failpoints import failpoint

log = logging.getLogger("dcr_ray")


class Bootstrap:
    """Dense bootstrap of engines to the committed version (see the module doc)."""

    def __init__(self, state: CoordinatorState):
        self._shared = state

    def dense(self, engine_ids: list[str], *, timeout_s: float | None = None) -> int:
        """Dense refit of ``engine_ids`` to the committed version (they join the required set); adopted
        engines that show by digest that they already serve it join as they are. Returns the payload
        bytes the owners sent. Each step waits at most ``timeout_s`` (default ``start_timeout_s``)."""
        s = self._shared
        engine_ids = self._join_by_digest(engine_ids)
        if not engine_ids:
            return 0
        t = s.config.commit.start_timeout_s if timeout_s is None else timeout_s
        engines, transport = s.engines, s.transport
        by_engine, by_owner = s.lost("engine"), s.lost("owner")
        transfer = f"boot{s.version}-{uuid.uuid4().hex[:8]}"
        s.set_phase("bootstrap", transfer, 0, s.version)
        s.progress_total = s.model_bytes * len(engine_ids) if s.model_bytes else None
        try:
            failpoint("coordinator.bootstrap")
            get_all({e: engines[e].prepare.remote(transfer, 0, BOOTSTRAP_BASE, s.version, epoch=s.incarnation(e))
                     for e in engine_ids}, t, "bootstrap prepare", by_engine)
            sink = transport.sink(engine_ids, sorted(s.required))
            sums = get_all({o: h.bootstrap(transfer, sink) for o, h in s.owners.items()}, t,
                           "bootstrap stream", by_owner, s.relays_lost)
            keys = [k for x in sums.values() for k in x["payloads"]]
            get_all({e: engines[e].flush.remote(transfer, 0, keys, t, epoch=s.incarnation(e)) for e in engine_ids}, t,
                    "bootstrap flush", by_engine, s.relays_lost)
            get_all({e: engines[e].activate.remote(s.version, transfer, s.last_transfer(), epoch=s.incarnation(e))
                     for e in engine_ids}, t, "bootstrap activate", by_engine)
        except BaseException:
            # engines a failed bootstrap wrote into hold no version until a later bootstrap succeeds
            for e in engine_ids:
                engines[e].abort.remote(transfer, True)
            transport.release(transfer)
            s.progress_total = None  # no bar counts toward a phase that is over
            raise
        transport.release(transfer)
        s.progress_total = None
        s.standings.require(engine_ids)
        log.info("dcr_ray: bootstrapped %d engines densely at version %d", len(engine_ids), s.version)
        return sum(x["wire_bytes"] for x in sums.values())

    def _join_by_digest(self, engine_ids: list[str]) -> list[str]:
        """Adopted engines among ``engine_ids`` whose served tensors have the owners' committed box
        digests join the required set without dense frames; returns the engines still to bootstrap.
        Any failure of the check leaves every engine to the dense bootstrap."""
        s = self._shared
        adopted = [e for e in engine_ids if s.topology.is_adopted(e)]
        if not adopted:
            return engine_ids
        t = s.config.commit.timeout_s
        try:
            digests: dict = {}
            for d in get_all({o: h.digests() for o, h in s.owners.items()}, t,
                             "bootstrap digests").values():
                digests.update(d)
            joined = get_all({e: s.engines[e].join_by_digest.remote(s.version, digests, s.last_transfer())
                              for e in adopted}, t, "bootstrap digest check")
        except Exception as e:
            log.warning("dcr_ray: digest check of adopted engines %s failed (%r); bootstrapping densely", adopted, e)
            return engine_ids
        ok = sorted(e for e, j in joined.items() if j)
        s.standings.require(ok)
        if ok:
            log.info("dcr_ray: %s already serve version %d (digests match): joined without a dense bootstrap",
                     ok, s.version)
        return [e for e in engine_ids if e not in ok]
