"""The ``dcr`` backend of vLLM's weight-transfer API: dcr_ray frames applied inside every vLLM worker.

Select it when starting vLLM (``weight_transfer_config={"backend": "dcr"}``; the plugin in
:mod:`~dcr_ray.engines.vllm.plugin` registers it in every vLLM process), then drive it with vLLM's
own calls, on an ``LLM`` / ``AsyncLLM`` or through ``RayVLLMWeightSyncClient`` /
``HTTPVLLMWeightSyncClient``::

    init_weight_transfer_engine({"init_info": {"checkpoint": "/ckpt", "version": 0, "key": None}})
    start_weight_update()
    update_weights({"update_info": {"base": v, "target": v + 1, "frames": [frame bytes, ...]}})
    finish_weight_update(weight_version=str(v + 1))
    # with two or more workers, read every rank's outcome before setting the version:
    #   collective_rpc("dcr_transfer_status", args=(nonce,)) -> [{"ok": ..., "error": ...}, ...]
    # a refit that will not finish: update_weights({"update_info": {"base": v, "target": v + 1,
    #                                                               "abandon": True}}), then finish
    # does this worker serve committed version v? (writes nothing; fails on any mismatch)
    update_weights({"update_info": {"base": v, "target": v, "verify": [[name, start, stop, digest], ...]}})
    # with keep_undo (dcr_ray's own engines): undo the update v -> v + 1 in place, even after its finish
    update_weights({"update_info": {"base": v, "target": v + 1, "rollback": True}})
    # ... or: version v is committed, drop the undo record kept for it
    update_weights({"update_info": {"base": v, "target": v, "commit": True}})

``checkpoint`` is the directory the engine was started from (its canonical tensors seed the host
mirror); ``key`` the hex of the shared frame key, if refits sign frames with one. Over HTTP, send
``frames_b64`` (base64 strings) instead of ``frames`` (JSON carries no bytes; vLLM's
``HTTPVLLMWeightSyncClient`` encodes ``frames`` that way itself in a process where dcr_ray's plugin is
loaded, see :mod:`~dcr_ray.engines.vllm.plugin`; a frame that is not bytes is refused with that advice).
The trainer side of this backend, :mod:`~dcr_ray.integrations.vllm.trainer`, makes these calls for you
(``WeightTransferTrainerFactory.trainer_init(DcrTrainerInitInfo(...), client=...)``). Every frame of one
``update_weights`` call is validated before any is written; ``finish_weight_update`` writes the captured
changes in place and reloads the touched fused groups of the rest (see
:class:`~dcr_ray.engines.vllm.worker.receiver.MirrorReceiver`).

Failures and the status protocol. Every call is recorded: a call number ``seq``, the ``op`` (init,
start, update, finish, shutdown), ``ok`` and the ``error``. Any failure of start/update/finish resets
the receiver's update (the mirror gets back the bits the update's frames replaced; the version does
not move); only ``finish`` of an update whose frames were all validated and written moves the version,
so an empty start/finish pair after a refusal moves nothing. A refused init writes nothing and leaves
the previous receiver in place. How a "no" reaches the caller depends on the engine's world size:

- one worker (``parallel_config.world_size == 1``): the call raises, as vLLM's contract says
  (``update_weights`` before ``init_weight_transfer_engine`` raises :class:`NotInitializedError`, a
  ``RuntimeError``; ``start_weight_update`` / ``finish_weight_update`` before it are accepted, as
  vLLM's built-in backends accept them: nothing to prepare, nothing open);
- two or more (tensor / pipeline parallel): the workers agree on the outcome first (an all-gather of
  every rank's error over vLLM's CPU groups, :mod:`~dcr_ray.engines.vllm.worker.ranks`). Any rank's "no"
  resets the update on every rank and closes vLLM's update session on every rank, and only the last
  rank raises, naming every refusing rank's reason: vLLM's multiprocessing ``collective_rpc`` reads
  replies rank by rank and stops at the first failure, so the earlier ranks' replies have been read and
  the next call gets its own answers. The call the trainer made raises (``update_weights`` for a bad
  frame, a refused digest check or a wrong base), so ``finish_weight_update(weight_version)`` is never
  reached and the version label does not move. Every rank's outcome stays readable with
  ``collective_rpc("dcr_transfer_status", args=(nonce,))`` (a worker method the plugin adds, see
  :mod:`~dcr_ray.engines.vllm.plugin`; the reply echoes ``nonce``, carries ``seq`` so it cannot be
  taken for another call's, and says whether vLLM's update ``session`` is still open). An engine
  created outside vLLM's worker (no worker to close the session on, no process groups) only records a
  "no" for a driver that reads the status.

What a worker's receiver holds (its fused groups, the canonical tensors it serves, the last finish's
statistics) is read, writing nothing, with ``collective_rpc(worker_query, args=(what, names))``
(:func:`worker_query`).

dcr_ray's adopted-engine proxy (:mod:`~dcr_ray.engines.vllm.adopted`) makes exactly these calls and
checks the status after each, at any world size: on a "no" it closes vLLM's session with
``finish_weight_update()`` (no version, so the label does not move) and fails the refit; the version
label is set (``update_weight_version``) only after every worker's ``finish`` said yes. So the relay
tree, commit record and retries work for engines dcr_ray did not start; the engines dcr_ray starts
(:class:`~dcr_ray.engines.vllm.backend.VllmBackend`) are driven the same way.
"""

