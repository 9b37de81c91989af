"""The diff's memory-lean paths give exactly what the plain ones give: the in-place location coder is
``locations.encode`` byte for byte, and the gathered values are the scan's."""

from __future__ import annotations

import numpy as np
import pytest

from dcr_ray.codec.encoding import diff, scan
from dcr_ray.codec.primitives import locations


def _positions(rng, span, rate, clustered):
    k = max(1, min(span, int(span * rate)))
    pos = np.unique(rng.integers(0, span, k))
    if clustered:  # rows that change together: runs may win
        pos = np.unique(np.concatenate([pos, np.arange(pos[0], min(span, pos[0] + 4 * len(pos)))]))
    return pos


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("span,rate", [(1, 1.0), (300, 0.5), (70_000, 0.05), (300_000, 0.01), (5_000_000, 1e-4),
                                       ((1 << 31) - 1, 1e-8), ((1 << 31) - 1, 1e-6)])
@pytest.mark.parametrize("clustered", [False, True])
def test_coding_locations_in_place_gives_exactly_the_bytes_of_locations_encode(dtype, span, rate, clustered):
    rng = np.random.default_rng(span)
    for _ in range(5):
        pos = _positions(rng, span, rate, clustered)
        want = locations.encode(pos, 0)
        assert locations.encode_in_place(pos.astype(dtype)) == want
    assert locations.encode_in_place(np.empty(0, np.int32)) == locations.EMPTY


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_a_chunk_diffed_with_gathered_values_matches_the_scan(itemsize):
    dt = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]
    rng = np.random.default_rng(itemsize)
    n = 3 * scan.SCAN_BLOCK_ELEMS + 5
    old = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
    new = old.copy()
    idx = rng.choice(n, n // 40, replace=False)
    new[idx] ^= rng.integers(1, np.iinfo(dt).max, len(idx), dtype=dt, endpoint=True)
    c = diff.diff_chunk(old, new, 0, diff.DEFAULT_DENSE_CROSSOVER, 1)
    pos, xor, nv = scan.changes(old, new, 1)
    assert np.array_equal(c.positions(), pos) and np.array_equal(c.xor, xor) and np.array_equal(c.new, nv)
    assert c.loc == locations.encode(pos, 0)
