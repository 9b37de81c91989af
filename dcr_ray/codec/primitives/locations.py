"""Location coding: sorted changed positions of one item <-> a compact integer symbol stream.

An *item* covers the flat element range ``[lo, hi)`` of one tensor. Its changed positions
``lo <= p0 < p1 < ...< hi`` are coded in one of two modes, chosen per item by exact byte size:

``gaps``  one symbol per position: ``p0 - lo``, then ``p[i] - p[i-1] - 1``. Uniformly scattered changes
          give geometric symbols that a Huffman stage (zstd's literals) codes near their entropy.
``runs``  maximal contiguous runs ``(start, length)``: first all gap symbols (``start - end_of_previous``,
          the first relative to ``lo``), then all ``length - 1`` symbols. Wins for rows or blocks that
          change together (embedding rows, 100% change).

Symbols are stored in the narrowest width ``w`` in {1, 2, 4, 8} bytes that minimises
``n * w + 8 * escapes``: a symbol ``>= 2**(8w) - 1`` is written as the escape marker ``2**(8w) - 1``
and its true value goes, in order, to a little-endian uint64 *escape* stream. Every symbol is
non-negative, so decoded positions are strictly increasing by construction; the decoder still checks
every bound before it returns (see :func:`decode`).

The class modes (``cgaps`` / ``cruns``) reuse these symbols over the changed elements' ranks in the
class order of the old values; they are :mod:`~dcr_ray.codec.primitives.classorder`'s, and :func:`decode` refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcr_ray.codec.bits import np_uint
from dcr_ray.codec.compiled import kernels
from dcr_ray.codec.format import LocationMode
from dcr_ray.errors import IndexOutOfRangeError, MalformedHeaderError

#: Wire strings of the flat location modes (the class modes are :mod:`~dcr_ray.codec.primitives.classorder`'s).
MODES = (LocationMode.GAPS.value, LocationMode.RUNS.value)
#: Symbol widths in bytes.
WIDTHS = (1, 2, 4, 8)
#: Largest item span a location stream may address (keeps every cumulative sum inside int64).
MAX_SPAN = 1 << 31


@dataclass(slots=True, frozen=True)
class EncodedLocations:
    """Positions of one item as symbol bytes (``prim``) and escape values (``esc``, uint64 LE)."""

    mode: str  # a LocationMode; as read from a frame, any string until decode() checks it
    width: int
    nsym: int
    prim: bytes
    esc: bytes

    @property
    def nesc(self) -> int:
        return len(self.esc) // 8

    @property
    def nbytes(self) -> int:
        return len(self.prim) + len(self.esc)


EMPTY = EncodedLocations(LocationMode.GAPS, 1, 0, b"", b"")


def _symbols(positions: np.ndarray, lo: int) -> dict[LocationMode, np.ndarray]:
    """Candidate symbol streams (int64) for both modes."""
    pos = positions.astype(np.int64, copy=False)
    gaps = np.empty_like(pos)
    gaps[0] = pos[0] - lo
    np.subtract(pos[1:], pos[:-1], out=gaps[1:])
    gaps[1:] -= 1
    out = {LocationMode.GAPS: gaps}
    # runs: a new run starts wherever the gap symbol is non-zero (and at the first position);
    # counting first is cheap, and runs can only win when they halve the symbol count
    nruns = int(np.count_nonzero(gaps[1:])) + 1
    if nruns * 2 < len(pos):
        starts = np.flatnonzero(gaps[1:]) + 1
        run_start_idx = np.concatenate(([0], starts))
        lengths = np.diff(np.concatenate((run_start_idx, [len(pos)])))
        out[LocationMode.RUNS] = np.concatenate((gaps[run_start_idx], lengths - 1))
    return out


def _best_width(sym: np.ndarray) -> tuple[int, int, int]:
    """(size, width, escapes) of the cheapest width for ``sym``."""
    best = None
    n = len(sym)
    mx = int(sym.max())
    for w in WIDTHS:
        if w == 8 or mx < (1 << (8 * w)) - 1:
            esc = 0
        else:
            esc = int(np.count_nonzero(sym >= (1 << (8 * w)) - 1))
        size = n * w + 8 * esc
        if best is None or size < best[0]:
            best = (size, w, esc)
        if esc == 0:
            break  # wider widths only cost more
    return best


def encode(positions: np.ndarray, lo: int) -> EncodedLocations:
    """Code sorted, unique ``positions`` (absolute flat indices, all ``>= lo``) of one item."""
    if len(positions) == 0:
        return EMPTY
    best = None
    for mode, sym in _symbols(positions, lo).items():
        size, w, esc = _best_width(sym)
        if best is None or size < best[0]:
            best = (size, mode, w, sym, esc)
    _, mode, w, sym, nesc = best
    return _stream(mode, sym, w, nesc)


def _stream(mode: str, sym: np.ndarray, w: int, nesc: int) -> EncodedLocations:
    """The stream of symbols ``sym`` at width ``w`` bytes, the ``nesc`` symbols that do not fit escaped."""
    if w == 8:
        return EncodedLocations(mode, 8, len(sym), sym.astype("<u8").tobytes(), b"")
    dt = np.dtype(np_uint(w)).newbyteorder("<")
    if not nesc:
        return EncodedLocations(mode, w, len(sym), sym.astype(dt).tobytes(), b"")
    cap = (1 << (8 * w)) - 1
    big = np.flatnonzero(sym >= cap)
    esc = sym[big].astype("<u8").tobytes()
    prim = sym.astype(dt)  # escaped symbols wrap here and are overwritten by the marker
    prim[big] = cap
    return EncodedLocations(mode, w, len(sym), prim.tobytes(), esc)


#: Symbols turned into gaps per step of :func:`_gaps_in_place` (bounds its overlap temporary).
GAP_BLOCK = 1 << 12


def _gaps_in_place(rel: np.ndarray) -> None:
    """Turn sorted positions (relative to the item's ``lo``) into the ``gaps`` symbols: ``p0``, then
    ``p[i] - p[i-1] - 1``; block by block from the end, so every block still reads its predecessor's
    original last position."""
    for a in range(((len(rel) - 1) // GAP_BLOCK) * GAP_BLOCK, -1, -GAP_BLOCK):
        b = min(len(rel), a + GAP_BLOCK)
        lo = max(a, 1)
        if lo < b:
            d = rel[lo:b] - rel[lo - 1:b - 1]
            d -= 1
            rel[lo:b] = d


def encode_in_place(rel: np.ndarray) -> EncodedLocations:
    """:func:`encode` ``(rel, 0)``, byte for byte, without its int64 symbol copies (what owners call while
    they diff): the gap symbols are written over ``rel`` (sorted, unique, relative to the item's ``lo``,
    int32 or int64; consumed). Items where runs could win (at least half the positions adjacent to their
    predecessor) go to :func:`encode` itself."""
    n = len(rel)
    if n == 0:
        return EMPTY
    _gaps_in_place(rel)
    nruns = int(np.count_nonzero(rel[1:])) + 1
    if nruns * 2 < n:  # runs may be the smaller coding: let the codec choose, on restored positions
        pos = rel.astype(np.int64)
        pos += 1
        np.cumsum(pos, out=pos)
        pos -= 1
        return encode(pos, 0)
    _, w, nesc = _best_width(rel)
    return _stream(LocationMode.GAPS, rel, w, nesc)


def decode(enc: EncodedLocations, lo: int, hi: int, count: int) -> np.ndarray:
    """Positions (int64, absolute) of an item covering ``[lo, hi)`` with ``count`` changes.

    Raises :class:`MalformedHeaderError` when the stream is inconsistent with its declaration and
    :class:`IndexOutOfRangeError` when a position falls outside ``[lo, hi)``. Never writes anywhere.
    """
    span = hi - lo
    if enc.mode not in MODES:
        raise MalformedHeaderError(f"unknown location mode {enc.mode!r}; known: {MODES}")
    mode = LocationMode(enc.mode)
    if enc.width not in WIDTHS:
        raise MalformedHeaderError(f"location width must be one of {WIDTHS}, got {enc.width}")
    if not 0 < span <= MAX_SPAN:
        raise IndexOutOfRangeError(f"item span {span} must be in 1..{MAX_SPAN}")
    if not 0 <= count <= span:
        raise MalformedHeaderError(f"item declares {count} changes in a span of {span} elements")
    if count == 0:
        if enc.nsym or enc.prim or enc.esc:
            raise MalformedHeaderError("item declares 0 changes but carries location symbols")
        return np.empty(0, np.int64)
    if len(enc.prim) != enc.nsym * enc.width or len(enc.esc) % 8:
        raise MalformedHeaderError(
            f"location stream has {len(enc.prim)} symbol bytes and {len(enc.esc)} escape bytes; "
            f"declared {enc.nsym} symbols of {enc.width} bytes"
        )
    sym = np.frombuffer(enc.prim, dtype=np.dtype(np_uint(enc.width)).newbyteorder("<"))
    esc = np.frombuffer(enc.esc, dtype="<u8")
    if enc.width < 8:
        cap = (1 << (8 * enc.width)) - 1
        is_mark = sym == cap
        nmarks = int(np.count_nonzero(is_mark))
        if nmarks != len(esc):
            raise MalformedHeaderError(f"{nmarks} escape markers but {len(esc)} escape values")
        if len(esc) and int(esc.min()) < cap:
            raise MalformedHeaderError("an escape value is small enough to be coded directly")
        if len(esc):
            if int(esc.max()) >= span:
                raise IndexOutOfRangeError(f"a location symbol ({int(esc.max())}) exceeds the item span {span}")
            sym = sym.astype(np.int64)
            sym[np.flatnonzero(is_mark)] = esc.astype(np.int64)
        # every symbol is now below 2**32 or an escape below ``span``, and there are at most 2**31 of
        # them, so the sums below cannot overflow; the last position's bound check covers every symbol
    else:
        if len(esc):
            raise MalformedHeaderError("8-byte location symbols take no escapes")
        if len(sym) and int(sym.max()) >= span:
            raise IndexOutOfRangeError(f"a location symbol ({int(sym.max())}) exceeds the item span {span}")
    # ``sym`` holds the symbols as stored (unsigned) or, after escapes, as int64: all below span or 2**32
    if mode is LocationMode.GAPS:
        if enc.nsym != count:
            raise MalformedHeaderError(f"gaps mode needs one symbol per change: {enc.nsym} != {count}")
        if kernels.ENABLED:  # one compiled pass: widen, add one, running sum, offset
            pos = kernels.gap_positions(sym, lo)
        else:
            pos = sym.astype(np.int64)  # a fresh array: position i = lo + sum(sym[:i+1] + 1) - 1, in place
            pos += 1
            np.cumsum(pos, out=pos)
            pos += lo - 1
        if pos[-1] >= hi:
            raise IndexOutOfRangeError(
                f"decoded position {int(pos[-1])} is outside the item range [{lo}, {hi})"
            )
        return pos
    # LocationMode.RUNS
    sym = sym.astype(np.int64, copy=False)
    if enc.nsym % 2:
        raise MalformedHeaderError("runs mode needs an even number of symbols")
    nruns = enc.nsym // 2
    gaps, lens = sym[:nruns], sym[nruns:] + 1
    if int(lens.sum()) != count:
        raise MalformedHeaderError(f"runs cover {int(lens.sum())} elements; declared {count}")
    ends = np.cumsum(gaps + lens)  # exclusive end of each run, relative to lo
    starts = ends - lens
    # expand runs: position k of run j = starts[j] + k
    offs = np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
    pos = np.arange(count, dtype=np.int64) + offs
    if pos[-1] >= span:
        raise IndexOutOfRangeError(
            f"decoded position {int(pos[-1]) + lo} is outside the item range [{lo}, {hi})"
        )
    pos += lo
    return pos
