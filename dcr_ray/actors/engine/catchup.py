"""Catching an engine up by the deltas it missed: the committed payloads its cluster kept.

An engine that holds committed version v (evicted as hung, then answering again) while the record
says v+k needs only the k committed transfers since v, which its cluster's transport keeps in the
catch-up window (:mod:`dcr_ray.relay.window`). Protocol (driven by the coordinator's healing part,
:mod:`~dcr_ray.actors.recovery.healing`)::

    engine.catch_up(steps)    steps: the window's chain from the engine's (v, content id) to the
                              committed version, each with its committed attempt, payload keys and
                              payloads (refs held by the cluster's head relay, or stored paths)

1. Checks the chain: the first step is built on exactly what the engine holds (version and content
   id), each next one on the previous one's target and transfer.
2. Reads every payload (inside the cluster) and validates every frame of every step (digest, the
   step's transfer and attempt, base version and content id, shapes and index bounds) and that each
   step's payload keys are exactly the record's: all before any write.
3. Applies the steps in commit order, each like a refit's attempt (in place, with the undo record),
   and flushes the backend after each: after every step the engine holds that committed version
   exactly. A step that fails part way rolls back in place to the previous version (or, where it
   cannot, leaves the engine holding no version); the earlier steps stay, they are committed versions.

Replaying is O(the changes of the k versions); XOR masks would compose into one delta of the union of
changed positions, but the payloads are already inside the cluster, so composing would save only
apply passes over positions that changed in several versions, not link bytes.

The engine stays outside the required set throughout; the coordinator adds it once it holds the
version the record names. A part of :class:`~dcr_ray.actors.engine.actor.EngineActor`, handed the engine's
shared state (:class:`~dcr_ray.actors.engine.context.EngineContext`: its lock, reader, decode and write
path, state transitions) and the receiver whose abort rolls back a step that fails part way.
"""

from __future__ import annotations

import time

import ray

from dcr_ray.actors.engine.attempt import Attempt
from dcr_ray.actors.engine.context import EngineContext
from dcr_ray.actors.engine.receive import Receiver
from dcr_ray.codec import open_frame
from dcr_ray.errors import EngineStateError, FrameError, RefitError
from dcr_ray.failpoints import failpoint


class CatchUp:
    """``catch_up`` of one engine (see the module doc)."""

    def __init__(self, ctx: EngineContext, receiver: Receiver):
        self._engine = ctx
        self._receiver = receiver

    def catch_up(self, steps: list, timeout_s: float) -> dict:
        """Take ``steps`` (:class:`~dcr_ray.relay.window.CommittedStep`, in commit order); returns
        ``{"engine", "version", "steps", "bytes", "seconds"}``. Raises :class:`FrameError` or
        :class:`EngineStateError` before any write when a step does not fit what this engine holds."""
        c = self._engine
        t0 = time.perf_counter()
        if not steps:
            raise EngineStateError(f"engine {c.engine_id}: nothing to catch up with")
        self._check_chain(steps)
        decoded, nbytes = [], 0
        for s in steps:  # read and validate everything before any write
            cur = Attempt(s.transfer, s.attempt, s.base, s.target, s.base_id)
            datas = self._read_all(s.payloads, timeout_s)
            nbytes += sum(len(d) for d in datas)
            frames, keys = [], set()
            for data in datas:
                header = open_frame(data, key=c.config.codec.key)
                meta = header.meta
                if (meta.transfer, meta.attempt) != (s.transfer, s.attempt):
                    raise FrameError(f"engine {c.engine_id}: a kept payload of {s.transfer}/{s.attempt} is a "
                                     f"frame of {meta.transfer}/{meta.attempt}")
                keys.add(tuple(meta.key))
                frames.append((data, c.decode(header, cur)))
            want = {tuple(k) for k in s.keys}
            if keys != want or len(frames) != len(want):
                raise FrameError(f"engine {c.engine_id}: the kept payloads of {s.transfer} are not the "
                                 f"committed attempt's ({len(keys & want)} of {len(want)} keys, "
                                 f"{len(keys - want)} others)")
            decoded.append((cur, frames))
        with c.lock:
            self._check_chain(steps)  # nothing moved while it read
            c.quiesce()
            for cur, frames in decoded:
                failpoint("engine.catch_up")
                self._apply_step(cur, frames)
            c.count("caught_up")
        return {"engine": c.engine_id, "version": c.state.version, "steps": len(steps), "bytes": nbytes,
                "seconds": time.perf_counter() - t0}

    def _check_chain(self, steps: list) -> None:
        c = self._engine
        with c.lock:
            st = c.state
            if not st.settled:
                raise EngineStateError(f"engine {c.engine_id} is {st.phase.value}: it catches up only while it "
                                       f"holds a committed version settled")
            have = (st.version, st.version_id)
        for s in steps:
            if (s.base, s.base_id) != have:
                raise EngineStateError(
                    f"engine {c.engine_id}: step {s.transfer} ({s.base}->{s.target}) is built on v{s.base} "
                    f"({s.base_id}), this engine (or the step before) holds v{have[0]} ({have[1]})")
            have = (s.target, s.transfer)

    def _read_all(self, payloads: list, timeout_s: float) -> list[bytes]:
        refs = [i for i, p in enumerate(payloads) if isinstance(p, ray.ObjectRef)]
        got = dict(zip(refs, ray.get([payloads[i] for i in refs], timeout=timeout_s))) if refs else {}
        return [self._engine.reader.read(got[i] if i in got else p) for i, p in enumerate(payloads)]

    def _apply_step(self, cur: Attempt, frames: list) -> None:
        """One validated step in place, like an attempt of a refit; the engine then holds ``cur.target``."""
        c = self._engine
        c.state.open(cur)
        c.state.wrote()
        try:
            for data, frame in frames:
                c.write(data, frame)
            c.backend.flush()
        except Exception as e:
            self._receiver.abort(cur.transfer, final=True)  # rolls back in place to cur.base, or leaves no version
            st = c.state
            raise RefitError(f"engine {c.engine_id}: catching up with {cur.transfer} ({cur.base}->{cur.target}) "
                             f"failed part way ({e!r}); it holds "
                             f"{'v%s' % st.version if st.why is None else 'no version'}") from e
        c.become_ready(cur.target, cur.transfer)
