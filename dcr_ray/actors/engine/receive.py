"""The refit protocol on the engine side: prepare, deliver, flush, activate, abort.

One transfer (version v -> v+1) as the engine sees it::

    prepare(T, a, base=v, target=v+1)   open attempt a of T (the engine holds v, of the content the
                                        frames must be built on); OPEN, or STAGING when staged
    deliver(frame of T/a)               the digest first (outside the engine's lock: generation goes on),
                                        then every byte of it validated and decoded;
                                        in place: written now (the first write waits for generation
                                        to stop reading the weights); staged: kept decoded, the engine
                                        serves v meanwhile; journaled by payload key
    flush(T, a, expected keys)          every expected payload applied (in place: the backend's flush
                                        makes the writes visible) or staged; acknowledge
    activate(v+1)                       after the commit record: staged frames are written now (the
                                        serving pause: the writes and the backend's flush only); the
                                        engine holds v+1, serving resumes. An in-place engine that
                                        waited past ``EngineConfig.hold_s`` after its flush had set
                                        its writes aside and served v meanwhile: they go back now
                                        (:mod:`~dcr_ray.actors.engine.park`)
    abort(T, final)                     leave the attempt; final: roll back in place (the undo record),
                                        else hold no version

Frames of another transfer or attempt are *stale* and ignored; a frame that fails validation is
rejected before any write and fails the attempt's flush with its error; a payload key seen again with
the same digest is a duplicate (Ray may deliver a call twice), with other bytes an error.

Staging (``EngineConfig(apply="staged")``): a delivered frame is validated and decoded *outside* the
engine's lock, so generation and other deliveries go on beside it, and kept decoded (positions and
values, class-order positions resolved against the bits the engine serves, which nothing writes before
the commit; bounded by ``staging_budget_bytes``). The flush acknowledges that everything is staged; the
frames are written at ``activate``, once the commit record is durable, so the pause holds only the
scatter and the backend's flush, and a transfer abandoned before its commit wrote nothing (no undo
record, no rollback). A backend that forwards wire frames to a runtime of its own (vLLM workers, adopted
engines) gets them at once: they land in the runtime's staging copy, not in what it serves, and its
flush (vLLM's reload), at activate, is the pause.
"""

from __future__ import annotations

import time

from dcr_ray import failpoints, metrics
from dcr_ray.actors.engine.attempt import Attempt
from dcr_ray.actors.engine.context import EngineContext, log
from dcr_ray.actors.engine.park import Parking
from dcr_ray.actors.engine.state import Phase
from dcr_ray.codec import DIGEST_SIZE, PayloadKey, open_frame
from dcr_ray.codec.format import BOOTSTRAP_BASE
from dcr_ray.engines.base import TensorBackend
from dcr_ray.errors import EngineStateError, FrameError, RefitError, RefitTimeoutError, StagingBudgetError
from dcr_ray.failpoints import failpoint


def _decoded_bytes(frame) -> int:
    """Memory a decoded frame holds (its position, value and rank arrays), for the staging budget."""
    arrays = [a for it in frame.items for a in (it.positions, it.values, it.ranks)]
    arrays += [a for p in frame.packs for a in (p.offsets, p.positions, p.values)]
    return max(sum(int(a.nbytes) for a in arrays if a is not None), int(frame.raw_bytes))