from __future__ import annotations

import base64
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from dcr_ray.engines.vllm.compat import end_weight_update_session
from dcr_ray.engines.vllm.worker.ranks import EngineRanks, find_worker, vllm_ranks
from dcr_ray.engines.vllm.worker.receiver import MirrorReceiver
from dcr_ray.engines.vllm.plugin import UNPACKED_LOAD_FORMAT
from dcr_ray.engines.vllm.worker.unpacked import is_unpacked
from dcr_ray.errors import BackendError, ConfigError, EngineStateError


@dataclass
class DcrInitInfo(WeightTransferInitInfo):
    checkpoint: str
    """The checkpoint directory the engine was started from (its canonical names and bits)."""
    version: int = 0
    """The policy version that checkpoint holds."""
    key: str | None = None
    """Hex of the frame key (``CodecConfig.key``), or None for unkeyed frames."""
    verify_reload: bool = True
    """Reload the checkpoint's own bits once and refuse to start if any served bit changes."""
    capture: bool | None = None
    """Write changes of tensors whose loader path is a plain view copy straight into live storage (no
    host mirror for them). ``None``: when the engine computes from its parameters (CUDA, or vLLM-CPU
    started with ``load_format="dcr_unpacked"``, :mod:`~dcr_ray.engines.vllm.worker.unpacked`). Refused on a
    vLLM-CPU that packs its weights: its kernels compute from packed copies a write would not reach."""
    keep_undo: bool = False
    """Keep a finished update's undo record until it is committed, so ``rollback`` can still undo it (see
    :class:`~dcr_ray.engines.vllm.worker.receiver.MirrorReceiver`); dcr_ray's own engines set it."""
    own_checkpoint: bool = False
    """The caller started the engine from ``checkpoint`` itself: names no module resolves reload with the
    whole model instead of being refused as a sign of the wrong checkpoint."""


@dataclass
class DcrUpdateInfo(WeightTransferUpdateInfo):
    base: int
    """The version the frames were built on (the version this engine holds)."""
    target: int
    """The version the engine holds after ``finish_weight_update``."""
    frames: list[bytes] = field(default_factory=list)
    """Frame bytes (Ray actors and in-process calls carry bytes; JSON cannot: use ``frames_b64``)."""
    frames_b64: list[str] = field(default_factory=list)
    """The same frames, base64-encoded (for the JSON of the HTTP routes)."""
    abandon: bool = False
    """Leave the open update without reloading anything (the refit it belonged to was abandoned)."""
    verify: list | None = None
    """Instead of frames: ``[[name, start, stop, digest], ...]``, committed digests of canonical boxes
    (:mod:`dcr_ray.sharding.digest`). Nothing is written; the call fails with
    :class:`~dcr_ray.errors.EngineStateError` unless every box of what this worker serves has
    that digest (see :meth:`MirrorReceiver.verify`). ``base`` = ``target`` = the committed version."""
    rollback: bool = False
    """Instead of frames: undo the update ``base -> target`` in place, open or finished and kept
    (``keep_undo``); the worker serves ``base`` again (:meth:`MirrorReceiver.rollback`)."""
    commit: bool = False
    """Instead of frames: version ``base`` (= ``target``) is committed and served here; the kept undo
    record is dropped (:meth:`MirrorReceiver.commit`)."""

    def __post_init__(self) -> None:
        """Refuse malformed info before anything is written (a ``ValueError``, as vLLM's contract says)."""
        for f in ("base", "target"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"update_info.{f} must be an integer version, got {v!r}")
        if not isinstance(self.frames, (list, tuple)) or not isinstance(self.frames_b64, (list, tuple)):
            raise ConfigError("update_info.frames / frames_b64 must be lists (of bytes / of base64 strings)")
        bad = [type(f).__name__ for f in self.frames if not isinstance(f, (bytes, bytearray, memoryview))]
        if bad:
            raise ConfigError(f"update_info.frames must hold frame bytes, got {bad[0]}: JSON (vLLM's HTTP routes) "
                              f"carries no bytes, so send the frames base64-encoded as 'frames_b64' (vLLM's "
                              f"HTTPVLLMWeightSyncClient does that for 'frames' once dcr_ray's plugin is loaded)")
        if any(not isinstance(f, str) for f in self.frames_b64):
            raise ConfigError("update_info.frames_b64 must hold base64 strings (one per frame)")


