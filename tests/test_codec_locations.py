"""Location coding and byte planes on their own: exact inverses, cheapest widths, strict decoding."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dcr_ray.codec.compiled import kernels
from dcr_ray.codec.primitives import locations, planes
from dcr_ray.errors import IndexOutOfRangeError, MalformedHeaderError


@st.composite
def item_positions(draw):
    """(lo, hi, sorted unique absolute positions in [lo, hi)) with gaps from 0 to far past 2**32."""
    lo = draw(st.sampled_from([0, 1, 17, 1 << 20, (1 << 33) + 5]))
    span = draw(st.sampled_from([1, 2, 255, 256, 257, 70_000, 1 << 17, (1 << 31) - 1, 1 << 31]))
    rel = draw(st.sets(st.one_of(
        st.integers(0, min(span - 1, 300)),            # clustered at the start
        st.integers(max(0, span - 300), span - 1),     # clustered at the end
        st.integers(0, span - 1),                      # anywhere
    ), min_size=1, max_size=200))
    if draw(st.booleans()):  # add a contiguous block (the runs mode)
        a = draw(st.integers(0, span - 1))
        rel |= set(range(a, min(span, a + draw(st.integers(1, 400)))))
    return lo, lo + span, np.array(sorted(rel), dtype=np.int64) + lo


def smallest_possible(positions: np.ndarray, lo: int) -> int:
    """The size of the cheapest (mode, width) choice, computed directly from the format's definition."""
    gaps = np.diff(np.concatenate(([lo - 1], positions))) - 1
    starts = np.flatnonzero(np.concatenate(([True], gaps[1:] != 0)))
    ends = np.concatenate((starts[1:], [len(positions)]))
    runs = np.concatenate((gaps[starts], ends - starts - 1))
    best = None
    for sym in (gaps, runs):
        for w in (1, 2, 4, 8):
            esc = 0 if w == 8 else int(np.count_nonzero(sym >= (1 << (8 * w)) - 1))
            size = len(sym) * w + 8 * esc
            best = size if best is None else min(best, size)
    return best


@contextlib.contextmanager
def compiled(on: bool):
    """Run the body with the numba kernels on or off (both paths must decode the same)."""
    before = kernels.ENABLED
    kernels.ENABLED = on and before
    try:
        yield
    finally:
        kernels.ENABLED = before


@pytest.mark.parametrize("jit", [True, False], ids=["compiled", "numpy"])
@settings(max_examples=150)
@given(case=item_positions())
def test_decoding_encoded_positions_gives_them_back_exactly(jit, case):
    lo, hi, pos = case
    enc = locations.encode(pos, lo)
    assert enc.mode in locations.MODES and enc.width in locations.WIDTHS
    assert len(enc.prim) == enc.nsym * enc.width and len(enc.esc) == 8 * enc.nesc
    with compiled(jit):
        out = locations.decode(enc, lo, hi, len(pos))
    assert out.dtype == np.int64 and np.array_equal(out, pos)


@settings(max_examples=100)
@given(item_positions())
def test_the_encoder_picks_the_smallest_mode_and_width_the_format_allows(case):
    lo, _, pos = case
    enc = locations.encode(pos, lo)
    # (runs are only tried when they halve the symbol count: with more symbols they can never be smaller)
    assert enc.nbytes == smallest_possible(pos, lo)


def test_rows_that_change_together_are_coded_as_runs():
    pos = np.concatenate([np.arange(100, 164), np.arange(1000, 1064)])
    enc = locations.encode(pos, 0)
    assert enc.mode == "runs" and enc.nsym == 4
    assert np.array_equal(locations.decode(enc, 0, 2048, len(pos)), pos)


def test_a_gap_too_large_for_the_width_is_escaped_to_the_uint64_stream():
    pos = np.array([0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 5000], dtype=np.int64)
    enc = locations.encode(pos, 0)
    assert (enc.mode, enc.width, enc.nesc) == ("gaps", 1, 1)  # 11 + 8 bytes beat 22 at width 2
    assert np.frombuffer(enc.esc, "<u8").tolist() == [5000 - 18 - 1]
    assert np.array_equal(locations.decode(enc, 0, 6000, len(pos)), pos)


def test_no_positions_encode_to_nothing_and_decode_to_nothing():
    assert locations.encode(np.empty(0, np.int64), 5) == locations.EMPTY
    assert len(locations.decode(locations.EMPTY, 5, 10, 0)) == 0


