"""The numba definitions behind :mod:`~dcr_ray.codec.compiled.kernels` (imported on first use: importing numba
is slow). They live at module level so that numba's on-disk cache can find them again in the next
process: a kernel that calls another kernel held in a closure gets a new cache key in every process
and is compiled anew each time.
"""

from __future__ import annotations

import numba
import numpy as np


jit = numba.njit(nogil=True, cache=True, boundscheck=False)


@jit
def xor_into(view, pos, vals):  # pragma: no cover - compiled
    for i in range(len(pos)):
        view[pos[i]] ^= vals[i]


@jit
def put_into(view, pos, vals):  # pragma: no cover - compiled
    for i in range(len(pos)):
        view[pos[i]] = vals[i]


@jit
def xor_swap(view, pos, vals, old):  # pragma: no cover - compiled
    # the write and its undo record in one pass: each replaced word is read once, kept, then written
    for i in range(len(pos)):
        p = pos[i]
        o = view[p]
        old[i] = o
        view[p] = o ^ vals[i]


@jit
def put_swap(view, pos, vals, old):  # pragma: no cover - compiled
    for i in range(len(pos)):
        p = pos[i]
        old[i] = view[p]
        view[p] = vals[i]


@jit
def add_swap(view, pos, vals, old):  # pragma: no cover - compiled
    for i in range(len(pos)):  # stores truncate to the view's width: a wrapping add
        p = pos[i]
        o = view[p]
        old[i] = o
        view[p] = o + vals[i]


@jit
def gap_positions(sym, lo):  # pragma: no cover - compiled
    out = np.empty(len(sym), np.int64)
    p = lo - 1
    for i in range(len(sym)):
        p += np.int64(sym[i]) + 1
        out[i] = p
    return out


@jit
def join2(p0, p1, out):  # pragma: no cover - compiled
    for i in range(len(out)):
        out[i] = np.uint16(p0[i]) | (np.uint16(p1[i]) << np.uint16(8))


@jit
def changed_in_block(old, new, out):  # pragma: no cover - compiled
    # branch-free compaction: write every index, keep it by advancing past it only if it differs
    k = 0
    for i in range(len(old)):
        out[k] = i
        k += old[i] != new[i]
    return k


@jit
def take_into(view, pos, out):  # pragma: no cover - compiled
    for i in range(len(pos)):
        out[i] = view[pos[i]]


@jit
def gather_changes(old, new, pos, xor, nv):  # pragma: no cover - compiled
    for j in range(len(pos)):
        a = new[pos[j]]
        nv[j] = a
        xor[j] = a ^ old[pos[j]]


@jit
def add_into(view, pos, vals):  # pragma: no cover - compiled
    for i in range(len(pos)):  # stores truncate to the view's width: a wrapping add
        view[pos[i]] += vals[i]


@jit
def class_starts(old, shift, mask):  # pragma: no cover - compiled
    # start[c]: rank of the first class-c element. Four interleaved histograms, so that
    # runs of one class do not chain every increment through one counter.
    ncls = np.int64(mask) + 1
    h = np.zeros((4, ncls), np.int64)
    n = len(old)
    m = n - n % 4
    for i in range(0, m, 4):
        h[0, np.int64((old[i] >> shift) & mask)] += 1
        h[1, np.int64((old[i + 1] >> shift) & mask)] += 1
        h[2, np.int64((old[i + 2] >> shift) & mask)] += 1
        h[3, np.int64((old[i + 3] >> shift) & mask)] += 1
    for i in range(m, n):
        h[0, np.int64((old[i] >> shift) & mask)] += 1
    start = np.zeros(ncls + 1, np.int64)
    for c in range(ncls):
        start[c + 1] = start[c] + h[0, c] + h[1, c] + h[2, c] + h[3, c]
    return start


