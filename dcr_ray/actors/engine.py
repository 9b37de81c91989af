"""Engine actors: validate and apply payloads in place, journal them, acknowledge at flush.

State machine of one engine (all transitions under one lock, so an apply in progress finishes
before the next ``prepare`` returns: a stale attempt's writes cannot land after a retry starts; its
phases, the data each carries and every transition: :mod:`~dcr_ray.actors.engine_state`)::

    idle(v) --prepare(T, a, base=v, target=v+1)--> receiving(T, a)
    receiving --deliver(frame of T/a)--> validate all -> apply -> journal (T, a, producer, payload)
    receiving --flush(T, a, expected payload keys)--> waits until all applied -> backend.flush() -> ACK
    receiving --activate(v+1)--> idle(v+1)            (only after the commit record is written)

* Frames of another transfer/attempt are *stale* and ignored; frames that fail validation are
  rejected before any write and the rejection fails this attempt's flush with the frame's error.
* A payload key seen again with the same digest is a duplicate (Ray may deliver a call twice) and is
  acknowledged without being applied again; the same key with other bytes is an error.
* ``prepare(..., base=BOOTSTRAP_BASE)`` bootstraps: dense frames of the committed version.

Serving: :meth:`EngineActor.generate` reports the policy version it used. With in-place apply
(default) generation pauses from ``prepare`` to ``activate``, so no output ever mixes versions; with
``EngineConfig(apply="staged")`` payloads are validated and staged while the engine keeps serving the
old version, and are applied together at ``flush`` (the only pause).
"""

from __future__ import annotations

import logging
import threading
import time
import ray

from dcr_ray import metrics
from dcr_ray.actors.attempt import Attempt as _Attempt
from dcr_ray.actors.engine_catchup import CatchUp
from dcr_ray.actors.owner import BOOTSTRAP_BASE
from dcr_ray.start_clock import StartClock
from dcr_ray.actors.engine_digests import DigestMembership
from dcr_ray.actors.engine_heal import PeerCopy
from dcr_ray.actors.engine_pause import PauseClock
from dcr_ray.actors.engine_state import EngineState, Phase
from dcr_ray.codec.undo import UndoLog
from dcr_ray.codec import kernels
from dcr_ray.codec import DIGEST_SIZE, PayloadKey, decode_frame, open_frame
from dcr_ray.config import RefitConfig
from dcr_ray.engines.base import EngineBackend
from dcr_ray.engines.sampling import Sampling
from dcr_ray.errors import (
    ConfigError,
    EngineStateError,
    FrameError,
    RefitError,
    RefitTimeoutError,
    StagingBudgetError,
)

log = logging.getLogger(__name__)


