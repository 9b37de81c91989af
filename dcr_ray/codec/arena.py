"""An arena for the baselines of small tensors: many arrays carved out of a few large blocks.

One memory map per tensor does not scale to MoE models: 10^5 expert tensors would need 10^5 maps (Linux
allows 65,530 per process by default, ``vm.max_map_count``) and 10^5 files. The arena hands out
aligned slices of blocks of :data:`BLOCK_BYTES` (memory-mapped files in the store's directory, or plain
memory), so the number of maps grows with the bytes, not the tensors. Each slice is an ordinary numpy
array that stays valid for the arena's life; its data address (:func:`address`) is stable, which
is what the pack kernels (:mod:`~dcr_ray.codec.compiled.ptrkernels`) read and write through.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

#: Bytes per block (the largest arena slice is far smaller: packable tensors are at most 512 KiB).
BLOCK_BYTES = 64 << 20
#: Slices start on this boundary (a cache line): no two tensors share one.
ALIGN = 64


class Arena:
    """Aligned slices of large blocks; ``directory=None`` keeps the blocks in memory."""

    def __init__(self, directory: str | None, prefix: str = "arena"):
        self.directory = directory
        self.prefix = prefix
        self._blocks: list[np.ndarray] = []
        self._used = BLOCK_BYTES  # no block yet: the first allocation opens one

    def allocate(self, dtype: np.dtype, count: int) -> np.ndarray:
        """A fresh array of ``count`` elements of ``dtype`` (contents undefined until written)."""
        nbytes = count * np.dtype(dtype).itemsize
        if nbytes > BLOCK_BYTES:
            raise ValueError(f"arena slices hold at most {BLOCK_BYTES} bytes, asked for {nbytes}")
        start = -(-self._used // ALIGN) * ALIGN
        if start + nbytes > BLOCK_BYTES:
            self._blocks.append(self._new_block())
            start = 0
        self._used = start + nbytes
        return self._blocks[-1][start:start + nbytes].view(dtype)

    def _new_block(self) -> np.ndarray:
        if self.directory is None:
            return np.empty(BLOCK_BYTES, np.uint8)
        path = os.path.join(self.directory, f"{self.prefix}{len(self._blocks):05d}.bits")
        block = np.memmap(path, dtype=np.uint8, mode="w+", shape=(BLOCK_BYTES,))
        advise_small_folios(block)
        return block

    def close(self) -> None:
        self._blocks.clear()


def address(arr: np.ndarray) -> int:
    """The data address of a numpy array (what the pack kernels read and write through)."""
    return arr.__array_interface__["data"][0]


def advise_small_folios(arr: np.ndarray) -> None:
    """Ask for 4 KiB page-cache folios under a fresh memory map (``MADV_RANDOM``: no readahead, so no
    large folios whose single dirty bit would cover up to 2 MiB); a no-op where madvise is missing."""
    mm = getattr(arr, "_mmap", None)
    advice = getattr(mmap, "MADV_RANDOM", None)
    if mm is not None and advice is not None and hasattr(mm, "madvise"):
        try:
            mm.madvise(advice)
        except OSError:  # advice only: the store works without it, with coarser dirty tracking
            pass