def _enc(mode="gaps", width=1, prim=b"\x00", esc=b"", nsym=None):
    return locations.EncodedLocations(mode, width, len(prim) // width if nsym is None else nsym, prim, esc)


P = pytest.param


@pytest.mark.parametrize("enc,lo,hi,count,error", [
    P(_enc(mode="rle"), 0, 10, 1, MalformedHeaderError, id="unknown-mode"),
    P(_enc(width=3, prim=b"\x00\x00\x00"), 0, 10, 1, MalformedHeaderError, id="unknown-width"),
    P(_enc(), 10, 10, 1, IndexOutOfRangeError, id="empty-span"),
    P(_enc(), 0, (1 << 31) + 1, 1, IndexOutOfRangeError, id="span-too-large"),
    P(_enc(), 0, 10, 11, MalformedHeaderError, id="more-changes-than-elements"),
    P(_enc(), 0, 10, 0, MalformedHeaderError, id="zero-changes-with-symbols"),
    P(_enc(prim=b"\x00\x00", nsym=1), 0, 10, 1, MalformedHeaderError, id="bytes-not-nsym-times-width"),
    P(_enc(prim=b"\x00\x00"), 0, 10, 1, MalformedHeaderError, id="gaps-symbols-not-count"),
    P(_enc(prim=b"\x0a"), 0, 10, 1, IndexOutOfRangeError, id="symbol-past-span"),
    P(_enc(prim=b"\x05\x05"), 0, 10, 2, IndexOutOfRangeError, id="cumulative-past-span"),
    P(_enc(prim=b"\xff"), 0, 1000, 1, MalformedHeaderError, id="marker-without-escape"),
    P(_enc(prim=b"\x00", esc=(300).to_bytes(8, "little")), 0, 1000, 1, MalformedHeaderError,
      id="escape-without-marker"),
    P(_enc(prim=b"\xff", esc=(3).to_bytes(8, "little")), 0, 1000, 1, MalformedHeaderError,
      id="escape-small-enough-to-code-directly"),
    P(_enc(prim=b"\xff", esc=(5000).to_bytes(8, "little")), 0, 1000, 1, IndexOutOfRangeError,
      id="escape-past-span"),
    P(_enc(prim=b"\xff", esc=b"\x01\x02\x03"), 0, 1000, 1, MalformedHeaderError, id="escape-bytes-not-x8"),
    P(_enc(width=8, prim=(2**64 - 1).to_bytes(8, "little")), 0, 1000, 1, IndexOutOfRangeError,
      id="u64-symbol-past-span"),
    P(_enc(width=8, prim=bytes(8), esc=bytes(8)), 0, 1000, 1, MalformedHeaderError, id="escapes-with-width-8"),
    P(_enc(mode="runs", prim=b"\x00"), 0, 10, 1, MalformedHeaderError, id="runs-odd-symbol-count"),
    P(_enc(mode="runs", prim=b"\x00\x03"), 0, 10, 2, MalformedHeaderError, id="runs-lengths-not-count"),
    P(_enc(mode="runs", prim=b"\x08\x03"), 0, 10, 4, IndexOutOfRangeError, id="run-past-span"),
])
@pytest.mark.parametrize("jit", [True, False], ids=["compiled", "numpy"])
def test_an_inconsistent_location_stream_is_rejected(enc, lo, hi, count, error, jit):
    with compiled(jit), pytest.raises(error):
        locations.decode(enc, lo, hi, count)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
@settings(max_examples=25)
@given(data=st.data())
@pytest.mark.parametrize("jit", [True, False], ids=["compiled", "numpy"])
def test_byte_planes_split_and_join_back_to_the_same_values(jit, dtype, data):
    values = data.draw(hnp.arrays(dtype, st.integers(0, 50)))
    ps = planes.split(values)
    w = np.dtype(dtype).itemsize
    assert len(ps) == w and all(p.dtype == np.uint8 and len(p) == len(values) for p in ps)
    for j, p in enumerate(ps):  # plane j holds byte j, little-endian
        assert np.array_equal(p, ((values.astype(np.uint64) >> np.uint64(8 * j)) & np.uint64(0xFF)).astype(np.uint8))
    with compiled(jit):
        back = planes.join(ps, dtype)
    assert back.dtype == np.dtype(dtype) and np.array_equal(back, values)