class EngineActor(DigestMembership, PeerCopy, CatchUp):
    """Hosts one engine backend (built in this process by ``backend_factory()``).

    ``reader`` is the transport's engine side (:class:`~dcr_ray.relay.transport.PayloadReader`): it
    turns what :meth:`deliver` is given (frame bytes, or a reference such as an object path) into bytes.
    """

    def __init__(self, engine_id: str, cluster: str, backend_factory, config: RefitConfig, reader):
        self._clock = StartClock()  # worker start and imports until now; then the backend, the kernels
        self.engine_id = engine_id
        self.cluster = cluster
        self.config = config
        self.backend = backend_factory()
        self._clock.mark("backend")
        if not isinstance(self.backend, EngineBackend):
            raise ConfigError(f"engine {engine_id}: the engine factory returned a {type(self.backend).__name__}; it "
                              f"must return a dcr_ray.engines.base.EngineBackend (subclass it and implement its "
                              f"abstract methods)")
        self.specs = self.backend.tensor_specs()
        self._st = EngineState()  # its phase and what it holds (every transition: engine_state)
        self._applied: dict[PayloadKey, bytes] = {}
        self._cv = threading.Condition()
        self._apply_s = 0.0
        self._bytes = 0
        self._raw = 0  # decompressed bytes of the frames validated in this attempt (progress)
        self._stats = {"applied": 0, "duplicate": 0, "stale": 0, "rejected": 0, "rollbacks": 0}
        self.reader = reader
        self._staged: list[tuple[PayloadKey, bytes]] = []
        #: inverse of the in-place writes of the transfer in flight (in-place rollback)
        self._undo = UndoLog()
        self._tags = {"cluster": cluster, "engine": engine_id}  # of every metric this engine records
        self._pause = PauseClock()  # when generation could not serve, per refit (engine_pause)
        kernels.warm_up(on_done=lambda secs: self._clock.add("kernels", secs))  # while the bootstrap runs

    def __repr__(self) -> str:  # shown by Ray (dashboard, logs, errors)
        try:
            return f"EngineActor({self.engine_id}, cluster={self.cluster}, v{self.version}, {self._st!r})"
        except AttributeError:  # not constructed yet
            return "EngineActor(starting)"

    @property
    def version(self) -> int | None:
        """The committed version this engine holds (None: none, or its bits match no version)."""
        return self._st.version

    @property
    def version_id(self) -> str | None:
        """The content id of :attr:`version` (the transfer that produced it)."""
        return self._st.version_id

    # -- protocol -----------------------------------------------------------------------------------
    def prepare(self, transfer: str, attempt: int, base: int, target: int, base_id: str | None = None) -> dict:
        """Open attempt ``(transfer, attempt)``; checks that this engine holds ``base`` and, when
        ``base_id`` is given, that it holds that content (the transfer that produced ``base``): its
        frames are then refused unless built on exactly that content."""
        st = self._st
        with self._cv:
            if st.written is not None and st.written != transfer:
                # it holds writes of another transfer that was never rolled back or committed: no delta
                # may build on them; a dense bootstrap replaces them, so it may start, from no version
                if base != BOOTSTRAP_BASE:
                    raise EngineStateError(
                        f"engine {self.engine_id} holds in-place writes of transfer {st.written} that was "
                        f"neither committed nor rolled back; abort({st.written!r}, final=True) first")
                self._mark_dirty(f"transfer {st.written} wrote into it and was never settled")
            if base != BOOTSTRAP_BASE and st.why is not None:
                raise EngineStateError(f"engine {self.engine_id} holds no version ({st.why}); "
                                       f"it must be bootstrapped (dense) first: Refit.rejoin({self.engine_id!r})")
            if base != BOOTSTRAP_BASE and self.version != base:
                raise EngineStateError(
                    f"engine {self.engine_id} holds version {self.version}, the transfer needs {base}; "
                    f"it must be bootstrapped (dense) before it can take deltas"
                )
            if base != BOOTSTRAP_BASE and base_id is not None and self.version_id != base_id:
                raise EngineStateError(
                    f"engine {self.engine_id} holds version {base} of content {self.version_id!r}, the "
                    f"transfer is built on {base_id!r}: another lineage with the same version number; it "
                    f"must be bootstrapped (dense) before it can take deltas")
            if base != BOOTSTRAP_BASE and self.config.engines.apply != "staged":
                self._pause.begin(transfer, "in_place")  # frames land in live weights as they arrive
            if not st.is_in(transfer, attempt):
                if not st.is_in(transfer):
                    self._applied.clear()
                st.open(_Attempt(transfer, attempt, base, target, None if base == BOOTSTRAP_BASE else base_id))
                self._staged = []
                self._apply_s = 0.0
                self._bytes = 0
                self._raw = 0
            return {"engine": self.engine_id, "version": self.version}

    def deliver(self, payload, targets: list[str] | None = None) -> str:
        """Read one payload through the transport, validate it and apply it.

        Returns ``applied``/``duplicate``/``stale``/``rejected`` (``skipped`` when ``targets`` names
        other engines).
        """
        if targets is not None and self.engine_id not in targets:
            return "skipped"
        try:
            data = self.reader.read(payload)
        except Exception as e:  # an unreadable payload fails this attempt's flush, as a bad frame does
            with self._cv:
                self._st.fail(RefitError(f"engine {self.engine_id}: reading a payload failed: {e!r}"))
                self._stats["rejected"] += 1
                self._cv.notify_all()
            return "rejected"
        with self._cv:
            status = self._deliver_locked(data)
            self._stats[status] += 1
            self._cv.notify_all()
        if status in ("applied", "rejected"):
            metrics.record(f"engine_{status}", tags=self._tags)
        return status

    def _deliver_locked(self, data: bytes) -> str:
        st = self._st
        if st.attempt is None:
            st.fail_first(EngineStateError(
                f"engine {self.engine_id} got a payload before prepare(): not part of an open transfer"))
            return "rejected"
        try:
            header = open_frame(data, key=self.config.codec.key)  # digest checked before the header is parsed
        except FrameError as e:
            st.fail(e)
            return "rejected"
        cur = st.attempt
        meta = header.meta
        if (meta.transfer, meta.attempt) != (cur.transfer, cur.attempt):
            return "stale"
        key = meta.key
        dg = bytes(data[-DIGEST_SIZE:])
        if key in self._applied:
            if self._applied[key] != dg:
                st.fail(FrameError(f"payload {key} arrived twice with different bytes"))
                return "rejected"
            return "duplicate"
        staging = self.config.engines.apply == "staged" and cur.base != BOOTSTRAP_BASE
        budget = self.config.engines.staging_budget_bytes
        held = sum(len(d) for _, d in self._staged)
        if staging and held + len(data) > budget:
            st.fail(StagingBudgetError(
                f"engine {self.engine_id}: staging payload {key} ({len(data)} bytes) would hold {held + len(data)} "
                f"bytes, over EngineConfig.staging_budget_bytes={budget}: raise the budget or use "
                f"EngineConfig(apply='in_place')"))
            return "rejected"
        t0 = time.perf_counter()
        try:
            frame = self._decode(header, cur)
            if staging:
                self._staged.append((key, bytes(data)))  # validated; applied at flush
            else:
                st.wrote()
                self._apply(data, frame)
        except FrameError as e:
            st.fail(e)
            return "rejected"
        except Exception as e:  # a backend failure must fail the attempt now, not time out its flush
            st.fail(RefitError(f"engine {self.engine_id}: applying payload {key} failed: {e!r}"))
            return "rejected"
        self._apply_s += time.perf_counter() - t0
        self._bytes += len(data)
        self._raw += frame.raw_bytes
        self._applied[key] = dg
        return "applied"

    def flush(self, transfer: str, attempt: int, expected: list[tuple], timeout_s: float) -> dict:
        """Wait until every expected payload is applied, flush the backend, acknowledge."""
        want = {PayloadKey(*k) for k in expected}
        deadline = time.monotonic() + timeout_s
        st = self._st
        with self._cv:
            while True:
                if not st.is_in(transfer, attempt):
                    raise EngineStateError(f"engine {self.engine_id}: flush for an attempt it is not in")
                if st.error is not None:
                    raise st.error
                missing = want - self._applied.keys()
                if not missing:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RefitTimeoutError(
                        f"engine {self.engine_id}: {len(missing)} of {len(want)} payloads not applied "
                        f"within {timeout_s:.0f} s, e.g. {sorted(missing)[:3]}")
                self._cv.wait(min(left, 1.0))
            t0 = time.perf_counter()
            if self._staged:
                self._pause.begin(transfer, "staged")  # generation waits from the first write to activate
                st.wrote()
            for _key, data in sorted(self._staged, key=lambda kd: kd[0]):
                self._apply(data, self._decode(open_frame(data, key=self.config.codec.key), st.attempt))
            self._staged = []
            self.backend.flush()
            st.flushed_now()
            self._pause.applied(time.perf_counter() - t0)
            self._apply_s += time.perf_counter() - t0
            metrics.record("engine_apply_seconds", self._apply_s, tags=self._tags)
            return {"engine": self.engine_id, "cluster": self.cluster, "applied": len(want),
                    "apply_s": self._apply_s, "bytes": self._bytes}

    def _apply(self, data: bytes, frame) -> None:
        """Write a validated frame: decoded into the backend, or as wire bytes to a backend that forwards
        them to an engine of its own (adopted engines validate them again before writing)."""
        if self.backend.wants_wire_frames:
            self.backend.apply_wire(bytes(data), frame)
            return
        cur = self._st.attempt
        if (self.config.engines.rollback == "in_place" and cur is not None and cur.base != BOOTSTRAP_BASE
                and self.backend.undo_tensors() is not None):
            # the inverse is in the record before the first write, and covers each write as it lands
            self.backend.apply_with_undo(frame, self._undo.open(cur.transfer, frame))
            return
        self.backend.apply(frame)

    def _decode(self, header, cur: _Attempt):
        # a frame closes once its raw size reaches the bucket, so it holds under two buckets
        return decode_frame(header, shapes=self.specs, expect_base=cur.base, expect_base_id=cur.base_id,
                            max_raw_bytes=max(self.config.codec.bucket_bytes * 2, 1 << 20),
                            keep_packs=self.backend.applies_packs)

    def generate(self, prompt_token_ids: list[list[int]], max_tokens: int = 8,
                 timeout_s: float | None = None, sampling=None) -> dict:
        """Generation with the backend, greedy unless ``sampling`` (a
        :class:`~dcr_ray.engines.sampling.Sampling` or a dict of its fields) says otherwise; returns
        ``{"version", "outputs"}`` (outputs prompt-major, ``n`` per prompt).

        Waits (pauses) while an in-place transfer is open or between its attempts, so outputs always
        come from one version; refuses (``EngineStateError``) while the engine holds no version.
        """
        deadline = time.monotonic() + (timeout_s or self.config.commit.timeout_s)
        staged = self.config.engines.apply == "staged"
        with self._cv:
            # in place: paused while a transfer is open, and between its attempts (half-written bits);
            # staged: from the flush's writes until activate (the bits are not committed before that)
            t_wait = time.perf_counter()
            while (self._st.written is not None) if staged else self._st.paused:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RefitTimeoutError(f"engine {self.engine_id}: paused for a refit longer than allowed")
                self._cv.wait(min(left, 1.0))
            waited = time.perf_counter() - t_wait
            if waited > 0.001:
                self._pause.blocked(waited)
            if self._st.why is not None:
                raise EngineStateError(f"engine {self.engine_id} will not generate: it holds no version "
                                       f"({self._st.why}); Refit.rejoin({self.engine_id!r}) restores it")
            outputs = (self.backend.generate(prompt_token_ids, max_tokens) if sampling is None
                       else self.backend.generate(prompt_token_ids, max_tokens, sampling=Sampling.of(sampling)))
            return {"engine": self.engine_id, "version": self.version, "outputs": outputs}

    def activate(self, version: int, transfer: str | None = None, version_id: str | None = None) -> int:
        """Make ``version`` current (after the commit record is written). Idempotent.

        ``version_id`` names its content (the commit record's ``transfer``); it defaults to ``transfer``,
        which is right for a delta transfer (a dense bootstrap passes the record's id)."""
        with self._cv:
            if transfer is None or self._st.is_in(transfer):
                self._st.activate(version, version_id if version_id is not None else transfer)
                if transfer is not None:
                    self._pause.end(transfer, "activated", version)
                self._applied.clear()
                self._undo.clear()
                self.backend.activate(version)  # backends that tag their outputs with a version
                metrics.record("engine_version", version, tags=self._tags)
                self._cv.notify_all()
            return self.version

    def abort(self, transfer: str, final: bool = False) -> dict:
        """Leave the open attempt of ``transfer``; its next attempt re-prepares.

        Between attempts the bits an attempt wrote in place stay: the next attempt OVERWRITEs the
        whole changed set, which repairs them. With ``final=True`` the transfer is abandoned: an engine
        with an undo record of every write it made (:mod:`~dcr_ray.codec.undo`) rolls back in place and
        keeps its committed version; otherwise the bits it wrote belong to no version, so it holds none
        (``dirty``), refuses deltas and generation, and must be bootstrapped densely (the coordinator
        does it).
        """
        st = self._st
        with self._cv:
            if st.is_in(transfer):
                st.close(transfer)
                self._staged = []
            if final and st.written == transfer and self._rolled_back(transfer):
                st.rolled_back()
                self._stats["rollbacks"] += 1
                self._pause.end(transfer, "rolled back", self.version)
                self._cv.notify_all()
                return {"engine": self.engine_id, "dirty": False, "rolled_back": True}
            if final and st.written == transfer:
                self._mark_dirty(f"transfer {transfer} was abandoned after writing into this engine's weights "
                                 f"in place")
                self._pause.end(transfer, "abandoned", None)
            elif final:
                self._pause.end(transfer, "rolled back", self.version)  # nothing was written: serving goes on
            self._cv.notify_all()
            return {"engine": self.engine_id, "dirty": st.why is not None}

    def _rolled_back(self, transfer: str) -> bool:
        """Undo the abandoned ``transfer``'s writes in place: from this engine's undo record, else from one
        the backend keeps itself (vLLM's workers do); False when neither can (the engine goes dirty)."""
        try:
            if self._undo.transfer == transfer:
                self._undo.rollback(self.backend)
                return True
            return self.config.engines.rollback == "in_place" and self.backend.rollback() is True
        except Exception as e:  # dirty then: the coordinator re-bootstraps densely
            self._undo.clear()
            log.warning("engine %s: in-place rollback failed (%r)", self.engine_id, e)
            return False

    def _mark_dirty(self, why: str) -> None:
        """This engine's weights match no version (``why``): it refuses deltas and generation until a
        dense bootstrap. Its undo record and any open update of the backend's own are dropped."""
        self._undo.clear()
        try:  # a backend with an open update of its own closes it unapplied
            self.backend.abandon()
        except Exception as e:  # dirty either way: only a dense bootstrap trusts these weights again
            log.warning("engine %s: closing the backend's open update failed (%r)", self.engine_id, e)
        self._st.dirty(why)

    # -- inspection ---------------------------------------------------------------------------------
    def info(self) -> dict:
        with self._cv:
            return {"engine": self.engine_id, "cluster": self.cluster, "version": self.version,
                    "node": ray.get_runtime_context().get_node_id(),
                    "placement_group": ray.get_runtime_context().get_placement_group_id(),
                    "start": self._clock.report(), **self._stats}

    def pauses(self, since: float = 0.0) -> list[dict]:
        """This engine's serving pauses that began at or after ``since`` (``time.time()``), oldest first:
        per refit, ``pause_s`` (generation could not serve), split into ``apply_s`` (writes and the
        backend's flush) and ``commit_s`` (waiting for the record and activation), ``blocked_s`` (how
        long ``generate`` calls waited), the ``mode`` and ``outcome`` (:mod:`~dcr_ray.actors.engine_pause`)."""
        return self._pause.recent(since)

    def state(self) -> dict:
        """Where this engine stands: its version, the transfer it is in or wrote into, dirty or not, and
        ``phase`` (``ready`` / ``receiving`` / ``staging`` / ``dirty``), and ``flushed`` (every payload
        of the open attempt applied). A resumed coordinator settles an open transfer from this (activate
        it if the record committed it, else roll it back); an engine evicted as hung that flushed the
        transfer the record committed is activated instead of bootstrapped."""
        with self._cv:
            st = self._st
            cur = st.attempt
            phase = ("dirty" if st.why is not None or st.version is None else
                     "ready" if st.phase is Phase.READY else
                     "staging" if self.config.engines.apply == "staged" and st.written is None else "receiving")
            return {"engine": self.engine_id, "cluster": self.cluster, "version": st.version,
                    "version_id": st.version_id, "phase": phase, "transfer": st.transfer,
                    "target": cur.target if cur else None, "dirty": st.why is not None,
                    "flushed": cur is not None and st.flushed == (cur.transfer, cur.attempt)}

    def progress(self) -> dict:
        """Lock-free counters of the open attempt (for progress bars; may be a moment stale): its
        transfer, the payloads applied and their decompressed bytes."""
        cur = self._st.attempt
        return {"transfer": cur.transfer if cur else None, "payloads": len(self._applied), "raw_bytes": self._raw}

    def get_version(self) -> int | None:
        return self.version

    def tensors(self, names: list[str] | None = None) -> dict:
        """Copies of the engine's canonical tensors (all, or ``names``)."""
        ts = self.backend.tensors()
        return {n: ts[n].clone() for n in (names or ts)}

    def call_backend(self, method: str, *args, **kwargs):
        """Call a backend method (e.g. ``greedy`` or ``generate``) in the engine process."""
        return getattr(self.backend, method)(*args, **kwargs)
