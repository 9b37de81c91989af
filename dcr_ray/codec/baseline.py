"""Baselines: the committed bits of every owned tensor, plus the *pending* changed set of a transfer.

An owner diffs its current tensors against the committed baseline, keeps the changed set as pending
(sparse: coded positions + new bits per chunk, so pending costs less than the payload, not a model copy;
no XOR masks: promote and OVERWRITE retries never read them, and a frame that needs them takes them
again from these committed bits),
and only when the commit record is written :meth:`BaselineStore.promote` folds it into the baseline.
:meth:`BaselineStore.discard` drops it (attempt abandoned: the next diff starts from the same
committed bits, which is what makes a retry recompute the same changed set).

The default store keeps each tensor's bits in a memory-mapped file (``directory``, a private temporary
directory unless given), so the page cache, not the owner's heap, holds the copy and host RAM is not
doubled by accident; ``in_memory=True`` keeps numpy arrays instead.

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

import mmap
import os
import shutil
import tempfile
from typing import Iterable

import numpy as np
import torch

from dcr_ray.codec.bits import bits_view, wire_name
from dcr_ray.codec.diff import (
    DEFAULT_CHUNK_ELEMS,
    DEFAULT_DENSE_CROSSOVER,
    TensorDelta,
    diff_tensor,
)
from dcr_ray.errors import BaselineError


class BaselineStore:
    """Committed bits per tensor name, versioned, with one pending changed set at a time."""

    def __init__(self, *, directory: str | None = None, in_memory: bool = False,
                 chunk_elems: int = DEFAULT_CHUNK_ELEMS, dense_crossover: float = DEFAULT_DENSE_CROSSOVER):
        self.in_memory = in_memory
        self._own_dir = False
        if not in_memory:
            if directory is None:
                directory = tempfile.mkdtemp(prefix="dcr_baseline_")
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

    # -- contents --------------------------------------------------------------------------------
    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Record ``tensor``'s current bits as the committed baseline of ``name``."""
        src = bits_view(tensor.detach().contiguous())
        if self.in_memory:
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
        from dcr_ray.codec.bits import dtype_of

        dt, shape = self._meta[name]
        out = torch.empty(shape, dtype=dtype_of(dt))
        bits_view(out)[:] = self._bits[name]
        return out

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._bits.values())

    # -- diff / pending --------------------------------------------------------------------------
    def diff(self, name: str, tensor: torch.Tensor, *, class_order: bool = True) -> TensorDelta:
        """Changed set of ``tensor`` against the committed bits of ``name`` (not recorded); ``class_order``:
        see :func:`~dcr_ray.codec.diff.diff_tensor`."""
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
        self._pending_version = target_version

    def add_pending(self, delta: TensorDelta) -> None:
        """Keep ``delta`` as the pending change of its tensor, in its pending form
        (:meth:`~dcr_ray.codec.diff.TensorDelta.pending_form`: positions and new bits, sharing ``delta``'s
        arrays; ``delta`` itself is not changed and may still go to a first attempt's frames)."""
        if self._pending is None:
            raise BaselineError("add_pending() before begin(): open a pending set first")
        self._pending[delta.name] = delta.pending_form()

    @property
    def pending_version(self) -> int | None:
        return self._pending_version

    def pending(self) -> Iterable[TensorDelta]:
        return list((self._pending or {}).values())

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
        # No msync here: the memory-mapped files are private scratch space of this process (nothing
        # re-opens them), so forcing dirty pages to disk would buy no durability. It would cost time on
        # every commit: each flush writes the dirty pages out and write-protects them, so the next
        # promote's scattered writes fault again (BENCHMARKS.md, ``dcr-ray bench refit``).
        self.version = version
        self._pending = None
        self._pending_version = None
        return n

    def pending_pages(self, page_bytes: int = mmap.PAGESIZE) -> int:
        """Pages of the baseline files that hold at least one pending change (positions decoded here:
        O(changes); for measurements, not on the refit's path)."""
        total = 0
        for td in (self._pending or {}).values():
            itemsize = self._bits[td.name].dtype.itemsize
            pages = [chunk_changes(self._bits[td.name], ch) * itemsize // page_bytes for ch in td.chunks]
            total += len(np.unique(np.concatenate(pages))) if pages else 0
        return total

    def discard(self) -> None:
        """Drop the pending set; the committed baseline is unchanged."""
        self._pending = None
        self._pending_version = None

    def close(self) -> None:
        self._bits.clear()
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


def _advise_small_folios(arr: np.ndarray) -> None:
    """Ask for 4 KiB page-cache folios under a fresh memory map (``MADV_RANDOM``: no readahead, so no
    large folios whose single dirty bit would cover up to 2 MiB); a no-op where madvise is missing."""
    mm = getattr(arr, "_mmap", None)
    advice = getattr(mmap, "MADV_RANDOM", None)
    if mm is not None and advice is not None and hasattr(mm, "madvise"):
        try:
            mm.madvise(advice)
        except OSError:  # advice only: the store works without it, with coarser dirty tracking
            pass
