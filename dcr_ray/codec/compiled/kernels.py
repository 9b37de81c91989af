"""Compiled CPU kernels (numba) for the codec's hot loops: the sender's scan for changed elements, the
receiver's decoding of positions and values and its scatter into a tensor, and the class-order walks
of :mod:`~dcr_ray.codec.primitives.classorder`.

numpy applies an XOR item as a take / xor / put round trip, three passes over the changed positions
with two temporaries; :func:`xor_into` (``view[pos] ^= vals``) and :func:`put_into`
(``view[pos] = vals``) do it in one pass, and :func:`xor_swap`, :func:`put_swap` and :func:`add_swap`
do the same while keeping the bits they replace (the receiver's undo record, read in the same pass
instead of a gather before the apply). :func:`gap_positions` turns gap symbols into positions
in one pass (numpy: widen, add, cumsum, offset) and :func:`join2` interleaves the two byte planes of
16-bit values in one pass (their effect on decode+apply is in BENCHMARKS.md, ``dcr-ray bench
codec``). They compute exactly what the numpy path computes (the tests compare both
on every dtype), release the GIL (``nogil``) so the codec threads apply items in parallel, and are
compiled once per machine (``cache=True`` keeps the machine code next to their definitions in
:mod:`~dcr_ray.codec.compiled.kernels_numba`, or under ``NUMBA_CACHE_DIR``); later processes load it in
milliseconds (a test checks that every kernel :func:`warm_up` loads comes from that cache).

The sender's scan (:func:`changed_in_block`) compacts without a branch: every element's index is stored
at the next free slot and the slot advances by ``old != new``, so scattered changes cost no branch
mispredictions, and the output is a reused block-sized buffer, so its pages are not faulted in anew
per block. It runs faster than numpy's word compare and lane split (:mod:`dcr_ray.codec.encoding.scan`;
``dcr-ray bench codec`` and BENCHMARKS.md have the figures); branching on each element or each differing word
is slower.

Whether the kernels are used, and their loading on first use, is :mod:`~dcr_ray.codec.compiled.jit`'s
(``DCR_RAY_JIT=0`` selects the numpy paths). Every caller checks :data:`ENABLED` here and falls back;
bounds are never checked inside a kernel, so callers pass only validated positions (``read_frame``
validates every position before any apply).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from dcr_ray.codec.compiled import ptrkernels
from dcr_ray.codec.compiled.jit import ENABLED, once

__all__ = ["ENABLED", "add_into", "add_swap", "changed_in_block", "class_counts_at", "class_positions", "class_ranks",
           "class_starts", "gap_positions", "gather_changes", "join2", "put_into", "put_swap", "take", "warm_up",
           "warm_up_here", "xor_into", "xor_swap"]


def _build() -> dict:
    """The kernels by name (:mod:`~dcr_ray.codec.compiled.kernels_numba`, imported on first use: numba is slow to
    import, and most processes never apply)."""
    from dcr_ray.codec.compiled import kernels_numba as k

    return {name: getattr(k, name) for name in (
        "xor_into", "put_into", "add_into", "take_into", "xor_swap", "put_swap", "add_swap", "gap_positions",
        "join2", "changed_in_block", "gather_changes", "class_ranks", "class_starts", "class_positions",
        "class_positions_sparse", "class_counts_at")}


#: The kernels by name, defined on first use.
_compiled = once(_build)


def compiled() -> dict:
    """The compiled kernels by name (numba dispatchers, compiled on first use): for inspection, e.g. the
    signatures each holds and its on-disk cache's hits and misses."""
    return _compiled()


