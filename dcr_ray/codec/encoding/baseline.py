"""Baselines: the committed bits of every owned tensor, plus the *pending* changed set of a transfer.

An owner diffs its current tensors against the committed baseline, keeps the changed set as pending
(sparse: coded positions + new bits per chunk, so pending costs less than the payload, not a model copy;
no XOR masks: promote and OVERWRITE retries never read them, and a frame that needs them takes them
again from these committed bits),
and only when the commit record is written :meth:`BaselineStore.promote` folds it into the baseline.
:meth:`BaselineStore.discard` drops it (attempt abandoned: the next diff starts from the same
committed bits, which is what makes a retry recompute the same changed set).

This store keeps each tensor's bits in a memory-mapped file (``directory``, a private temporary directory
unless given), so the page cache, not the owner's heap, holds the copy and the kernel may evict clean
pages when host RAM is short; ``in_memory=True`` keeps numpy arrays instead, which owners do unless
``OwnerConfig.baseline_dir`` names a directory: a file-backed page a promote changes is written back to
disk after the commit, and at 1% of the elements changed or more that is every page of a BF16 shard.
Small tensors (those packs take, :mod:`~dcr_ray.codec.packed`) share the few large maps of an
:class:`~dcr_ray.codec.arena.Arena`, whose stable addresses the pack kernels scan and promote through:
an MoE model's 10^5 expert tensors need a handful of maps, not 10^5.

Promote is O(changes) and leaves every page that holds no change clean:

* only changed positions are written: a sparse chunk scatters its new bits at its decoded positions; a
  DENSE chunk (kept whole because sparse coding would not be smaller) is compared with the committed bits
  and only the elements that differ are written, so equal bits are never rewritten;
* the mappings are advised ``MADV_RANDOM`` before they are first filled, so the page cache holds them in
  4 KiB folios. Without it the kernel's readahead builds large folios (up to 2 MiB, PMD-mapped on ext4),
  and the dirty bit is per folio: one changed element then marks its whole folio dirty and writeback
  rewrites all of it. Measured on ext4 (Linux 6.18), 64 Mi BF16 elements, 0.001% changed at random:
  663 pages hold a change; dirty after the scatter 25,876 pages without the advice, 663 with it
  (``/proc/self/smaps`` ``Private_Dirty`` after an ``msync``; ``dcr-ray bench refit`` reports the same
  count per refit as ``dirty_pages`` vs ``changed_pages``).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Iterable

import numpy as np

from dcr_ray.codec import packed
from dcr_ray.codec.arena import Arena, address, advise_small_folios as _advise_small_folios
from dcr_ray.codec.bits import bits_view, dtype_of, wire_name
from dcr_ray.codec.compiled import ptrkernels
from dcr_ray.codec.encoding.diff import (
    DEFAULT_CHUNK_ELEMS,
    DEFAULT_DENSE_CROSSOVER,
    TensorDelta,
    diff_tensor,
)
from dcr_ray.codec.encoding.packdiff import PackDelta, diff_pack
from dcr_ray.errors import BaselineError

if TYPE_CHECKING:  # annotations only: torch is imported where it runs
    import torch


class BaselineStore:
    """Committed bits per tensor name, versioned, with one pending changed set at a time."""

    def __init__(self, *, directory: str | None = None, in_memory: bool = False,
                 chunk_elems: int = DEFAULT_CHUNK_ELEMS, dense_crossover: float = DEFAULT_DENSE_CROSSOVER,
                 temp_parent: str | None = None, prefix: str = "dcr_baseline_"):
        """``directory``: where the memory-mapped files go; when None, a private temporary directory
        (named ``prefix``..., under ``temp_parent``, made if missing, or the system's temporary directory)
        that :meth:`close` removes."""
        self.in_memory = in_memory
        self._own_dir = False
        if not in_memory:
            if directory is None:
                if temp_parent is not None:
                    os.makedirs(temp_parent, exist_ok=True)
                directory = tempfile.mkdtemp(prefix=prefix, dir=temp_parent)
                self._own_dir = True
            os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.chunk_elems = chunk_elems
        self.dense_crossover = dense_crossover
        self.version = 0
        self._bits: dict[str, np.ndarray] = {}
        self._meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._pending: dict[str, TensorDelta] | None = None
        self._pending_version: int | None = None
        self._nfiles = 0  # memmap files ever created: a re-added name never reuses another's file
        #: small tensors (:func:`~dcr_ray.codec.packed.packable`) live in an arena: few maps, stable addresses
        self._arena = Arena(None if in_memory else directory)
        self._addr: dict[str, int] = {}
        self._pending_packs: list[PackDelta] = []

    # -- contents --------------------------------------------------------------------------------
    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Record ``tensor``'s current bits as the committed baseline of ``name``."""
        src = bits_view(tensor.detach().contiguous())
        self._addr.pop(name, None)  # a re-added name is placed afresh
        if packed.packable(name, len(src)):
            arr = self._arena.allocate(src.dtype, len(src))
            arr[:] = src
            self._addr[name] = address(arr)
        elif self.in_memory:
            arr = src.copy()
        else:
            fname = os.path.join(self.directory, f"{self._nfiles:06d}.bits")
            self._nfiles += 1
            arr = np.memmap(fname, dtype=src.dtype, mode="w+", shape=src.shape) if len(src) else src.copy()
            _advise_small_folios(arr)
            arr[:] = src
        self._bits[name] = arr
        self._meta[name] = (wire_name(tensor.dtype), tuple(tensor.shape))

    def names(self) -> list[str]:
        return list(self._bits)

    def in_arena(self, name: str) -> bool:
        """Whether ``name`` is a small tensor held in the arena (it can join a pack)."""
        return name in self._addr

    def __contains__(self, name: str) -> bool:
        return name in self._bits

    def meta(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(wire dtype, shape) of ``name``."""
        return self._meta[name]

    def bits(self, name: str) -> np.ndarray:
        """The committed flat bit array of ``name`` (do not write to it)."""
        try:
            return self._bits[name]
        except KeyError:
            raise BaselineError(f"no baseline for tensor {name!r}; known: {len(self._bits)} tensors") from None

    def tensor(self, name: str) -> torch.Tensor:
        """A fresh tensor holding the committed bits of ``name`` (for dense bootstrap and checks)."""
        import torch

        dt, shape = self._meta[name]
        out = torch.empty(shape, dtype=dtype_of(dt))
        bits_view(out)[:] = self._bits[name]
        return out

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._bits.values())

    # -- packs of small tensors ---------------------------------------------------------------------
    def plan_packs(self, names: Iterable[str]) -> list[PackPlan]:
        """Group the packable ``names`` (held in the arena) into packs by dtype, in order, each at most
        ``chunk_elems`` elements (a pack is bounded like a chunk); an owner plans once, diffs every refit."""
        by_dtype: dict[str, dict[str, int]] = {}
        for n in names:
            if n not in self._addr:
                raise BaselineError(f"{n!r} is not a small tensor held in the arena: it cannot join a pack")
            by_dtype.setdefault(self._meta[n][0], {})[n] = len(self._bits[n])
        return [PackPlan(grp, [self._meta[n][1] for n in grp], [self._bits[n] for n in grp],
                         np.fromiter((self._addr[n] for n in grp), np.int64, len(grp)), dtype_of(dt))
                for dt, sizes in by_dtype.items() for grp in packed.plan_packs(sizes, self.chunk_elems)]

    def diff_pack(self, plan: PackPlan, tensors: list[torch.Tensor]) -> PackDelta | None:
        """The pack of ``plan``'s tensors (``tensors``, in plan order) that changed, or None."""
        for name, t in zip(plan.names, tensors):
            if t.dtype is not plan.dtype:
                raise BaselineError(f"{name}: baseline holds {plan.dtype} but the tensor is {t.dtype}; owners "
                                    f"must hand the same canonical dtype and shape every step")
        try:
            return diff_pack(plan.names, plan.shapes, plan.old, tensors, plan.addrs)
        except ValueError as e:
            raise BaselineError(f"{e}; owners must hand the same canonical dtype and shape every step") from None

    def with_xor(self, pd: PackDelta) -> PackDelta:
        """``pd`` with its XOR masks (taken against the committed bits when ``pd`` is a pending form)."""
        if pd.xor is not None:
            return pd
        return dataclasses.replace(pd, xor=np.bitwise_xor(self._pack_take(pd), pd.new))

    def _pack_addrs(self, pd: PackDelta) -> np.ndarray:
        """The arena addresses of ``pd``'s tensors, in pack order."""
        return np.fromiter((self._addr[n] for n in pd.names), np.int64, len(pd.names))

    def _pack_take(self, pd: PackDelta) -> np.ndarray:
        """The committed bits at every position of ``pd``."""
        if ptrkernels.ENABLED:
            return ptrkernels.take_from(self._pack_addrs(pd), pd.offsets, pd.positions, pd.new.dtype)
        parts = [self._bits[pd.names[t]][rel] for t, _, rel in packed.per_tensor(pd.positions, pd.offsets)]
        return np.concatenate(parts)

    # -- diff / pending --------------------------------------------------------------------------
    def diff(self, name: str, tensor: torch.Tensor, *, class_order: bool = True) -> TensorDelta:
        """Changed set of ``tensor`` against the committed bits of ``name`` (not recorded); ``class_order``:
        see :func:`~dcr_ray.codec.encoding.diff.diff_tensor`."""
        old = self.bits(name)
        have = (wire_name(tensor.dtype), tuple(tensor.shape))
        if have != self._meta[name]:
            raise BaselineError(
                f"{name}: baseline holds {self._meta[name][0]}{list(self._meta[name][1])} but the tensor is "
                f"{have[0]}{list(have[1])}; owners must hand the same canonical dtype and shape every step"
            )
        return diff_tensor(name, old, tensor, chunk_elems=self.chunk_elems,
                           dense_crossover=self.dense_crossover, class_order=class_order)

    def begin(self, target_version: int) -> None:
        """Open the pending set of the transfer to ``target_version`` (drops any older pending set)."""
        if target_version <= self.version:
            raise BaselineError(f"target version {target_version} must exceed committed {self.version}")
        self._pending = {}
        self._pending_packs = []
        self._pending_version = target_version

    def add_pending(self, delta: TensorDelta) -> None:
        """Keep ``delta`` as the pending change of its tensor, in its pending form
        (:meth:`~dcr_ray.codec.encoding.diff.TensorDelta.pending_form`: positions and new bits, sharing ``delta``'s
        arrays; ``delta`` itself is not changed and may still go to a first attempt's frames)."""
        if self._pending is None:
            raise BaselineError("add_pending() before begin(): open a pending set first")
        if isinstance(delta, PackDelta):  # positions and new bits only, like a tensor's pending form
            self._pending_packs.append(dataclasses.replace(delta, xor=None))
            return
        self._pending[delta.name] = delta.pending_form()

    @property
    def pending_version(self) -> int | None:
        return self._pending_version

    def pending(self) -> list[TensorDelta | PackDelta]:
        """The pending changed sets: per tensor, then the packs (positions and new bits, no masks)."""
        return [*(self._pending or {}).values(), *self._pending_packs]

    def promote(self, version: int) -> int:
        """Fold the pending set into the committed baseline; returns elements written."""
        if self._pending is None or self._pending_version != version:
            if self.version == version:
                return 0  # already promoted (a repeated call is a no-op)
            raise BaselineError(f"promote({version}) but the pending set is for {self._pending_version}")
        n = 0
        for td in self._pending.values():
            arr = self._bits[td.name]
            for ch in td.chunks:
                n += write_changes(arr, ch)
        for pd in self._pending_packs:  # only the changed positions: untouched pages stay clean
            n += self._pack_put(pd)
        # No msync here: the memory-mapped files are private scratch space of this process (nothing
        # re-opens them), so forcing dirty pages to disk would buy no durability. It would cost time on
        # every commit: each flush writes the dirty pages out and write-protects them, so the next
        # promote's scattered writes fault again (BENCHMARKS.md, ``dcr-ray bench refit``).
        self.version = version
        self._pending = None
        self._pending_packs = []
        self._pending_version = None
        return n

    def _pack_put(self, pd: PackDelta) -> int:
        """Write ``pd``'s new bits into the committed bits of its tensors; returns the elements written."""
        if ptrkernels.ENABLED:
            ptrkernels.put_into(self._pack_addrs(pd), pd.offsets, pd.positions, pd.new)
        else:
            for t, s, rel in packed.per_tensor(pd.positions, pd.offsets):
                self._bits[pd.names[t]][rel] = pd.new[s]
        return pd.changed

    def pending_pages(self, page_bytes: int = mmap.PAGESIZE) -> int:
        """Pages of the baseline files that hold at least one pending change (positions decoded here:
        O(changes); for measurements, not on the refit's path)."""
        total = 0
        for td in (self._pending or {}).values():
            itemsize = self._bits[td.name].dtype.itemsize
            pages = [chunk_changes(self._bits[td.name], ch) * itemsize // page_bytes for ch in td.chunks]
            total += len(np.unique(np.concatenate(pages))) if pages else 0
        for pd in self._pending_packs:  # arena blocks are page-aligned maps: pages by address
            total += len(np.unique(self.pack_change_addresses(pd) // page_bytes))
        return total

    def pack_change_addresses(self, pd: PackDelta) -> np.ndarray:
        """The byte address in the arena of every change of ``pd`` (arena tensors share pages, so pages
        holding changes are counted by address)."""
        counts = np.diff(np.searchsorted(pd.positions, pd.offsets))
        w = pd.new.itemsize
        return np.repeat(self._pack_addrs(pd) - pd.offsets[:-1] * w, counts) + pd.positions * w

    def discard(self) -> None:
        """Drop the pending set; the committed baseline is unchanged."""
        self._pending = None
        self._pending_packs = []
        self._pending_version = None

    def close(self) -> None:
        self._bits.clear()
        self._addr.clear()
        self._arena.close()
        if self._own_dir and self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def chunk_changes(arr: np.ndarray, ch) -> np.ndarray:
    """Absolute positions where ``ch`` changes ``arr``: a sparse chunk's decoded positions; for a DENSE
    chunk the positions where its new bits differ from the committed ones (read, never written)."""
    if ch.is_dense:
        rel = np.flatnonzero(arr[ch.lo:ch.hi] != ch.dense)
        return rel + ch.lo
    return ch.positions()


def write_changes(arr: np.ndarray, ch) -> int:
    """Write chunk ``ch``'s new bits into ``arr`` at the changed positions only; returns the elements
    the chunk covers (its ``count``). Bit-identical to rewriting the chunk densely: an element that is
    not written already holds its new bits."""
    if ch.is_dense:
        rel = np.flatnonzero(arr[ch.lo:ch.hi] != ch.dense)
        if len(rel):
            arr[ch.lo + rel] = ch.dense[rel]
    elif ch.count:
        arr[ch.positions()] = ch.new
    return ch.count


@dataclasses.dataclass(frozen=True, slots=True)
class PackPlan:
    """A pack's fixed part, planned once: its tensors' names, shapes, committed bits and their addresses."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    old: list[np.ndarray]
    addrs: np.ndarray
    dtype: torch.dtype
