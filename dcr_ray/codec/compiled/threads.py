"""The codec's worker threads: one small pool shared by the diff scan, frame (de)compression, item
decoding and apply.

numpy's comparisons, ``nonzero``, gathers and zstandard's (de)compression release the GIL, so on a
multi-core owner a chunk's scan and a frame's sections proceed in parallel. Work is handed over in a
few large tasks, never one per small block (handing a task to the pool costs more than a small block's
work), and pool tasks never submit pool tasks (no nested waits, so no deadlock).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Iterable, TypeVar

#: Upper bound on codec threads per process (an owner usually shares its node with a trainer).
MAX_THREADS = 8

T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


_n_threads: int | None = None


def codec_threads() -> int:
    """Threads the codec uses: the CPUs this process may run on, at most :data:`MAX_THREADS`.

    Read once per process (asking the kernel costs more than a small tensor's whole diff)."""
    global _n_threads
    if _n_threads is None:
        try:
            n = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            n = os.cpu_count() or 1
        _n_threads = max(1, min(MAX_THREADS, n))
    return _n_threads


def pool() -> ThreadPoolExecutor:
    """The shared pool (created on first use)."""
    global _pool
    if _pool is None:
        with _lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=codec_threads(), thread_name_prefix="dcr-codec")
    return _pool


def run_all(fns: list[Callable[[], object]]) -> list:
    """Results of ``fns``: the first runs in the calling thread, the rest on the pool, concurrently.

    Returns (or raises the first error) only once every one has ended, so no task still writes after
    its caller moved on (an apply that failed part-way is then undone whole)."""
    if len(fns) <= 1:
        return [f() for f in fns]
    futs: list[Future] = [pool().submit(f) for f in fns[1:]]
    try:
        first = fns[0]()
    finally:
        wait(futs)
    return [first, *(f.result() for f in futs)]


def balance(things: Iterable[T], size: Callable[[T], int], n: int) -> list[list[T]]:
    """Deal ``things`` out to at most ``n`` non-empty shares, largest first to the least loaded share."""
    shares: list[list[T]] = [[] for _ in range(n)]
    load = [0] * n
    for t in sorted(things, key=lambda t: -size(t)):
        k = load.index(min(load))
        shares[k].append(t)
        load[k] += size(t)
    return [s for s in shares if s]


def _reset_in_child() -> None:  # a forked child must not wait on its parent's threads
    global _pool, _lock, _n_threads
    _pool, _lock, _n_threads = None, threading.Lock(), None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
