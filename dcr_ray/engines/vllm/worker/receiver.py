"""One vLLM worker's receiver: a canonical host mirror that takes frames and reloads whole fused groups.

Used by the ``dcr`` weight-transfer backend (:mod:`~dcr_ray.engines.vllm.worker.transfer`), which vLLM runs
inside every worker process (each tensor-parallel rank), so the engine that receives is the engine
that serves, whoever started it. Protocol of one update::

    apply(frames, base, target)
                               the mirror holds ``base`` (or ``base`` is the bootstrap base: dense frames
                               of a whole version) and every frame is validated (digest, header, items
                               against the checkpoint's tensors, base version) before the update opens
                               or any frame is written into the mirror; the bits each write replaces
                               are kept
    reset()                    after any failure: the mirror gets those bits back, the update closes,
                               the version does not move
    finish()                   touched tensors, grown to whole fused groups, go through vLLM's in-place
                               reload plus the post-load steps a fresh load runs (fused experts,
                               aliasing modules); the mirror now holds ``target``. A reload that
                               fails part way leaves the version None: only dense frames (a
                               bootstrap) open the next update

The mirror is what the worker's loader is fed, never what is checked: the start-up self-check
(:meth:`MirrorReceiver.check_reload_is_a_fresh_load`) compares the served parameters themselves.
Having passed it, the mirror *is* what the worker serves (reloading it changes no served bit), and every
``finish`` keeps it so; that is why :meth:`MirrorReceiver.verify` (does this worker serve committed
version v?) digests the mirror.

With ``capture`` (parameters the engine computes from: CUDA, or vLLM-CPU with its weights unpacked,
:mod:`~dcr_ray.engines.vllm.worker.unpacked`) the model's loader is probed once per tensor at start-up
(:class:`~dcr_ray.engines.vllm.worker.capture.LoaderCapture`); tensors whose loader path is a plain view copy
get no mirror at all: their changes are kept, decoded, until ``finish`` writes them sparsely into live
storage through the recorded copies. Only the rest (whole fused groups) keep a host mirror, and so do the
groups the start-up check finds the engine does not compute from (:mod:`~dcr_ray.engines.vllm.worker.startup`).

In-place undo. The bits every frame replaces in the mirror are kept while its update is open, so
:meth:`MirrorReceiver.reset` can close a failed update. A driver that may abandon an update *after*
``finish`` (dcr_ray's own engines: a refit whose commit failed) starts the receiver with
``keep_undo=True``: a finished update's undo record is then kept until :meth:`MirrorReceiver.commit`
(or the next update), later attempts of the same update reopen it and stack their own records, and
:meth:`MirrorReceiver.rollback` takes the mirror back to ``base`` and reloads what those attempts
reloaded, so the worker serves ``base`` again. Writes made through captured copies into live storage keep
the bits they replaced too (O(changes)), and a rollback puts them back first.
"""

from __future__ import annotations

from typing import Any

import torch

from dcr_ray.codec import BOOTSTRAP_BASE, DecodedFrame, DecodedItem, apply_decoded, decode_frame, open_frame
from dcr_ray.codec.decoding.undo import UndoLog
from dcr_ray.codec.format import DEFAULT_MAX_RAW_BYTES
from dcr_ray.engines.vllm.checkpoint import checkpoint_files, checkpoint_specs, iter_checkpoint
from dcr_ray.engines.vllm.worker.capture import LoaderCapture
from dcr_ray.engines.vllm.worker.groups import fused_groups, reload_groups, whole_groups
from dcr_ray.engines.vllm.worker.startup import check_reload, stale_captures
from dcr_ray.engines.vllm.worker.verify_request import checked_boxes
from dcr_ray.errors import BackendError, EngineStateError

#: Bound on one frame's decompressed size in a worker: two of the largest bucket a sender may use.
MAX_FRAME_RAW_BYTES = DEFAULT_MAX_RAW_BYTES