class NotInitializedError(EngineStateError, RuntimeError):
    """A weight-transfer call before ``init_weight_transfer_engine`` (vLLM's contract: a RuntimeError)."""


class TransferRefused(BackendError, RuntimeError):
    """Raised by the last worker of a tensor/pipeline-parallel engine when any worker refused a call;
    names every refusing rank's reason (see :mod:`~dcr_ray.engines.vllm.worker.ranks`)."""


@dataclass
class _RefusedInfo:
    """Init or update info that did not parse (world size >= 2: refused through the status, not raised)."""

    error: str


class DcrWeightTransferEngine(WeightTransferEngine[DcrInitInfo, DcrUpdateInfo]):
    """Per-worker engine: a :class:`MirrorReceiver` fed by ``update_weights``; every call's outcome is
    recorded for :meth:`transfer_status` (see the module docstring)."""

    init_info_cls = DcrInitInfo
    update_info_cls = DcrUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.device = torch.device(device)  # vLLM may hand a string ("cpu")
        self.world_size = int(getattr(vllm_config.parallel_config, "world_size", 1) or 1)
        self.receiver: MirrorReceiver | None = None
        self._shut_down: MirrorReceiver | None = None  # the receiver before shutdown (a reconnect checks it)
        self.last_finish: dict[str, int] = {}
        self._status: dict[str, Any] = {"seq": 0, "op": None, "ok": True, "error": None}
        self._worker = find_worker()  # vLLM's worker creating this engine (its update session is closed here)
        self._ranks: EngineRanks | None = None  # found at the first call: vLLM's groups exist by then

    # -- the status protocol ----------------------------------------------------------------------
    def transfer_status(self) -> dict[str, Any]:
        """The outcome of the last call (``seq`` counts calls; ``op`` names it; ``ok``; ``error``), plus
        what the receiver holds now (``version``; ``open``: an update is open)."""
        r = self.receiver
        return {**self._status, "version": r.version if r is not None else None,
                "open": r is not None and r.target is not None, "world_size": self.world_size}

    def bind(self, worker: Any, ranks: EngineRanks | None) -> None:
        """Tie this engine to its vLLM ``worker`` (held weakly: its update session is closed here after a
        refusal) and the ``ranks`` it agrees with. Found on their own otherwise (:func:`find_worker` at
        construction, :func:`vllm_ranks` at the first call); an embedder or a test with stand-ins passes them."""
        self._worker = weakref.ref(worker) if worker is not None else None
        self._ranks = ranks

    def agreement(self) -> EngineRanks | None:
        """The workers to agree with (:mod:`~dcr_ray.engines.vllm.worker.ranks`), or None: one worker, or no way
        to keep vLLM's sessions in step (then a "no" is only recorded, for a driver that reads the status)."""
        if self.world_size > 1 and self._ranks is None and self._worker is not None:
            self._ranks = vllm_ranks(self.world_size)
        return self._ranks

    def _run(self, op: str, fn, *args) -> Any:
        """``fn(*args)`` as call ``op``, its outcome recorded. With one worker a failure resets the open
        update (never a refused init: it leaves the previous receiver and its update alone) and raises.
        With several, the outcome is agreed among them first (:mod:`~dcr_ray.engines.vllm.worker.ranks`): any
        rank's failure resets every rank's update and closes vLLM's session on every rank, and the last
        rank raises with every rank's reason. Returns ``fn``'s result when every rank succeeded."""
        seq = self._status["seq"] + 1
        error, result, raised = None, None, None
        try:
            result = fn(*args)
        except Exception as e:
            error, raised = f"{type(e).__name__}: {e}", e
        except BaseException:
            if self.receiver is not None:
                self.receiver.reset()
            raise
        ranks = self.agreement()
        failed = [] if error is None else [(0, error)]
        if ranks is not None:
            failed = [(r, e) for r, e in enumerate(ranks.gather(error)) if e is not None]
        if not failed:
            self._status = {"seq": seq, "op": op, "ok": True, "error": None}
            return result
        if op != "init" and self.receiver is not None:
            self.receiver.reset()  # the mirror is back at its base, the version unmoved
            if op == "finish" and error is None:
                self.receiver.invalidate()  # this rank reloaded, another did not: the engine holds no version
        if ranks is None:
            self._status = {"seq": seq, "op": op, "ok": False, "error": error}
            if self.world_size == 1:
                raise raised
            return None  # no agreement possible: a raise would desynchronize collective_rpc; the driver reads this
        reasons = "; ".join(f"rank {r}: {e}" for r, e in failed)
        self._status = {"seq": seq, "op": op, "ok": False,
                        "error": error if error is not None else f"another worker refused ({reasons})"}
        if op in ("update", "finish"):
            self._close_session()
        if ranks.rank == ranks.size - 1:
            raise TransferRefused(f"{op} refused by {len(failed)} of {ranks.size} vLLM workers, every worker's "
                                  f"update reset and the version unmoved: {reasons}") from raised
        return None

    def _close_session(self) -> None:
        """Close vLLM's update session on this worker, as the worker does itself when ``update_weights``
        raises, so every rank's session agrees after a refusal whichever rank raised."""
        worker = self._worker() if self._worker is not None else None
        if worker is not None:
            end_weight_update_session(worker, self)  # vLLM 0.34 ends it through the worker
        else:
            self.reset_weight_update_target()

    # -- vLLM's calls ---------------------------------------------------------------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> DcrInitInfo:
        try:
            return super().parse_init_info(init_dict)
        except Exception as e:
            if self.world_size == 1:
                raise
            return _RefusedInfo(f"{type(e).__name__}: {e}")  # type: ignore[return-value]

    def init_transfer_engine(self, init_info: DcrInitInfo) -> None:
        receiver = self._run("init", self._init, init_info)
        if receiver is not None:  # every worker accepted it
            self.receiver, self._shut_down = receiver, None

    def start_weight_update(self) -> None:
        # nothing to prepare: frames land in the mirror, the reload runs at finish. Accepted before
        # init as vLLM's built-in backends accept it; the first update_weights then says "not initialized"
        self._run("start", lambda: None)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # CPU writes: nothing to synchronize
        self._run("update", lambda: self.receive_weights(self.parse_update_info(update_info)))

    def receive_weights(self, update_info: DcrUpdateInfo) -> None:
        r = self._receiver()
        try:
            self._receive(r, update_info)
        except BaseException:
            r.reset()  # every failure closes the update: the mirror is back at its base, the version unmoved
            raise

    def finish_weight_update(self) -> None:
        self._run("finish", self._finish)

    def shutdown(self) -> None:
        """Release the trainer connection; the worker keeps serving, and a later
        ``init_weight_transfer_engine`` takes over from what it serves (see ``adopt_served``)."""
        if self.receiver is not None:
            self.receiver.reset()
        self._shut_down, self.receiver = self.receiver or self._shut_down, None
        self._status = {"seq": self._status["seq"] + 1, "op": "shutdown", "ok": True, "error": None}

    # -- the work -------------------------------------------------------------------------------------
    def _init(self, init_info: DcrInitInfo) -> MirrorReceiver:
        """The receiver ``init_info`` asks for, checked against what the worker serves (installed by the
        caller once every worker accepted it; a refusal writes nothing)."""
        if isinstance(init_info, _RefusedInfo):
            raise ConfigError(f"init_weight_transfer_engine: {init_info.error}")
        key = bytes.fromhex(init_info.key) if init_info.key else None
        addressable = self.device.type == "cuda" or is_unpacked(self.model)
        capture = init_info.capture if init_info.capture is not None else addressable
        if capture and not addressable:
            raise ConfigError(f"capture=True needs parameters the engine computes from: vLLM on CUDA, or vLLM-CPU "
                              f"started with load_format={UNPACKED_LOAD_FORMAT!r} (this one packs its weights "
                              f"after loading, so writes into them would reach nothing); or use capture=False")
        receiver = MirrorReceiver(self.model, self.vllm_config, init_info.checkpoint, key=key,
                                  version=init_info.version, capture=capture, keep_undo=init_info.keep_undo,
                                  own_checkpoint=init_info.own_checkpoint)
        previous = self.receiver or self._shut_down
        if previous is not None:  # a trainer reconnects: what the worker serves must be that checkpoint,
            receiver.adopt_served(previous)  # shown without writing (a reload would overwrite what it serves)
        elif init_info.verify_reload:
            receiver.check_reload_is_a_fresh_load()
        return receiver

    def _receive(self, r: MirrorReceiver, update_info: DcrUpdateInfo) -> None:
        if isinstance(update_info, _RefusedInfo):
            raise ConfigError(f"update_weights: {update_info.error}")
        if update_info.abandon:
            r.abandon()
            return
        if update_info.rollback or update_info.commit:
            if update_info.frames or update_info.frames_b64 or update_info.verify is not None or (
                    update_info.rollback and update_info.commit):
                raise ConfigError("update_weights: 'rollback' and 'commit' are calls of their own (no frames, "
                                  "no verify)")
            if update_info.rollback:
                self.last_finish = r.rollback(update_info.base, update_info.target)
            elif update_info.base != update_info.target:
                raise ConfigError(f"update_weights: a commit names one version (base == target), got "
                                  f"{update_info.base}->{update_info.target}")
            else:
                r.commit(update_info.base)
            return
        if update_info.verify is not None:
            if update_info.frames or update_info.frames_b64:
                raise ConfigError("update_weights: 'verify' checks digests and writes nothing; send frames "
                                  "in another call")
            if update_info.base != update_info.target:
                raise ConfigError(f"update_weights: a digest check names one version (base == target), got "
                                  f"{update_info.base}->{update_info.target}")
            r.verify(update_info.verify, update_info.base)
            return
        frames = [f if isinstance(f, bytes) else bytes(f) for f in update_info.frames]
        for i, s in enumerate(update_info.frames_b64):
            try:
                frames.append(base64.b64decode(s, validate=True))
            except ValueError as e:
                raise ConfigError(f"update_weights: frames_b64[{i}] is not base64 ({e}); encode each frame's "
                                  f"bytes with base64.b64encode(frame).decode('ascii')") from None
        r.apply(frames, update_info.base, update_info.target)

    def _finish(self) -> None:
        r = self.receiver  # before init nothing can be open: a no-op, as for vLLM's built-in backends
        if r is not None and r.target is not None:  # only an update whose frames were all validated and written
            self.last_finish = r.finish()

    def _receiver(self) -> MirrorReceiver:
        if self.receiver is None:
            raise NotInitializedError("the dcr weight-transfer engine is not initialized: call "
                                      "init_weight_transfer_engine({'checkpoint': ...}) first")
        return self.receiver


