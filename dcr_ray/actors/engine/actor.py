"""Engine actors: validate and apply payloads in place, journal them, acknowledge at flush; serve.

An engine actor is composed of parts, as the coordinator is, each handed the engine's shared state
(:class:`~dcr_ray.actors.engine.context.EngineContext`: backend, phase, journal, undo record, lock):

=============================  =========================================================================
:class:`Receiver`              the refit protocol: prepare, deliver, flush, activate, abort
                               (:mod:`~dcr_ray.actors.engine.receive`)
:class:`Serving`               generation from the version held, never from half-written weights; the
                               serving pauses (:mod:`~dcr_ray.actors.engine.serving`)
:class:`Digests`               membership by digest: box digests, join by digest, invalidate
                               (:mod:`~dcr_ray.actors.engine.digests`)
:class:`PeerCopy`              a peer's copy inside the cluster: snapshot, heal_from
                               (:mod:`~dcr_ray.actors.engine.peer_copy`)
:class:`CatchUp`               the deltas it missed, replayed from the cluster's window
                               (:mod:`~dcr_ray.actors.engine.catchup`)
=============================  =========================================================================

Its phases are :class:`~dcr_ray.actors.engine.state.Phase` (empty, ready, staging, open, written,
parked, dirty), every transition one method of :class:`~dcr_ray.actors.engine.state.EngineState`. With in-place
apply (default) generation pauses from ``prepare`` to ``activate``; with ``EngineConfig(apply="staged")``
payloads are validated and decoded while the engine keeps serving the old version, and written together at
``activate``, once the commit record is durable (the only pause). A pause stops the running requests at
their next decoding step (``EngineConfig(switch="in_flight")``, :mod:`~dcr_ray.actors.engine.switch`: they
resume on the new version, and their answers say which tokens came from which) or waits for them to finish
first (``"drain"``: one version per answer).
An in-place engine that waits past ``EngineConfig.hold_s`` after its flush sets its writes aside and
serves meanwhile (:mod:`~dcr_ray.actors.engine.park`).
"""

from __future__ import annotations

import logging

import ray

from dcr_ray.actors.engine.catchup import CatchUp
from dcr_ray.actors.engine.context import EngineContext
from dcr_ray.actors.engine.digests import Digests
from dcr_ray.actors.engine.peer_copy import PeerCopy
from dcr_ray.actors.engine.receive import Receiver
from dcr_ray.actors.engine.serving import Serving
from dcr_ray.actors.engine.switch import EngineGate
from dcr_ray.codec.compiled import kernels
from dcr_ray.config import RefitConfig
from dcr_ray.engines.base import EngineBackend, readable_tensors
from dcr_ray.errors import ConfigError
from dcr_ray.failpoints import remote as failpoints_remote
from dcr_ray.heap import return_free_heap
from dcr_ray.start_clock import StartClock

log = logging.getLogger(__name__)