@jit
def class_ranks(old, pos, shift, mask):  # pragma: no cover - compiled
    # one pass: count every element into four interleaved per-class counters (no chained
    # increments), note each changed element's class and its count among the earlier elements
    # of its class, walk on to the end for the class totals, then put each rank (its class's
    # start + that count) in its class's slot: ranks of one class rise with position, so this
    # counting sort leaves them sorted
    ncls = np.int64(mask) + 1
    cnt = np.zeros((4, ncls), np.int64)
    k = len(pos)
    n = len(old)
    cls = np.empty(k, np.int64)
    within = np.empty(k, np.int64)
    i = 0
    for j in range(k + 1):
        p = pos[j] if j < k else n
        while i + 4 <= p:
            cnt[0, np.int64((old[i] >> shift) & mask)] += 1
            cnt[1, np.int64((old[i + 1] >> shift) & mask)] += 1
            cnt[2, np.int64((old[i + 2] >> shift) & mask)] += 1
            cnt[3, np.int64((old[i + 3] >> shift) & mask)] += 1
            i += 4
        while i < p:  # a short gap (dense changes): rotate the lanes so that no increment waits on the last
            cnt[i & 3, np.int64((old[i] >> shift) & mask)] += 1
            i += 1
        if j < k:
            c = np.int64((old[p] >> shift) & mask)
            cls[j] = c
            within[j] = cnt[0, c] + cnt[1, c] + cnt[2, c] + cnt[3, c]
    start = np.zeros(ncls + 1, np.int64)
    slot = np.zeros(ncls + 1, np.int64)
    for c in range(ncls):
        start[c + 1] = start[c] + cnt[0, c] + cnt[1, c] + cnt[2, c] + cnt[3, c]
    for j in range(k):
        slot[cls[j] + 1] += 1
    for c in range(ncls):
        slot[c + 1] += slot[c]
    out = np.empty(k, np.int64)
    for j in range(k):
        c = cls[j]
        out[slot[c]] = start[c] + within[j]
        slot[c] += 1
    return out


@jit
def class_counts_at(view, pos, shift, mask):  # pragma: no cover - compiled
    # how many of the elements at pos fall into each class
    out = np.zeros(np.int64(mask) + 1, np.int64)
    for i in range(len(pos)):
        out[np.int64((view[pos[i]] >> shift) & mask)] += 1
    return out


@jit
def _wanted(ranks, start, ncls):  # pragma: no cover - compiled
    # what both receiver walks start from: the wanted ranks with a -1 sentinel after the last,
    # and each class's index of its next wanted rank among them
    n = len(ranks)
    r = np.empty(n + 1, np.int64)
    r[:n] = ranks
    r[n] = -1
    return r, np.searchsorted(r[:n], start[:ncls])


@jit
def class_positions(old, ranks, shift, mask, start):  # pragma: no cover - compiled
    # branch-free walk with the class starts given: element i is the next wanted one of its
    # class when the class's next wanted rank equals its running rank. Past a class's last
    # wanted rank the next one belongs to a later class (above any running rank of this
    # class, when the starts are right) and a sentinel ends the list. The walk covers every
    # element, so each class's running rank ends at its start + its count: the caller checks
    # that against the next class's start. Wrong starts cannot write out of bounds (the output
    # index is clamped; a pointer stops at the sentinel, which no running rank equals).
    ncls = np.int64(mask) + 1
    n = len(ranks)
    r, ptr = _wanted(ranks, start, ncls)
    first = ptr.copy()
    run = start[:ncls].copy()
    out = np.empty(n + 1, np.int64)
    k = 0
    for i in range(len(old)):
        c = np.int64((old[i] >> shift) & mask)
        q = ptr[c]
        hit = np.int64(r[q] == run[c])
        out[min(k, n)] = i
        k += hit
        ptr[c] = q + hit
        run[c] += 1
    return out[:n], run, ptr - first, k


#: The sparse walk's sentinel rank: above any running rank, so no class ever reaches it.
FAR = np.int64(1) << 62


@jit
def class_positions_sparse(old, ranks, shift, mask, start):  # pragma: no cover - compiled
    # the same walk with a branch on hits, cheaper where hits are rare (predicted), keeping one
    # number per class: how many more of its elements to pass before its next wanted one (a
    # load and a store per element). A hit sets it to the gap to the class's next wanted rank;
    # past the last, a later class's rank (or the FAR sentinel) keeps it from reaching zero.
    # The running rank at the end is the next wanted rank less what remained to pass.
    ncls = np.int64(mask) + 1
    n = len(ranks)
    r = np.empty(n + 1, np.int64)
    r[:n] = ranks
    r[n] = FAR
    ptr = np.searchsorted(r[:n], start[:ncls])
    first = ptr.copy()
    left = np.empty(ncls, np.int64)
    for c in range(ncls):
        left[c] = r[ptr[c]] - start[c]
    out = np.empty(n, np.int64)
    k = 0
    for i in range(len(old)):
        c = np.int64((old[i] >> shift) & mask)
        v = left[c] - 1
        if v < 0:
            if k < n:
                out[k] = i
            k += 1
            q = ptr[c]
            ptr[c] = q + 1
            v = r[q + 1] - r[q] - 1
        left[c] = v
    run = np.empty(ncls, np.int64)
    for c in range(ncls):
        run[c] = r[ptr[c]] - left[c]
    return out, run, ptr - first, k