def worker_query(worker: Any, what: str, names: list[str] | None = None) -> dict[str, Any]:
    """(Run in a vLLM worker: ``llm.collective_rpc(worker_query, args=(what, names))``.) What this worker's
    ``dcr`` receiver holds, writing nothing: ``layout`` (fused groups, ignored and unresolved names, the
    capture summary, the mirrored names, whether the model's weights are ``unpacked``, its ``device``), ``tensors`` (the canonical tensors ``names``, all when None, as
    the worker serves them: :meth:`MirrorReceiver.canonical`; in this process, the mirror's own tensors),
    ``last_finish`` (statistics of the last finish or rollback). Never raises (a raise would put a
    tensor-parallel engine's replies out of step): returns ``{"ok", "error", "result"}``."""
    try:
        engine = getattr(worker, "weight_transfer_engine", None)
        r = engine._receiver() if isinstance(engine, DcrWeightTransferEngine) else None
        if r is None:
            raise NotInitializedError("this vLLM worker has no dcr weight-transfer engine")
        if what == "layout":
            result: Any = {"groups": r.groups, "ignored": r.ignored, "unresolved": r.unresolved,
                           "capture": r.capture_summary(), "mirrored": sorted(r.mirror),
                           "unpacked": is_unpacked(r.model), "device": engine.device.type}
        elif what == "tensors":
            result = {n: r.canonical(n) for n in (r.specs if names is None else names)}
        elif what == "last_finish":
            result = dict(engine.last_finish)
        else:
            raise ConfigError(f"worker_query: unknown query {what!r}")
        return {"ok": True, "error": None, "result": result}
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "result": None}
