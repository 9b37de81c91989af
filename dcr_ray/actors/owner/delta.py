"""Shard owners: diff a trainer shard against its committed baseline and stream encoded payloads.

Exactly one owner sends each canonical element. Data-parallel replicas hold bit-identical tensors,
so the canonical names are split between them by a stable hash (:func:`owned_names`); each owner
sends only its share.

How a trainer becomes an owner (:mod:`~dcr_ray.actors.owner.held`): it holds a :class:`~dcr_ray.actors.owner.held.Owner`
(composition), mixes in :class:`~dcr_ray.actors.owner.held.OwnerMixin`, or hands its tensors to a
:class:`~dcr_ray.actors.owner.held.StandaloneOwner` actor. This module is the logic under all three,
:class:`DeltaOwner`, independent of Ray.

Protocol (driven by the coordinator through each owner's :class:`~dcr_ray.actors.owner.endpoint.OwnerEndpoint`;
every call is idempotent for the same arguments)::

    dcr_attach(owner_id, config, baseline_dir=None, in_memory=False, version=0) -> specs
                                                 # baseline := current bits, at ``version``
    dcr_stream(transfer, attempt, base, target, sink, base_id="", coding=None) -> summary
        attempt 0: diff every tensor, keep the changed set *pending*, send mixed (XOR/OVERWRITE) frames
                   coded as ``coding`` says (the coordinator's choice; see DeltaOwner.stream)
        attempt>0: re-send the same pending changed set as OVERWRITE (repairs any partial XOR); when
                   the failed attempt's diff stopped part way (its sink raised mid-stream), the
                   pending set is incomplete, so the retry diffs again from the same committed
                   baseline: a retry always carries the transfer's whole changed set
    dcr_promote(version)                         # after the commit record: pending -> baseline
                                                 # (in a background thread unless
                                                 # config.owners.promote is "inline")
    dcr_discard()                                # abandoned transfer: baseline unchanged
    dcr_bootstrap(transfer, sink) -> summary     # dense frames of the committed baseline (its version)
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Iterable, Mapping

from dcr_ray import metrics
from dcr_ray.actors.owner.coding import stream_coding
from dcr_ray.codec import BOOTSTRAP_BASE, FrameMeta, PayloadKey, encode_frames
from dcr_ray.codec.bits import wire_name
from dcr_ray.codec.compiled import kernels
from dcr_ray.codec.encoding.baseline import BaselineStore
from dcr_ray.codec.encoding.diff import TensorDelta, full_delta
from dcr_ray.codec.encoding.packdiff import PackDelta
from dcr_ray.config import RefitConfig
from dcr_ray.errors import BaselineError, ConfigError
from dcr_ray.failpoints import failpoint
from dcr_ray.heap import return_free_heap
from dcr_ray.sharding import Shard, ShardSpec, canonical_specs, project_all, resolve_shards
from dcr_ray.sharding.device import DeviceBaseline, delta_from_changes
from dcr_ray.sharding.digest import shard_digests

if TYPE_CHECKING:  # annotations only: torch is imported where it runs
    import torch

log = logging.getLogger(__name__)

def stable_hash(name: str) -> int:
    """A process-independent hash of a tensor name (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def owned_names(names: Iterable[str], rank: int, world: int) -> list[str]:
    """The names rank ``rank`` of ``world`` bit-identical replicas owns (each name has one owner)."""
    if not 0 <= rank < world:
        raise ConfigError(f"rank must be in 0..{world - 1}, got {rank}")
    return [n for n in names if stable_hash(n) % world == rank]


class DeltaOwner:
    """The owner logic, independent of Ray: baseline, diff, pending set, frame streaming.

    The baseline, the diff and the pending set are in *local* coordinates (one entry per local tensor,
    see :mod:`dcr_ray.sharding.local`); frames are built from their projection into canonical
    coordinates, so a retry or a promote never needs the canonical tensors.
    """

    def __init__(self, owner_id: str, config: RefitConfig, *, baseline_dir: str | None = None,
                 in_memory: bool = False):
        self.owner_id = owner_id
        self.config = config
        # By default the committed bits stay in memory, so no commit writes changed pages back to a disk.
        # A directory (the call's, else OwnerConfig.baseline_dir) holds this owner's files in a private
        # directory of its own: owners of one node may share the setting, and close() removes it.
        parent = baseline_dir if baseline_dir is not None else config.owners.baseline_dir
        try:
            self.store = BaselineStore(in_memory=in_memory or parent is None, temp_parent=parent,
                                       prefix=f"dcr_baseline_{owner_id}_", chunk_elems=config.codec.chunk_elems)
        except OSError as e:
            raise BaselineError(f"owner {owner_id}: cannot keep its baseline under {parent!r} ({e}); give "
                                f"OwnerConfig.baseline_dir a writable directory on the owners' nodes, or None to "
                                f"keep baselines in memory") from None
        self._pending_transfer: str | None = None
        #: whether the pending set holds the pending transfer's whole changed set (its diff ran to the end)
        self._pending_complete = False
        self._last_summary: dict | None = None
        #: whether it ever streamed (a coordinator used it under ``owner_id``: its id is fixed from then on)
        self.used = False
        self._promoting: threading.Thread | None = None
        self._promoting_version: int | None = None
        self._promote_error: BaseException | None = None
        self._promote_again: int | None = None  # the version whose failed background promote runs again
        self._promote_lock = threading.RLock()
        self.specs: dict[str, ShardSpec] = {}
        self._plans: list = []  # packs of small direct tensors (BaselineStore.plan_packs), fixed at attach
        self._unpacked: list[str] = []  # the other tensors, diffed one by one
        self._numel_total = 0
        #: committed bits of this owner's GPU shards on their device (``OwnerConfig.gpu_baseline``)
        self.device = DeviceBaseline()
        kernels.warm_up()  # load the scan kernels while the trainer starts

    # -- setup ------------------------------------------------------------------------------------
    def attach(self, tensors: Mapping[str, object], version: int = 0) -> dict[str, tuple]:
        """Take the current bits as the committed baseline of ``version`` (0 at launch; a replacement
        owner joins at the committed version and proves it by :meth:`digests`); returns what this owner
        covers: canonical name -> (wire dtype, shape) for whole tensors, (wire dtype, shape, boxes) for parts."""
        shards = resolve_shards(tensors, to_host=False)
        if not self.store.names():
            for name, sh in shards.items():
                on_gpu = sh.tensor.device.type != "cpu"
                self.store.add(name, sh.tensor.detach().cpu() if on_gpu else sh.tensor)
                if on_gpu and self.config.owners.gpu_baseline == "device":
                    self.device.add(name, sh.tensor)
                self.specs[name] = sh.spec
            self.store.version = version
            self._plans = self.store.plan_packs([n for n in self.store.names() if self._packable(n)])
            packed_names = {n for plan in self._plans for n in plan.names}
            self._unpacked = [n for n in self.store.names() if n not in packed_names]
            self._numel_total = sum(self._numel(n) for n in self.store.names())
        else:
            self._check_layout(shards)
        return canonical_specs({n: Shard(shards[n].tensor, self.specs[n]) for n in self.store.names()}, wire_name)

    def digests(self) -> dict:
        """Digest of every canonical box of the committed baseline (see :mod:`dcr_ray.sharding.digest`)."""
        self.settle()
        return shard_digests({n: (self.store.tensor(n), self.specs[n]) for n in self.store.names()})

    def _check_layout(self, shards: Mapping[str, Shard]) -> None:
        """The local tensors and their specs are those of attach (a layout change needs a new owner)."""
        extra = sorted(set(shards) - set(self.store.names()))
        if extra:
            raise BaselineError(f"owner {self.owner_id}: dcr_tensors() gained {extra[:5]} after attach; engines "
                                f"were checked against the tensors of attach (relaunch to add tensors)")
        for name in self.store.names():
            sh = shards.get(name)
            if sh is None:
                raise BaselineError(f"owner {self.owner_id}: tensor {name!r} disappeared from dcr_tensors()")
            if sh.spec is not self.specs[name] and sh.spec != self.specs[name]:
                raise BaselineError(f"owner {self.owner_id}: the shard layout of {name!r} changed since attach "
                                    f"(resharding needs a new owner)")

    # -- one transfer -------------------------------------------------------------------------------
    def stream(self, tensors: Mapping[str, torch.Tensor], *, transfer: str, attempt: int, base: int,
               target: int, sink, base_id: str = "", coding: str | None = None) -> dict:
        """Diff (attempt 0) or reuse the pending set (retries) and send every frame through ``sink``.

        ``base_id`` names the committed content ``base`` (the commit record's transfer); every frame
        carries it, so an engine holding other content with the same version number refuses them.
        ``coding``: ``"plain"`` or ``"context"`` for a first attempt; None takes ``CodecConfig.coding``
        (``"auto"``, which a coordinator decides per refit, is plain for an owner streaming on its own)."""
        failpoint("owner.stream")
        coding = stream_coding(self.config.codec.coding, coding, self.owner_id)
        self.used = True
        self.settle()
        if base != self.store.version:
            raise BaselineError(
                f"owner {self.owner_id} holds committed version {self.store.version}, asked to diff "
                f"from {base}: the coordinator and owner disagree on the committed version"
            )
        key = (transfer, attempt)
        if self._last_summary is not None and self._last_summary["key"] == key:
            return self._last_summary  # a repeated call (Ray may deliver a call twice)
        t0 = time.perf_counter()
        # A retry reuses the pending set only if the diff that built it ran to the end: the diff is lazy
        # (frames leave while it still reads), so an attempt whose sink raised mid-stream kept only what
        # it had reached, and the retry diffs again from the same committed baseline (the trainer's
        # tensors are not released before the refit answers).
        fresh = (self._pending_transfer != transfer or self.store.pending_version != target
                 or not self._pending_complete)
        mode = "mixed" if (attempt == 0 and self.config.codec.encodings == "mixed") else "overwrite"
        read = {"at": t0}  # when the diff last read the trainer's tensors (a retry reads none of them)
        if fresh:
            self.store.begin(target)
            self.device.discard()
            self._pending_transfer, self._pending_complete = transfer, False
            deltas = _noting_end(self._diff_all(tensors, coding), read, self._diff_done)
        else:
            deltas = iter(self.store.pending())
        summary = self._send(deltas, transfer=transfer, attempt=attempt, base=base, target=target,
                             mode=mode, sink=sink, t0=t0, base_id=base_id, coding=coding)
        summary["released_s"] = read["at"] - t0  # from here the trainer may change its tensors again
        summary["key"] = key
        summary["numel"] = self._numel_total
        self._last_summary = summary
        metrics.record("owner_wire", summary["wire_bytes"], tags={"owner": self.owner_id})
        metrics.record("owner_seconds", time.perf_counter() - t0, tags={"owner": self.owner_id})
        return summary

    def _diff_done(self) -> None:
        self._pending_complete = True

    def _numel(self, name: str) -> int:
        return len(self.store.bits(name))

    def _packable(self, name: str) -> bool:
        """Whether ``name`` is diffed and sent in packs: a small whole tensor on the CPU path, sent as is."""
        spec = self.specs[name]
        return (self.store.in_arena(name) and spec.is_direct and spec.cells[0].name == name
                and not spec.overwrite_only and name not in self.device)

    def _diff_all(self, tensors: Mapping[str, object], coding: str) -> Iterable[TensorDelta | PackDelta]:
        shards = resolve_shards(tensors, to_host=False)
        self._check_layout(shards)
        for plan in self._plans:  # small tensors: one scan per pack
            ts = [shards[n].tensor for n in plan.names]
            ts = [t if t.is_cpu and t.is_contiguous() else t.detach().cpu().contiguous() for t in ts]
            pd = self.store.diff_pack(plan, ts)
            if pd is not None:
                self.store.add_pending(pd)
                yield pd
        for name in self._unpacked:
            t = shards[name].tensor
            if name in self.device:  # diffed on its GPU: only the changes come to the host
                pos, new = self.device.changes(name, t)
                td = delta_from_changes(name, t, pos, new, self.store.bits(name),
                                        chunk_elems=self.config.codec.chunk_elems)
            else:
                td = self.store.diff(name, t if t.device.type == "cpu" else t.detach().cpu(),
                                     class_order=coding == "context")
            if td.chunks:
                self.store.add_pending(td)
                yield td

    def _send(self, deltas, *, transfer, attempt, base, target, mode, sink, t0, base_id: str = "",
              coding: str = "plain") -> dict:
        meta = FrameMeta(transfer=transfer, attempt=attempt, producer=self.owner_id, payload=0,
                         base=base, target=target, base_id=base_id)
        payloads: list[PayloadKey] = []
        wire = 0
        send_s = 0.0
        # XOR masks of dense local chunks and of pending chunks (which keep none) come from the committed
        # bits, and only mixed frames read masks; bootstrap sends absolute bits only
        old = self.store.bits if base != BOOTSTRAP_BASE else None
        if mode == "mixed":  # pending packs keep no masks either
            deltas = (self.store.with_xor(d) if isinstance(d, PackDelta) else d for d in deltas)
        canonical = project_all(deltas, self.specs, chunk_elems=self.config.codec.chunk_elems, old_bits=old,
                                with_xor=mode == "mixed")
        overwrite_only = {n: False for s in self.specs.values() if s.overwrite_only for n in s.names}
        for frame in encode_frames(canonical, meta, mode=mode, bucket_bytes=self.config.codec.bucket_bytes,
                                   zstd_level=self.config.codec.zstd_level, key=self.config.codec.key,
                                   xor_ok=overwrite_only, coding=coding):
            key = PayloadKey(transfer, attempt, self.owner_id, len(payloads))
            ts = time.perf_counter()
            failpoint("owner.send.before")
            sink.send(frame, key)
            failpoint("owner.send.after")
            send_s += time.perf_counter() - ts
            payloads.append(key)
            wire += len(frame)
        ts = time.perf_counter()
        failpoint("owner.drain")
        sink.drain()
        send_s += time.perf_counter() - ts
        changed = sum(td.changed for td in self.store.pending()) if base != BOOTSTRAP_BASE else 0
        return {
            "producer": self.owner_id,
            "payloads": payloads,
            "wire_bytes": wire,
            "changed": changed,
            "construct_s": time.perf_counter() - t0 - send_s,
            "send_wait_s": send_s,
            "mode": mode,
            "coding": coding,
        }

    def bootstrap(self, *, transfer: str, sink) -> dict:
        """Send the committed baseline densely (frames with base :data:`BOOTSTRAP_BASE`)."""
        self.used = True
        failpoint("owner.bootstrap")
        self.settle()
        t0 = time.perf_counter()
        deltas = (full_delta(n, self.store.tensor(n), chunk_elems=self.config.codec.chunk_elems)
                  for n in self.store.names())
        summary = self._send(deltas, transfer=transfer, attempt=0, base=BOOTSTRAP_BASE,
                             target=self.store.version, mode="overwrite", sink=sink, t0=t0)
        summary["numel"] = self._numel_total
        return summary

    def promote(self, version: int) -> int:
        """Fold the pending set of ``version`` into the baseline (the commit record is written).

        With ``config.owners.promote == "background"`` this returns at once (``-1``) and a thread does the
        writes; every later call that reads the baseline waits for it first (:meth:`settle`).
        Idempotent: promoting the version being or already promoted does nothing.
        """
        failpoint("owner.promote")
        with self._promote_lock:
            if self._promoting is not None and self._promoting_version == version:
                return -1  # a repeated call while this version's promote runs
            self.settle()
            if self.config.owners.promote == "inline":
                return self._promote_now(version)
            if self.store.version == version:
                return 0  # already promoted
            if self.store.pending_version != version:  # checked here, so a wrong call leaves no damage
                raise BaselineError(f"owner {self.owner_id}: promote({version}) but the pending set is for "
                                    f"{self.store.pending_version}")
            th = threading.Thread(target=self._promote_in_background, args=(version,),
                                  name=f"dcr-promote-v{version}", daemon=True)
            self._promoting, self._promoting_version = th, version
            th.start()
            return -1

    def _promote_now(self, version: int) -> int:
        failpoint("owner.promote.write")
        n = self.store.promote(version)
        self.device.promote()
        self._pending_transfer, self._pending_complete = None, False
        self._last_summary = None
        return_free_heap()  # the transfer's diff chunks and frames
        return n

    def _promote_in_background(self, version: int) -> None:
        try:
            self._promote_now(version)
        except BaseException as e:  # surfaced by the next settle(), which runs it once more first
            self._promote_error, self._promote_again = e, version

    def settle(self) -> None:
        """Wait for a background promote. One that failed runs once more here, before anything reads the
        baseline: a promote writes each change's new bits at its position (the host baseline's and the
        device's), so running it again over a write that stopped part-way gives the same baseline. If that
        fails too, ``BaselineError``, for good: the baseline no longer matches the commit record."""
        with self._promote_lock:
            if self._promoting is not None:
                self._promoting.join()
                self._promoting = self._promoting_version = None
            if self._promote_error is not None and self._promote_again is not None:
                version, self._promote_again = self._promote_again, None
                try:
                    self._promote_now(version)
                    log.warning("dcr_ray: owner %s: promoting version %d failed (%r); it ran again and "
                                "succeeded", self.owner_id, version, self._promote_error)
                    self._promote_error = None
                except BaseException as again:
                    self._promote_error = again
            e = self._promote_error
            if e is not None:  # sticky: the baseline no longer matches the commit record
                raise BaselineError(f"owner {self.owner_id}: promoting the committed changed set failed: "
                                    f"{type(e).__name__}: {e}; its baseline no longer matches the commit "
                                    f"record (relaunch the topology)") from e

    def discard(self) -> None:
        failpoint("owner.discard")
        self.settle()
        self.store.discard()
        self.device.discard()
        self._pending_transfer, self._pending_complete = None, False
        self._last_summary = None
        return_free_heap()

    @property
    def version(self) -> int:
        self.settle()
        return self.store.version


def _noting_end(deltas, read: dict, done):
    """``deltas`` passed through; once the last one was taken, ``read["at"]`` becomes that time (the diff
    then has read every tensor of the trainer's: the pending set holds the changes, the frames may still
    be encoding and sending) and ``done()`` is called. A stream that stops early (its sink raised) never
    gets there: the pending set is partial, and a retry diffs again."""
    yield from deltas
    failpoint("owner.diff")
    read["at"] = time.perf_counter()
    done()
