"""Dirtied pages of a memory-mapped baseline, measured by the kernel (Linux ``/proc/self/smaps``).

Method (one refit): the owner first writes its baseline files back (``msync`` of every mapping, so every
page of them is clean, as after the kernel's periodic writeback), the refit runs and its promote finishes,
then the owner sums ``Private_Dirty + Shared_Dirty`` of the mappings of its baseline files in
``/proc/self/smaps``: the pages written since the ``msync``, i.e. what writeback must write to disk again.
The kernel counts a page dirty when it or its folio is dirty, so a large folio with one changed element
counts whole; that is what reaches the disk, and what :mod:`dcr_ray.codec.encoding.baseline` avoids by advising
4 KiB folios. ``changed_pages`` is the number of pages that hold at least one pending change
(:meth:`~dcr_ray.codec.encoding.baseline.BaselineStore.pending_pages`), counted before the promote.

Soft-dirty bits (``/proc/PID/clear_refs`` 4 + ``pagemap`` bit 55) would be the other real measurement;
kernels built without ``CONFIG_MEM_SOFT_DIRTY`` (this machine's) never set them.
"""

from __future__ import annotations

import os
import re

_HEAD = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s+(.*)$")


def dirty_pages(directory: str, smaps: str = "/proc/self/smaps") -> int | None:
    """Dirty pages (4 KiB units) of this process's mappings of files under ``directory``; None where
    ``smaps`` cannot be read (not Linux)."""
    prefix = os.path.join(os.path.realpath(directory), "")
    total = 0
    inside = False
    try:
        with open(smaps) as f:
            for line in f:
                m = _HEAD.match(line)
                if m:
                    inside = m.group(1).startswith(prefix)
                elif inside and line.startswith(("Private_Dirty:", "Shared_Dirty:")):
                    total += int(line.split()[1])  # kB
    except OSError:
        return None
    return total // 4


def count_pages(changes, page_bytes: int = 4096) -> int:
    """Distinct pages holding a change: ``changes`` = (tensor name, itemsize, positions()) per chunk, the
    chunks of a tensor in increasing order with increasing positions (as a diff yields them), so each
    tensor's page numbers come sorted and are counted in one pass."""
    import numpy as np

    by_name: dict = {}
    for name, itemsize, positions in changes:
        by_name.setdefault(name, []).append(positions() * itemsize // page_bytes)
    total = 0
    for parts in by_name.values():
        pages = np.concatenate(parts) if len(parts) > 1 else parts[0]
        if len(pages):
            total += 1 + int(np.count_nonzero(np.diff(pages)))
    return total


def write_back(arrays) -> None:
    """``msync`` every memory-mapped array: afterwards none of their pages is dirty."""
    for a in arrays:
        flush = getattr(a, "flush", None)
        if flush is not None:
            flush()