class MirrorReceiver:
    """The canonical tensors of ``checkpoint`` in host memory, applied to and reloaded into ``model``.

    ``own_checkpoint``: the engine was started from ``checkpoint`` by the caller (dcr_ray's
    :class:`~dcr_ray.engines.vllm.backend.VllmBackend`), so checkpoint names no module of the model
    resolves are reloaded together with every tensor (a whole-model group: slow but exact) instead of
    refused as a sign of the wrong checkpoint. ``keep_undo``: see the module docstring.
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any, checkpoint: str, *, key: bytes | None = None,
                 version: int | None = 0, capture: bool = False,
                 keep_undo: bool = False, own_checkpoint: bool = False):
        self.model = model
        self.vllm_config = vllm_config
        self.key = key
        self.checkpoint = checkpoint
        self.version = version
        self.keep_undo = keep_undo
        files = self._files = checkpoint_files(checkpoint)
        self.specs = checkpoint_specs(checkpoint)
        info = fused_groups(model, list(self.specs))
        if info["unresolved"] and not own_checkpoint:
            raise BackendError(f"{len(info['unresolved'])} checkpoint tensors map to no module of the served "
                               f"model (e.g. {info['unresolved'][:3]}): is {checkpoint!r} the engine's checkpoint?")
        self.groups: list[list[str]] = info["groups"]
        self.ignored: list[str] = info["ignored"]
        self.unresolved: list[str] = info["unresolved"]
        self.group_of = {n: i for i, g in enumerate(self.groups) for n in g}
        self.capture: LoaderCapture | None = None
        mirrored = set(self.specs)
        if capture:  # must run while live storage holds the checkpoint's bits (right after start-up)
            from vllm.config import set_current_vllm_config

            self.capture = LoaderCapture(model, context=lambda: set_current_vllm_config(vllm_config))
            for n, t in iter_checkpoint(files):
                self.capture.probe(n, t)
            self.capture.finish()
            mirrored = {n for n, (kind, _) in self.capture.summary().items() if kind != "affine"}
            mirrored = {m for n in mirrored if n in self.group_of for m in self.groups[self.group_of[n]]}
        self.mirror = {n: t.contiguous() for n, t in iter_checkpoint(files, mirrored)}
        self.captured: list = []  # the open update's captured writes, prepared (LoaderCapture.prepare)
        self.touched: set[str] = set()
        self._undo = UndoLog()  # the mirror bits the open update's frames replaced (reset puts them back)
        self.base: int | None = None
        self.target: int | None = None
        # keep_undo: the finished (not yet committed) update, its attempts' undo records, what they reloaded
        self.kept_update: tuple[int, int] | None = None
        self._kept: list[UndoLog] = []
        self._kept_names: set[str] = set()
        self._kept_captured: list[list] = []  # per finished attempt, the live bits its captured writes replaced
        #: the start-up self-check passed: the mirror holds exactly what the worker serves
        self.mirror_is_served = False

    def capture_summary(self) -> dict[str, tuple[str, str]]:
        """``name -> (kind, reason)`` of every probed tensor (empty without capture)."""
        return self.capture.summary() if self.capture is not None else {}

    def check_reload_is_a_fresh_load(self) -> None:
        """Prove, before the first frame, that every path a refit writes through gives what a fresh load
        gives (:mod:`~dcr_ray.engines.vllm.worker.startup`): captured tensors whose writes do not reach what
        the engine computes with move to the reload path (whole fused groups, mirrored from now on); then
        the checkpoint's own bits go through the reload of every mirrored tensor, and if anything served
        moves the start is refused. A refusal writes nothing (what was served is put back and proven
        unchanged by :func:`~dcr_ray.engines.vllm.worker.served.served_fingerprint`), so an engine given the
        wrong checkpoint goes on serving exactly what it served."""
        if self.capture is not None:
            captured = [n for n in self.group_of if n not in self.mirror and
                        self.capture.plans.get(n) is not None and self.capture.plans[n].kind == "affine"]
            stale = stale_captures(self.model, self.vllm_config, self.capture, self._files, captured)
            for n, why in stale.items():
                self.capture.demote(self.groups[self.group_of[n]], why)
            self._mirror_groups(stale)
        if self.mirror:
            check_reload(self.model, self.vllm_config, self._items(self.mirror), self._refused)
        self.mirror_is_served = True

    def _mirror_groups(self, names) -> None:
        """Mirror ``names``, grown to whole fused groups, from the checkpoint (they go through the reload)."""
        want = {m for n in names if n in self.group_of for m in self.groups[self.group_of[n]]} - set(self.mirror)
        self.mirror.update((n, t.contiguous()) for n, t in iter_checkpoint(self._files, want))

    def _refused(self, changed: list[str]) -> str:
        started = getattr(getattr(self.vllm_config, "model_config", None), "model", None)
        return (f"init refused, nothing served changed: reloading the checkpoint {self.checkpoint!r} is not a "
                f"fresh load of what this worker serves: it changed {len(changed)} served tensor(s) or layer(s) "
                f"(e.g. {changed[:4]}); the bits served before were put back and proven unchanged on integer "
                f"views and on each linear layer's output. Either that checkpoint is not the one the engine "
                f"serves (it was started from {started!r}: give that directory, or one holding the same bits), "
                f"or vLLM's weight reload is not a fresh load for this model on this vLLM version and dcr_ray "
                f"cannot refit it exactly (mode='capture' avoids the reload path for the tensors it captures)")

    def apply(self, frames: list[bytes], base: int, target: int) -> int:
        """Frames of the update ``base -> target``: the first call opens it (or reopens it, when it is the
        finished update whose undo record is kept), later calls must name the same. Every frame is
        validated (and the mirror's version checked) before the update opens or anything is written;
        then they are written into the mirror, each after the bits it replaces are kept (:meth:`reset`
        puts them back). Returns elements written."""
        reopen = self.target is None and self.kept_update == (base, target)
        if self.target is None and not reopen:
            if base != BOOTSTRAP_BASE and base != self.version:
                held = ("no version (an abandoned update wrote into it)" if self.version is None
                        else f"version {self.version}")
                raise EngineStateError(f"this vLLM worker's mirror holds {held}; an update from {base} cannot "
                                       f"apply (bootstrap it densely first)")
        elif self.target is not None and (base, target) != (self.base, self.target):
            raise EngineStateError(f"frames for {base}->{target} inside the update {self.base}->{self.target}")
        decoded = [decode_frame(open_frame(f, key=self.key), shapes=self.specs, expect_base=base,
                                max_raw_bytes=MAX_FRAME_RAW_BYTES) for f in frames]
        # captured items become their writes into live storage now, while the engine serves (checked, mapped)
        captured = [] if self.capture is None else self.capture.prepare(
            it for frame in decoded for it in frame.items if it.name not in self.mirror and not self._ignored(it.name))
        if self.target is None and not reopen:
            self._drop_kept()  # another update opens: the kept one was committed or given up
        self.base, self.target = base, target
        n = 0
        for frame in decoded:
            mirrored = DecodedFrame(meta=frame.meta, items=[it for it in frame.items if it.name in self.mirror])
            self._undo.record(f"{base}->{target}", mirrored, self.mirror)
            self.touched.update(it.name for it in mirrored.items)
            n += apply_decoded(mirrored, self.mirror)
        self.captured.extend(captured)
        return n

    def _ignored(self, name: str) -> bool:
        """The model's loader does not store ``name`` (a reload would drop it too): its frames write nothing."""
        plan = self.capture.plans.get(name)
        return plan is not None and plan.kind == "ignored"

    def reset(self) -> None:
        """Close the update in flight after a failure: the mirror gets back the bits the open attempt's
        frames replaced (it holds what the worker still serves: nothing was reloaded since), captured
        changes are dropped unwritten, and the version does not move. Idempotent."""
        if self.touched:
            try:
                self._undo.rollback(_MirrorWriter(self.mirror))
            except Exception:  # the mirror matches no version now: only a dense bootstrap restores it
                self.version = None
                self._drop_kept()
        self._undo.clear()
        self.touched.clear()
        self.captured = []
        self.base = self.target = None

    def finish(self) -> dict[str, int]:
        """Push the touched groups through the loader; the worker now serves ``target``."""
        if self.target is None:
            raise EngineStateError("finish_weight_update without a matching start")
        stats = {"reloaded_tensors": 0, "reprocessed_modules": 0, "captured_elements": 0}
        keep = self.keep_undo and self.base != BOOTSTRAP_BASE
        captured_undo: list | None = [] if keep else None  # the live bits the captured writes replace
        try:
            if self.captured:
                stats["captured_elements"] = self.capture.write(self.captured, undo=captured_undo)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.captured = []
            if self.touched:
                res = reload_groups(self.model, self.vllm_config, self._items(self.touched))
                stats.update(reloaded_tensors=res["tensors"], reprocessed_modules=len(res["reprocessed"]))
        except BaseException:  # part of the update may be served already: what is served matches no version
            self.reset()
            self.version = None  # only a dense bootstrap restores it
            self._drop_kept()
            raise
        if keep:
            self.kept_update = (self.base, self.target)
            self._kept.append(self._undo)
            self._kept_names |= self.touched
            if captured_undo:
                self._kept_captured.append(captured_undo)
            self._undo = UndoLog()
        self.touched.clear()
        self._undo.clear()
        self.version, self.base, self.target = self.target, None, None
        return stats

    def abandon(self) -> None:
        """Leave an update that will not finish (its refit was abandoned): as :meth:`reset`."""
        self.reset()

    def rollback(self, base: int, target: int) -> dict[str, int]:
        """Undo the update ``base -> target`` in place, open or finished and kept (``keep_undo``): every
        attempt's writes are undone, newest first (in the mirror, and in live storage where they were
        captured writes: the bits each replaced were kept), and what finished attempts reloaded is reloaded
        again, so the worker serves ``base``. :class:`EngineStateError` when no such update is held."""
        held = (self.base, self.target) if self.target is not None else self.kept_update
        if held != (base, target) or base == BOOTSTRAP_BASE:
            raise EngineStateError(f"rollback of {base}->{target}: this worker holds no undo record of it "
                                   f"(it holds {'nothing open' if held is None else '%s->%s' % held})")
        stats = {"reloaded_tensors": 0, "reprocessed_modules": 0}
        try:
            self.reset()  # the open attempt, if any: the mirror is back at what the worker serves
            for log in reversed(self._kept_captured):
                self.capture.undo(log)
            writer = _MirrorWriter(self.mirror)
            for log in reversed(self._kept):
                log.rollback(writer)
            if self._kept_names:
                res = reload_groups(self.model, self.vllm_config, self._items(self._kept_names))
                stats.update(reloaded_tensors=res["tensors"], reprocessed_modules=len(res["reprocessed"]))
        except BaseException:
            self.version = None  # part of it may be undone: only a dense bootstrap restores the worker
            self._drop_kept()
            raise
        self._drop_kept()
        self.version = base
        return stats

    def commit(self, version: int) -> None:
        """The driver's word that ``version`` is committed and served here (after its commit record):
        the kept undo record is dropped and ``version`` is the next update's base."""
        if self.target is not None:
            raise EngineStateError(f"commit of version {version} inside the open update {self.base}->{self.target}")
        self._drop_kept()
        self.version = version

    def invalidate(self) -> None:
        """This worker's version is unknown from now on (another rank of its engine failed the finish this
        one completed, so the engine serves no single version): only dense frames open the next update."""
        self._drop_kept()
        self.version = None

    def _drop_kept(self) -> None:
        self.kept_update = None
        self._kept = []
        self._kept_names = set()
        self._kept_captured: list[list] = []

    def adopt_served(self, previous: "MirrorReceiver") -> None:
        """Re-initialisation: take over from ``previous`` (the receiver the worker served through) without
        writing anything. Its mirror is what the worker serves (its self-check passed and every finish
        kept it so); this receiver's checkpoint must hold exactly those bits, else :class:`BackendError`
        and nothing changed (the worker goes on serving ``previous.version``). Tensors ``previous`` reloads
        are reloaded here too (its start-up check is what proved which captured writes are served)."""
        if previous.target is not None:
            raise EngineStateError(f"re-initialisation inside the open update {previous.base}->{previous.target}")
        if not previous.mirror_is_served or previous.version is None:
            raise BackendError("re-initialisation: the worker cannot show what it serves (its mirror holds no "
                               "version): restart the engine from a checkpoint")
        if self.capture is not None:  # only what the start-up check proved may be written through captures
            unproven = [n for n in self.group_of if n not in self.mirror and n in previous.mirror]
            self.capture.demote(unproven, "the receiver this one took over from reloads it")
            self._mirror_groups(unproven)
        differ = sorted(n for n, t in self.mirror.items()
                        if not torch.equal(_bits(t), _bits(previous.canonical(n))))
        if differ:
            raise BackendError(
                f"re-initialisation refused, nothing written: this worker serves version {previous.version}, "
                f"and {len(differ)} of {len(self.mirror)} tensors of the checkpoint given differ from it (e.g. "
                f"{differ[:3]}); give the checkpoint of the version it serves")
        self.mirror_is_served = True

    def canonical(self, name: str) -> torch.Tensor:
        """The canonical bits of ``name`` this worker serves: its mirror, or (capture path) live storage
        read back through the recorded loader copies (:class:`BackendError` where this rank holds only a
        shard of the tensor)."""
        if name in self.mirror:
            return self.mirror[name]
        return self.capture.readback(name)

    def verify(self, boxes: list, version: int) -> None:
        """Check, writing nothing, that this worker serves the bits digested in ``boxes`` (committed
        ``version``); if so, the mirror holds ``version`` from now on (the next update's base).

        ``boxes``: ``[[name, start, stop, digest], ...]`` (:func:`dcr_ray.sharding.digest.box_digests`
        of the committed version, e.g. the owners' ``dcr_digests()``); together they must cover every
        element of every checkpoint tensor. What is digested: on the mirror path the host mirror, which
        the start-up self-check proved equal to the served parameters and every :meth:`finish` keeps
        equal; on the capture path, tensors without a mirror are read back from live storage through
        the loader's recorded copies. Raises :class:`EngineStateError` when a box differs, when the mirror
        is not known to be what is served (an abandoned update wrote into it, the self-check was
        skipped), or inside an open update; :class:`ConfigError` for a malformed request.
        """
        from dcr_ray.sharding.digest import box_digests

        if self.target is not None:
            raise EngineStateError(f"digest check inside the open update {self.base}->{self.target}")
        if self.version is None:
            raise EngineStateError("this vLLM worker's mirror holds no version (an abandoned update wrote into "
                                   "it): it must be bootstrapped densely")
        if not self.mirror_is_served:
            raise EngineStateError("the start-up reload check was skipped (verify_reload=False), so this worker "
                                   "cannot show that its mirror is what it serves")
        by_name = checked_boxes(boxes, self.specs)
        differ = []
        for name, bs in by_name.items():
            got = box_digests({name: self.canonical(name)}, [(name, s, e) for s, e, _ in bs])
            differ += [name for s, e, d in bs if got[(name, s, e)] != d]
        if differ:
            names = sorted(set(differ))
            raise EngineStateError(f"this vLLM worker does not serve the committed version {version}: "
                                   f"{len(names)} of {len(self.specs)} tensors differ (e.g. {names[:3]})")
        self._drop_kept()
        self.version = version

    def _items(self, names) -> list[tuple[str, torch.Tensor]]:
        """``names`` grown to whole fused groups, in checkpoint order, as loader input."""
        return [(n, self.mirror[n].detach()) for n in whole_groups(names, self.groups, self.group_of, self.specs)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    from dcr_ray.engines.vllm.worker.storage import int_view

    return int_view(t.detach().contiguous())


class _MirrorWriter:
    """The mirror as an undo target: inverse frames are written into it, nothing is reloaded."""

    def __init__(self, mirror: dict[str, torch.Tensor]):
        self.mirror = mirror

    def apply(self, frame: DecodedFrame) -> None:
        apply_decoded(frame, self.mirror)

    def flush(self) -> None:
        pass