class Receiver:
    """``prepare`` / ``deliver`` / ``flush`` / ``activate`` / ``abort`` of one engine (see the module doc)."""

    def __init__(self, ctx: EngineContext):
        self._engine = ctx
        #: (key, decoded frame, class counts to renew after its write), written at activate
        self._staged: list[tuple[PayloadKey, object, list]] = []
        self._staged_bytes = 0
        self._forwarded: str | None = None  # staged transfer whose frames a wire backend already holds
        self._parking = Parking(ctx)  # flushed in-place writes set aside while the commit waits on others
        self._apply_s = 0.0
        self._bytes = 0
        self._raw = 0  # decompressed bytes of the frames validated in this attempt (progress)

    # -- protocol -----------------------------------------------------------------------------------
    def prepare(self, transfer: str, attempt: int, base: int, target: int, base_id: str | None = None) -> dict:
        """Open attempt ``(transfer, attempt)``; checks that this engine holds ``base`` and, when
        ``base_id`` is given, that it holds that content (the transfer that produced ``base``): its
        frames are then refused unless built on exactly that content."""
        failpoint("engine.prepare")
        c = self._engine
        st = c.state
        with c.lock:
            if st.written is not None and st.written != transfer:
                # it holds writes of another transfer that was never rolled back or committed: no delta
                # may build on them; a dense bootstrap replaces them, so it may start, from no version
                if base != BOOTSTRAP_BASE:
                    raise EngineStateError(
                        f"engine {c.engine_id} holds in-place writes of transfer {st.written} that was "
                        f"neither committed nor rolled back; abort({st.written!r}, final=True) first")
                c.mark_dirty(f"transfer {st.written} wrote into it and was never settled")
            if base != BOOTSTRAP_BASE and st.why is not None:
                raise EngineStateError(f"engine {c.engine_id} holds no version ({st.why}); "
                                       f"it must be bootstrapped (dense) first: Refit.rejoin({c.engine_id!r})")
            if base != BOOTSTRAP_BASE and c.state.version != base:
                raise EngineStateError(
                    f"engine {c.engine_id} holds version {c.state.version}, the transfer needs {base}; "
                    f"it must be bootstrapped (dense) before it can take deltas")
            if base != BOOTSTRAP_BASE and base_id is not None and st.version_id != base_id:
                raise EngineStateError(
                    f"engine {c.engine_id} holds version {base} of content {st.version_id!r}, the "
                    f"transfer is built on {base_id!r}: another lineage with the same version number; it "
                    f"must be bootstrapped (dense) before it can take deltas")
            staged = c.staged and base != BOOTSTRAP_BASE
            if base != BOOTSTRAP_BASE and not staged:
                c.pause.begin(transfer, "in_place")  # frames land in live weights as they arrive
            if not st.is_in(transfer, attempt):
                if not st.is_in(transfer):
                    c.applied.clear()
                st.open(Attempt(transfer, attempt, base, target, None if base == BOOTSTRAP_BASE else base_id),
                        staged=staged)
                self._staged, self._staged_bytes = [], 0
                self._parking.drop()
                self._apply_s, self._bytes, self._raw = 0.0, 0, 0
            return {"engine": c.engine_id, "version": st.version}

    def deliver(self, payload, targets: list[str] | None = None) -> str:
        """Validate and apply (or stage) one payload of the open attempt; returns ``applied`` (applied or
        staged), ``duplicate``, ``stale``, ``rejected`` or ``skipped`` (addressed to other engines)."""
        c = self._engine
        if targets is not None and c.engine_id not in targets:
            return "skipped"
        c.cpu.totals["calls"] += 1
        return c.cpu.timed("deliver", self._deliver, payload)

    def _deliver(self, payload) -> str:
        failpoint("engine.deliver")
        c = self._engine
        try:
            data = c.reader.read(payload)
        except Exception as e:  # an unreadable payload fails this attempt's flush, as a bad frame does
            with c.lock:
                c.state.fail(RefitError(f"engine {c.engine_id}: reading a payload failed: {e!r}"))
                self._counted("rejected")
            return "rejected"
        try:  # the digest is checked outside the lock: generation is admitted and answered meanwhile
            opened, bad = c.cpu.timed("open", open_frame, data, key=c.config.codec.key), None
        except FrameError as e:
            opened, bad = None, e
        with c.lock:
            status, header, cur = self._admit(data, opened, bad)
            if status is not None or not self._decode_ahead(cur):
                if status is None:
                    status = self._apply_now(data, header, cur)
                return self._counted(status)
        # staged: validated and decoded outside the lock (generation and other deliveries go on)
        t0 = time.perf_counter()
        try:
            failpoint("engine.stage")
            frame = c.decode(header, cur)
            renew = c.prepare_ahead(frame)
            error = None
        except FrameError as e:
            frame, error = None, e
        except Exception as e:  # a decoder failure must fail the attempt now, not time out its flush
            frame, error = None, RefitError(f"engine {c.engine_id}: decoding payload {header.meta.key} failed: {e!r}")
        with c.lock:
            return self._counted(self._stage(data, header, cur, (frame, renew) if error is None else None, error,
                                             time.perf_counter() - t0))

    def _counted(self, status: str) -> str:
        c = self._engine
        c.stats[status] = c.stats.get(status, 0) + 1
        c.lock.notify_all()
        if status in ("applied", "rejected"):
            metrics.record(f"engine_{status}", tags=c.tags)
        return status

    def _admit(self, data: bytes, header, bad: FrameError | None):
        """Under the lock: is this payload (``header``: its opened frame, digest checked; ``bad``: why it
        would not open) for the open attempt, new, within the budget? Returns ``(status, header,
        attempt)``; a status is final (the payload is not applied)."""
        c = self._engine
        st = c.state
        if st.attempt is None:
            st.fail_first(EngineStateError(
                f"engine {c.engine_id} got a payload before prepare(): not part of an open transfer"))
            return "rejected", None, None
        if bad is not None:
            st.fail(bad)
            return "rejected", None, None
        cur = st.attempt
        meta = header.meta
        if (meta.transfer, meta.attempt) != (cur.transfer, cur.attempt):
            return "stale", None, None
        dg = bytes(data[-DIGEST_SIZE:])
        if meta.key in c.applied:
            if c.applied[meta.key] != dg:
                st.fail(FrameError(f"payload {meta.key} arrived twice with different bytes"))
                return "rejected", None, None
            return "duplicate", None, None
        return None, header, cur

    def _decode_ahead(self, cur: Attempt) -> bool:
        """Whether this attempt's frames are decoded outside the lock and kept for the flush (staged deltas
        into a backend that holds tensors; wire backends get their frames at once)."""
        c = self._engine
        return c.staged and cur.base != BOOTSTRAP_BASE and isinstance(c.backend, TensorBackend)

    def _apply_now(self, data: bytes, header, cur: Attempt) -> str:
        """Under the lock: validate, then write (in place) or forward (a wire backend's staged frame)."""
        c = self._engine
        st = c.state
        key = header.meta.key
        t0 = time.perf_counter()
        try:
            frame = c.decode(header, cur)
            if c.staged and cur.base != BOOTSTRAP_BASE:  # a wire backend stages in its own runtime
                c.write(data, frame)
                self._forwarded = cur.transfer
            else:
                c.quiesce()  # no generation reads the weights while they change
                st.wrote()
                t_w = time.perf_counter()
                failpoint("engine.apply")
                c.write(data, frame)
                c.pause.applied(time.perf_counter() - t_w)
        except FrameError as e:
            st.fail(e)
            return "rejected"
        except Exception as e:  # a backend failure must fail the attempt now, not time out its flush
            st.fail(RefitError(f"engine {c.engine_id}: applying payload {key} failed: {e!r}"))
            return "rejected"
        self._took(key, data, frame, time.perf_counter() - t0)
        return "applied"

    def _stage(self, data: bytes, header, cur: Attempt, prepared, error, seconds: float) -> str:
        """Under the lock: keep a frame decoded (and its class-order positions resolved) outside it, if its
        attempt is still open. ``prepared``: ``(frame, class counts to renew after its write)``."""
        c = self._engine
        st = c.state
        key = header.meta.key
        if not st.is_in(cur.transfer, cur.attempt):
            return "stale"  # the attempt closed while the frame decoded
        if error is not None:
            st.fail(error)
            return "rejected"
        if key in c.applied:  # the same payload delivered twice, both decoded at once
            return "duplicate"
        frame, renew = prepared
        size = _decoded_bytes(frame)
        budget = c.config.engines.staging_budget_bytes
        if self._staged_bytes + size > budget:
            st.fail(StagingBudgetError(
                f"engine {c.engine_id}: staging payload {key} ({size} bytes decoded) would hold "
                f"{self._staged_bytes + size} bytes, over EngineConfig.staging_budget_bytes={budget}: raise the "
                f"budget or use EngineConfig(apply='in_place')"))
            return "rejected"
        self._staged.append((key, frame, renew))
        self._staged_bytes += size
        self._took(key, data, frame, seconds)
        return "applied"

    def _took(self, key, data: bytes, frame, seconds: float) -> None:
        self._apply_s += seconds
        self._bytes += len(data)
        self._raw += frame.raw_bytes
        self._engine.applied[key] = bytes(data[-DIGEST_SIZE:])

    def flush(self, transfer: str, attempt: int, expected: list[tuple], timeout_s: float) -> dict:
        """Wait until every expected payload is applied (or staged), write what was staged, flush the
        backend, acknowledge."""
        failpoint("engine.flush")
        c = self._engine
        want = {PayloadKey(*k) for k in expected}
        deadline = time.monotonic() + timeout_s
        st = c.state
        with c.lock:
            while True:
                if not st.is_in(transfer, attempt):
                    raise EngineStateError(f"engine {c.engine_id}: flush for an attempt it is not in")
                if st.error is not None:
                    raise st.error
                missing = want - c.applied.keys()
                if not missing:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RefitTimeoutError(
                        f"engine {c.engine_id}: {len(missing)} of {len(want)} payloads not applied "
                        f"within {timeout_s:.0f} s, e.g. {sorted(missing)[:3]}")
                c.lock.wait(min(left, 1.0))
            t0 = time.perf_counter()
            failpoint("engine.flush.backend")
            if not (self._staged or self._forwarded == transfer):
                c.backend.flush()  # in place: the writes are visible to the runtime now
            st.flushed_now()  # staged: every frame validated and decoded, written at activate
            c.pause.flushed()
            self._parking.after_flush(transfer, attempt)  # past hold_s it serves while the refit waits
            self._apply_s += time.perf_counter() - t0
            metrics.record("engine_apply_seconds", self._apply_s, tags=c.tags)
            return {"engine": c.engine_id, "cluster": c.cluster, "applied": len(want),
                    "apply_s": self._apply_s, "bytes": self._bytes}

    def activate(self, version: int, transfer: str | None = None, version_id: str | None = None) -> int:
        """Make ``version`` current (after the commit record is written). Idempotent.

        ``version_id`` names its content (the commit record's ``transfer``); it defaults to ``transfer``,
        which is right for a delta transfer (a dense bootstrap passes the record's id). Refused
        (:class:`~dcr_ray.errors.EngineStateError`, nothing changes) unless this engine flushed
        ``transfer``'s open attempt, or already holds ``version`` of that content: an engine whose bits
        match no version (dirty), or that left the transfer before its flush, is never activated; it
        heals."""
        failpoint("engine.activate")
        c = self._engine
        renew = []
        want_id = version_id if version_id is not None else transfer
        with c.lock:
            st = c.state
            if transfer is not None and not st.is_in(transfer):
                if st.settled and (st.version, st.version_id) == (version, want_id):
                    return version  # a repeated call
                raise EngineStateError(
                    f"engine {c.engine_id}: activate(v{version}, {transfer}) refused: it is not in that transfer "
                    f"({st!r}{', its bits match no version' if st.why else ''}); it heals instead")
            if transfer is not None and st.flushed != (transfer, st.attempt.attempt):
                raise EngineStateError(
                    f"engine {c.engine_id}: activate(v{version}, {transfer}) refused: attempt {st.attempt.attempt} "
                    f"of it was never flushed here ({st!r}); it heals instead")
            if transfer is None or st.is_in(transfer):
                if transfer is not None and c.state.phase is Phase.PARKED:
                    self._parking.write_back(transfer)
                if transfer is not None and (self._staged or self._forwarded == transfer):
                    renew = self._write_staged(transfer)
                self._forwarded = None
                c.become_ready(version, version_id if version_id is not None else transfer)
                if transfer is not None:
                    c.pause.end(transfer, "activated", version)
            held = c.state.version
        c.renew_counts(renew)  # serving again: the counts are a hint for the next refit's walk
        return held

    def _write_staged(self, transfer: str) -> list:
        """The staged frames of the committed ``transfer`` into the weights: the serving pause holds only
        these writes and the backend's flush (a wire backend's runtime reloads what its frames touched).
        They are written only once committed, so they keep no undo record; a write that fails leaves the
        engine holding no version (it heals, as an engine that failed to activate does)."""
        c = self._engine
        c.pause.begin(transfer, "staged")
        c.state.wrote()  # generation waits from here to the end of activate
        c.quiesce()
        t0 = time.perf_counter()
        renew = []
        try:
            for _key, frame, counts in sorted(self._staged, key=lambda kfr: kfr[0]):
                failpoint("engine.staged_write")
                c.backend.apply(frame)
                renew += counts
            c.backend.flush()
        except Exception as e:
            self._staged, self._staged_bytes = [], 0
            c.mark_dirty(f"writing the staged frames of the committed transfer {transfer} failed ({e!r})")
            c.pause.end(transfer, "abandoned", None)
            raise EngineStateError(f"engine {c.engine_id}: {c.state.why}") from e
        self._staged, self._staged_bytes = [], 0
        seconds = time.perf_counter() - t0
        c.pause.applied(seconds)
        self._apply_s += seconds
        return renew

    def abort(self, transfer: str, final: bool = False) -> dict:
        """Leave the open attempt of ``transfer``; its next attempt re-prepares.

        Between attempts (``final=False``) an engine that keeps an undo record of the transfer's writes
        rolls them back in place and serves its committed version until the next attempt's prepare: a
        refit that retries (a node lost elsewhere, a slow cluster) does not keep it paused. An engine
        without one keeps the bits and stays paused: the next attempt OVERWRITEs the whole changed set,
        which repairs them. With ``final=True`` the transfer is abandoned: an engine
        with an undo record of every write it made (:mod:`~dcr_ray.codec.decoding.undo`) rolls back in place and
        keeps its committed version; otherwise the bits it wrote belong to no version, so it holds none
        (``dirty``), refuses deltas and generation, and must be bootstrapped densely (the coordinator
        does it). Frames a wire backend holds staged are dropped unapplied.
        """
        failpoint("engine.abort")
        c = self._engine
        st = c.state
        with c.lock:
            if st.parked == transfer and st.is_in(transfer):  # its writes are already out of the weights
                st.close(transfer)
                self._parking.drop()
                c.pause.end(transfer, "rolled back", st.version)
                c.lock.notify_all()
                return {"engine": c.engine_id, "dirty": False, "rolled_back": True}
            if st.is_in(transfer):
                st.close(transfer)
                self._staged, self._staged_bytes = [], 0
            if final and self._forwarded == transfer and st.written != transfer:
                self._forwarded = None
                self._abandon_forwarded(transfer)
            between = not final and st.written == transfer and c.undo.transfer == transfer
            if (final or between) and st.written == transfer and self._rolled_back(transfer):
                st.rolled_back()
                c.count("rollbacks")
                c.pause.end(transfer, "rolled back", st.version)
                c.lock.notify_all()
                return {"engine": c.engine_id, "dirty": False, "rolled_back": True}
            if final and st.written == transfer:
                c.mark_dirty(f"transfer {transfer} was abandoned after writing into this engine's weights in place")
                c.pause.end(transfer, "abandoned", None)
            elif final:
                c.pause.end(transfer, "rolled back", st.version)  # nothing was written: serving went on
            c.lock.notify_all()
            return {"engine": c.engine_id, "dirty": st.why is not None}

    def _abandon_forwarded(self, transfer: str) -> None:
        """A wire backend holds staged frames of an abandoned transfer: its runtime drops them (what it
        serves never changed); if it cannot, the engine holds no version."""
        c = self._engine
        try:
            c.backend.abandon()
        except Exception as e:
            c.mark_dirty(f"the frames of transfer {transfer} staged in its runtime could not be dropped ({e!r})")

    def _rolled_back(self, transfer: str) -> bool:
        """Undo ``transfer``'s in-place writes: from this engine's undo record, or with the undo record
        the backend keeps itself (vLLM's workers do); False when neither can (the engine goes dirty)."""
        c = self._engine
        try:
            if c.undo.transfer == transfer:
                c.undo.rollback(failpoints.each(c.backend, "engine.rollback"))
                return True
            return c.config.engines.rollback == "in_place" and c.backend.rollback() is True
        except Exception as e:  # dirty then: the coordinator re-bootstraps densely
            c.undo.clear()
            log.warning("engine %s: in-place rollback failed (%r)", c.engine_id, e)
            return False

    def progress(self) -> dict:
        """Lock-free counters of the open attempt (for progress bars; may be a moment stale): its
        transfer, the payloads applied and their decompressed bytes."""
        cur = self._engine.state.attempt
        return {"transfer": cur.transfer if cur else None, "payloads": len(self._engine.applied), "raw_bytes": self._raw}

    def stats(self) -> dict:
        """The last (or open) attempt's figures, as its flush acknowledged them: ``apply_s`` (validate,
        decode, write and the backend's flush), ``bytes`` (wire bytes of its payloads), ``raw_bytes``
        (decompressed)."""
        return {"apply_s": self._apply_s, "bytes": self._bytes, "raw_bytes": self._raw}
