"""Projection costs what the shard and its changes cost, never what the canonical tensor costs: a tiny shard
of a canonical tensor of 2**34 elements (declared by shape only; no such tensor exists anywhere) projects
in milliseconds with kilobytes of Python/numpy allocations."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest
import torch

from dcr_ray.codec import bits_view, diff_tensor
from dcr_ray.sharding import ShardSpec, box_target, project, row_slice

SIDE = 1 << 17  # canonical (SIDE, SIDE): 2**34 elements, 32 GiB of BF16


def _changed_shard(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(shape, generator=g).to(torch.bfloat16)
    new = old.clone()
    flat = new.view(-1).view(torch.int16)
    hit = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 10)]
    flat[hit] ^= 0x0101
    return old, new, np.sort(hit.numpy())


@pytest.mark.parametrize("kind", ["2-D box", "transposed", "padded rows", "Shard(0) rows"])
def test_projecting_a_tiny_shard_of_a_2_to_the_34_element_tensor_allocates_nothing_canonical_sized(kind):
    r0, c0 = 12345, 70000
    if kind == "2-D box":
        local_shape = (8, 64)
        spec = ShardSpec.box("w", (SIDE, SIDE), (r0, c0), local_shape)
        canon = lambda i, j: (r0 + i) * SIDE + c0 + j  # noqa: E731
    elif kind == "transposed":
        local_shape = (64, 8)  # local[i, j] = w[r0 + j, c0 + i]
        spec = ShardSpec(local_shape, (box_target("w", (SIDE, SIDE), (r0, c0), dims=(1, 0)),))
        canon = lambda i, j: (r0 + j) * SIDE + c0 + i  # noqa: E731
    elif kind == "padded rows":
        local_shape = (8, SIDE)  # the last 3 rows are padding past the canonical rows
        spec = row_slice("w", (SIDE, SIDE), SIDE - 5, local_shape)
        canon = lambda i, j: np.where(i < 5, (SIDE - 5 + i) * SIDE + j, -1)  # noqa: E731
    else:
        local_shape = (2, SIDE)
        spec = ShardSpec.box("w", (SIDE, SIDE), (r0, 0), local_shape)
        canon = lambda i, j: (r0 + i) * SIDE + j  # noqa: E731
    old, new, hit = _changed_shard(local_shape)
    base = bits_view(old).copy()
    td = diff_tensor("local", base, new, chunk_elems=1 << 12)

    list(project(td, spec, chunk_elems=1 << 12, old_bits=lambda: base))  # first calls compile the codec's loops
    tracemalloc.start()
    t0 = time.perf_counter()
    out = list(project(td, spec, chunk_elems=1 << 12, old_bits=lambda: base))
    took = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    local_bytes = old.numel() * 2
    assert took < 0.25, f"projection took {took:.3f} s"
    assert peak < 64 * 1024 + 40 * local_bytes, f"projection allocated {peak} bytes for a {local_bytes}-byte shard"
    (td_out,) = out
    assert td_out.name == "w" and td_out.numel == SIDE * SIDE
    got = np.concatenate([c.positions() for c in td_out.chunks])
    want = canon(*np.unravel_index(hit, local_shape))
    want = np.sort(want[want >= 0])
    assert np.array_equal(got, want)
    assert all(0 <= c.lo < c.hi <= SIDE * SIDE for c in td_out.chunks)