def xor_into(view: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
    """``view[positions] ^= values`` for validated, in-bounds positions."""
    _compiled()["xor_into"](view, positions, values)


def put_into(view: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
    """``view[positions] = values`` for validated, in-bounds positions."""
    _compiled()["put_into"](view, positions, values)


def add_into(view: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
    """``view[positions] += values`` modulo the word size, for validated, in-bounds positions."""
    _compiled()["add_into"](view, positions, values)


def xor_swap(view: np.ndarray, positions: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``view[positions] ^= values``, returning the bits it replaced (``view[positions]`` before), in one
    pass: the write and its undo record (:mod:`~dcr_ray.codec.decoding.undo`) read each word once."""
    old = np.empty(len(positions), view.dtype)
    _compiled()["xor_swap"](view, positions, values, old)
    return old


def put_swap(view: np.ndarray, positions: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``view[positions] = values``, returning the bits it replaced, in one pass."""
    old = np.empty(len(positions), view.dtype)
    _compiled()["put_swap"](view, positions, values, old)
    return old


def add_swap(view: np.ndarray, positions: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``view[positions] += values`` modulo the word size, returning the bits it replaced, in one pass."""
    old = np.empty(len(positions), view.dtype)
    _compiled()["add_swap"](view, positions, values, old)
    return old


def changed_in_block(old: np.ndarray, new: np.ndarray, out: np.ndarray) -> int:
    """Write the indices where ``old`` and ``new`` differ (same length and dtype) to the front of ``out``
    (int32, at least as long as the block: the kernel writes one slot past the last kept index) and
    return their count."""
    return _compiled()["changed_in_block"](old, new, out)


def take(view: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``view[positions]`` for in-bounds positions, in one pass (numpy's take checks every index)."""
    out = np.empty(len(positions), view.dtype)
    _compiled()["take_into"](view, positions, out)
    return out


def gather_changes(old: np.ndarray, new: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(XOR masks ``new ^ old``, new bits) at in-bounds ``positions``, in one pass."""
    nv = np.empty(len(positions), new.dtype)
    xor = np.empty(len(positions), old.dtype)
    _compiled()["gather_changes"](old, new, positions, xor, nv)
    return xor, nv


def class_ranks(old: np.ndarray, positions: np.ndarray, shift: int, mask: int) -> np.ndarray:
    """Sorted ranks of the sorted ``positions`` in the class order of ``old`` (see
    :mod:`~dcr_ray.codec.primitives.classorder`): elements sorted stably by ``(old >> shift) & mask``. One pass over
    ``old``, then a counting sort of the ranks by class."""
    t = old.dtype.type
    return _compiled()["class_ranks"](old, positions, t(shift), t(mask))


def class_starts(old: np.ndarray, shift: int, mask: int) -> np.ndarray:
    """``start[c]``: the rank of the first class-``c`` element of ``old`` (``mask + 2`` entries, the last
    ``len(old)``)."""
    t = old.dtype.type
    return _compiled()["class_starts"](old, t(shift), t(mask))


def class_counts_at(view: np.ndarray, positions: np.ndarray, shift: int, mask: int) -> np.ndarray:
    """How many of the elements of ``view`` at the in-bounds ``positions`` fall into each class (int64,
    ``mask + 1`` entries)."""
    t = view.dtype.type
    return _compiled()["class_counts_at"](view, positions, t(shift), t(mask))


#: Below this share of changed elements the receiver's walk branches on hits (rare, so predicted).
SPARSE_WALK_MAX = 1 / 20


def class_positions(old: np.ndarray, ranks: np.ndarray, shift: int, mask: int,
                    start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Inverse of :func:`class_ranks` given the class starts ``start`` (of :func:`class_starts`, or a
    cached copy): ``(positions, running ranks at the end, hits per class, hits)``. The walk covers all of
    ``old``, so the starts were right exactly when every class's running rank ended at the next class's
    start (``running == start[1:]``); only then are the positions those of the sorted, unique, in-range
    ``ranks``. Wrong starts never write out of bounds."""
    t = old.dtype.type
    fn = "class_positions_sparse" if len(ranks) < SPARSE_WALK_MAX * len(old) else "class_positions"
    return _compiled()[fn](old, ranks, t(shift), t(mask), start)


def gap_positions(symbols: np.ndarray, lo: int) -> np.ndarray:
    """Absolute positions (int64) of gap symbols: ``lo + cumsum(symbols + 1) - 1`` in one pass.

    The caller bounds the result (the symbols are unsigned, at most 2**31 of them below 2**32 each,
    so the running sum cannot overflow).
    """
    return _compiled()["gap_positions"](symbols, lo)


def join2(p0: np.ndarray, p1: np.ndarray) -> np.ndarray:
    """uint16 values from their low-byte plane ``p0`` and high-byte plane ``p1``."""
    out = np.empty(len(p0), np.uint16)
    _compiled()["join2"](p0, p1, out)
    return out


def warm_up(background: bool = True, on_done=None) -> None:
    """Load (or compile, the first time on a machine) the kernels for the common element widths.

    Owners and receivers call this at start-up so that the first delta refit does not pay for numba's
    start-up (and, the first time on a machine, for compiling). A no-op when the kernels are disabled.
    ``on_done(seconds)`` is called when they are loaded (on the background thread with ``background``).
    """
    if not ENABLED:
        return

    def run() -> None:
        t0 = time.perf_counter()
        load()
        if on_done is not None:
            on_done(time.perf_counter() - t0)

    def load() -> None:
        pos = np.arange(2, dtype=np.int64)
        for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
            view = np.zeros(4, dt)
            for writable in (True, False):  # values and symbols read straight from a frame are read-only
                vals = np.ones(2, dt)
                vals.setflags(write=writable)
                xor_into(view, pos, vals)
                put_into(view, pos, vals)
                take(view, pos)
                add_into(view, pos, vals)
                for swap in (xor_swap, put_swap, add_swap):
                    swap(view, pos, vals)
                gap_positions(vals, 0)
                changed_in_block(view, vals[:1].repeat(4), np.empty(4, np.int32))
                gather_changes(view, vals, pos.astype(np.int32))
        gap_positions(np.ones(2, np.int64), 0)  # symbols widened to int64 around escapes (locations.decode)
        b = np.frombuffer(bytes(2), np.uint8)
        join2(b, b)
        for dt in (np.uint8, np.uint16, np.uint32, np.uint64):  # the old bits of every float width
            old = np.zeros(64, dt)
            start = class_starts(old, 0, 1)
            for rel in (np.arange(len(old)), np.arange(1)):  # the dense and the sparse walk (SPARSE_WALK_MAX)
                class_positions(old, class_ranks(old, rel, 0, 1), 0, 1, start)
            class_counts_at(old, pos, 0, 1)
        ptrkernels.warm_up()

    if background:
        threading.Thread(target=run, name="dcr-kernels-warm-up", daemon=True).start()
    else:
        run()


def warm_up_here() -> None:
    """:func:`warm_up` on the calling thread, leaving no thread behind (a prefork server calls it before it
    forks workers, so each starts with the kernels loaded)."""
    warm_up(background=False)
