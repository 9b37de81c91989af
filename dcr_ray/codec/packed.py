"""Packs: many small tensors of one dtype laid end to end in one flat *pack space*.

An MoE model has tens of thousands of expert tensors. Item by item, each costs a Python round trip at
the owner (diff, header entry) and at the engine (decode, write) and ~100 bytes of header: seconds and
15+ bytes per change at 10^5 tensors. A pack lays ``k`` whole tensors of one wire dtype end to end in a
flat pack space (tensor ``t`` holds positions ``offsets[t] .. offsets[t + 1]``), keeps one set of
positions and values for all of them, and travels as one header entry plus a names table (see
:mod:`~dcr_ray.codec.format`). The compiled pointer kernels (:mod:`~dcr_ray.codec.compiled.ptrkernels`) scan and
write every tensor of a pack in one call, wherever each tensor's storage lives.

This module is the layout both sides share, and nothing else: which tensors go into packs
(:func:`packable`), how an owner groups them (:func:`plan_packs`), where each tensor starts
(:func:`pack_offsets`), and how a pack's positions split back into tensors (:func:`per_tensor`). The
sender's pack is :class:`~dcr_ray.codec.encoding.packdiff.PackDelta`; the receiver's is
:class:`~dcr_ray.codec.decoding.decoded.DecodedPack`.

Invariants: a pack lists only tensors with at least one change, each whole (it covers ``[0, numel)``)
and at most once; its positions are sorted and unique. Expanded tensor by tensor (:func:`per_tensor`)
it is exactly the per-tensor changed set and items, so anything that reads items (projection, receivers
that map names) stays correct.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import numpy as np

#: Tensors of at most this many elements are diffed and sent in packs (larger ones item by item: their
#: Python cost per tensor is small next to their scan).
PACK_MAX_ELEMS = 1 << 16
#: A pack is closed once it spans this many elements (4 Mi: the default chunk), so one pack's changed set
#: stays within a frame's bucket even if every element changed.
PACK_SPAN_ELEMS = 1 << 22


def packable(name: str, numel: int) -> bool:
    """Whether a tensor of ``numel`` elements named ``name`` goes into packs (names travel newline-ended)."""
    return 0 < numel <= PACK_MAX_ELEMS and "\n" not in name


def pack_offsets(sizes: Sequence[int]) -> np.ndarray:
    """Where each tensor of ``sizes`` (elements, in pack order) starts in pack space, and the end:
    int64, ``len(sizes) + 1``."""
    offsets = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return offsets


def per_tensor(positions: np.ndarray, offsets: np.ndarray) -> Iterator[tuple[int, slice, np.ndarray]]:
    """Per tensor of a pack: (its index, the slice of the pack's changes in it, their positions within the
    tensor), from the sorted pack ``positions`` and the tensors' ``offsets``."""
    cuts = np.searchsorted(positions, offsets)
    for t in range(len(offsets) - 1):
        s = slice(int(cuts[t]), int(cuts[t + 1]))
        yield t, s, positions[s] - offsets[t]


def plan_packs(sizes: Mapping[str, int], span_elems: int = PACK_SPAN_ELEMS) -> list[list[str]]:
    """Cut the packable names of ``sizes`` (name -> elements, in order) into packs of at most
    ``span_elems`` elements (owners use their chunk size), keeping their order."""
    packs, cur, span = [], [], 0
    for name, n in sizes.items():
        if span + n > span_elems and cur:
            packs.append(cur)
            cur, span = [], 0
        cur.append(name)
        span += n
    if cur:
        packs.append(cur)
    return packs