class EngineActor:
    """Hosts one engine backend (built in this process by ``backend_factory()``), composed of the parts the
    module doc lists; its methods are theirs.

    ``reader`` is the transport's engine side (:class:`~dcr_ray.relay.transport.PayloadReader`): it
    turns what :meth:`deliver` is given (frame bytes, or a reference such as an object path) into bytes.

    ``epoch`` names this incarnation of the engine (the coordinator gives each actor it creates a new,
    later one). The calls that open, flush or activate a transfer, or hand bits over, may name the
    epoch they mean: one addressed to another incarnation is refused (:class:`EngineStateError`),
    so an actor the coordinator replaced (its node was unreachable, not gone) takes no part in a
    refit again, and a transfer it cannot open brings it no frames.
    """

    def __init__(self, engine_id: str, cluster: str, backend_factory, config: RefitConfig, reader,
                 epoch: int | None = None):
        self._clock = StartClock()  # worker start and imports until now; then the backend, the kernels
        failpoints_remote.started()  # a plan left for this incarnation (failure drills only)
        backend = backend_factory()
        self._clock.mark("backend")
        if not isinstance(backend, EngineBackend):
            raise ConfigError(f"engine {engine_id}: the engine factory returned a {type(backend).__name__}; it "
                              f"must return a dcr_ray.engines.base.TensorBackend or WireBackend (subclass one and "
                              f"implement its abstract methods)")
        self._engine = EngineContext(engine_id=engine_id, cluster=cluster, config=config, backend=backend,
                                reader=reader, specs=backend.tensor_specs(), epoch=epoch)
        if self._engine.in_flight:  # version switches fall between two decoding steps
            backend.gate_steps(EngineGate(self._engine))
        self._receiver = Receiver(self._engine)
        self._serving = Serving(self._engine)
        self._digests = Digests(self._engine, self._receiver)
        self._peer = PeerCopy(self._engine)
        self._catchup = CatchUp(self._engine, self._receiver)
        kernels.warm_up(on_done=lambda secs: self._clock.add("kernels", secs))  # while the bootstrap runs

    def __repr__(self) -> str:  # shown by Ray (dashboard, logs, errors)
        try:
            c = self._engine
            return f"EngineActor({c.engine_id}, cluster={c.cluster}, v{c.state.version}, {c.state!r})"
        except AttributeError:  # not constructed yet
            return "EngineActor(starting)"

    @property
    def engine_id(self) -> str:
        return self._engine.engine_id

    @property
    def backend(self) -> EngineBackend:
        """The backend this engine hosts (for code run in the engine's process)."""
        return self._engine.backend

    @property
    def version(self) -> int | None:
        """The committed version this engine holds (None: none, or its bits match no version)."""
        return self._engine.state.version

    # -- the refit protocol (engine_receive) ----------------------------------------------------------
    def prepare(self, transfer: str, attempt: int, base: int, target: int, base_id: str | None = None,
                epoch: int | None = None) -> dict:
        self._engine.fence(epoch, "prepare")
        return self._receiver.prepare(transfer, attempt, base, target, base_id)

    def deliver(self, payload, targets: list[str] | None = None) -> str:
        return self._receiver.deliver(payload, targets)

    def flush(self, transfer: str, attempt: int, expected: list[tuple], timeout_s: float,
              epoch: int | None = None) -> dict:
        self._engine.fence(epoch, "flush")
        return self._receiver.flush(transfer, attempt, expected, timeout_s)

    def activate(self, version: int, transfer: str | None = None, version_id: str | None = None,
                 epoch: int | None = None) -> int:
        self._engine.fence(epoch, "activate")
        try:
            return self._receiver.activate(version, transfer, version_id)
        finally:
            return_free_heap()  # the transfer's frames and decoded items

    def abort(self, transfer: str, final: bool = False) -> dict:
        try:
            return self._receiver.abort(transfer, final)
        finally:
            return_free_heap()

    def progress(self) -> dict:
        return self._receiver.progress()

    # -- serving (engine_serving) ---------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], max_tokens: int = 8, timeout_s: float | None = None,
                 sampling=None) -> dict:
        return self._serving.generate(prompt_token_ids, max_tokens, timeout_s, sampling)

    def pauses(self, since: float = 0.0) -> list[dict]:
        return self._serving.pauses(since)

    def hold(self, label: str, switch: str | None = None) -> None:
        """Stop admitting generation for an operation outside the refit protocol (``label``: what it is, e.g.
        a weight load another system makes), once the decoding steps in progress ended (``switch="in_flight"``:
        the running requests resume after :meth:`release`) or the calls running answered (``"drain"``);
        default: ``EngineConfig.switch``. Its pause is kept like a refit's (mode ``label``)."""
        self._serving.hold(label, switch)

    def release(self, label: str) -> None:
        """End the hold ``label``: generation is admitted again."""
        self._serving.release(label)

    def cpu_parts(self) -> dict:
        """Thread CPU seconds of this engine's payload path since it started: ``deliver`` and its parts
        ``open``, ``decode`` and ``apply``, with ``calls`` (:class:`~dcr_ray.actors.engine.context.CpuParts`)."""
        return dict(self._engine.cpu.totals)

    # -- membership by digest, a peer's copy, missed deltas ------------------------------------------
    def box_digests(self, boxes: list) -> dict:
        return self._digests.box_digests(boxes)

    def invalidate(self, why: str) -> dict:
        self._digests.invalidate(why)
        return self.state()

    def join_by_digest(self, version: int, digests: dict, version_id: str | None = None) -> bool:
        return self._digests.join_by_digest(version, digests, version_id)

    def snapshot(self, version: int, version_id: str | None, epoch: int | None = None) -> dict:
        self._engine.fence(epoch, "snapshot")
        return self._peer.snapshot(version, version_id)

    def heal_from(self, snap: dict, timeout_s: float, epoch: int | None = None) -> dict:
        self._engine.fence(epoch, "heal_from")
        return self._peer.heal_from(snap, timeout_s)

    def catch_up(self, steps: list, timeout_s: float, epoch: int | None = None) -> dict:
        self._engine.fence(epoch, "catch_up")
        return self._catchup.catch_up(steps, timeout_s)

    # -- inspection -----------------------------------------------------------------------------------
    def state(self) -> dict:
        """Where this engine stands: its ``phase`` (:class:`~dcr_ray.actors.engine.state.Phase`: empty,
        ready, staging, open, written, dirty), its version and content id, the transfer it is in or wrote
        into, ``dirty`` (its bits match no version), ``flushed`` (every payload of the open attempt
        applied), ``epoch`` (this incarnation's) and how its backend receives (``receiver``: a vLLM engine's
        ``path``, capture or mirror). A resumed coordinator settles an open transfer from this (activate
        it if the record committed it, else roll it back); an engine evicted as hung that flushed the transfer the record
        committed is activated instead of bootstrapped."""
        c = self._engine
        with c.lock:
            st = c.state
            cur = st.attempt
            return {"engine": c.engine_id, "cluster": c.cluster, "version": st.version,
                    "version_id": st.version_id, "phase": st.phase.value, "transfer": st.transfer,
                    "target": cur.target if cur else None, "dirty": st.why is not None,
                    "flushed": cur is not None and st.flushed == (cur.transfer, cur.attempt),
                    "receiver": c.backend.describe(), "epoch": c.epoch}

    def info(self) -> dict:
        """Identity, placement, start-up seconds and counters (payloads applied, duplicate, stale,
        rejected; rollbacks; heals by digest, copy and catch-up)."""
        c = self._engine
        with c.lock:
            return {"engine": c.engine_id, "cluster": c.cluster, "version": c.state.version,
                    "node": ray.get_runtime_context().get_node_id(),
                    "placement_group": ray.get_runtime_context().get_placement_group_id(),
                    "start": self._clock.report(), **c.stats}

    def stats(self) -> dict:
        """Lock-free figures of the last (or open) transfer: ``apply_s``, ``bytes``, ``raw_bytes``
        (:meth:`Receiver.stats`), and the backend's own statistics of its last flush when it keeps them
        (``backend_flush``: a vLLM engine's reloaded tensors and reprocessed modules)."""
        return {**self._receiver.stats(), "backend_flush": dict(getattr(self._engine.backend, "last_flush", None) or {})}

    def get_version(self) -> int | None:
        return self._engine.state.version

    def crossing(self):
        """What this engine's reads of payloads cross, when its transport says so (the object-storage
        reader of an emulated link exposes it as ``crossing``), else None. Code run in the engine's
        process (``actor.__ray_call__``) reaches the link here, never through the engine's parts."""
        return getattr(self._engine.reader, "crossing", None)

    def tensor_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Canonical name -> (wire dtype, shape) of what this engine holds."""
        return dict(self._engine.specs)

    def tensors(self, names: list[str] | None = None) -> dict:
        """Copies of the engine's canonical tensors (all, or ``names``): what it serves from."""
        ts = readable_tensors(self._engine.backend)
        return {n: ts[n].clone() for n in (names or ts)}
