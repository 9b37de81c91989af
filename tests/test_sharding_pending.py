"""Owners keep pending changed sets without XOR masks; frames built from them are the frames of the fresh diff.

A pending set (``TensorDelta.pending_form``, what ``BaselineStore.add_pending`` keeps) holds positions and
new bits only. Projected with the local baseline, its canonical sets carry the masks again (taken from the
baseline) and encode to the same bytes, in mixed and in OVERWRITE mode, on every layout of
:mod:`test_sharding_cases`; OVERWRITE sends need no masks at all (``with_xor=False``).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from dcr_ray.codec import FrameMeta, bits_view, diff_tensor, encode_frames
from dcr_ray.sharding import project
from test_sharding_cases import change, models, owners, random_state

META = FrameMeta(transfer="t", attempt=0, producer="p", payload=0, base=0, target=1)


def _frames(tds, mode):
    return list(encode_frames(tds, META, mode=mode, bucket_bytes=1 << 12))


@settings(max_examples=40, deadline=None)
@given(models(), st.integers(0, 2**32 - 1), st.sampled_from([0.01, 0.1, 0.97]), st.sampled_from([7, 64, 1 << 20]))
def test_frames_from_the_pending_form_equal_frames_from_the_fresh_diff(layout, seed, rate, chunk):
    rng = np.random.default_rng(seed)
    s_old = random_state(layout, rng)
    s_new = change(s_old, rng, rate)
    _, p_old = layout.build(s_old, seed)
    _, p_new = layout.build(s_new, seed + 1)
    by_old, by_new = owners(p_old), owners(p_new)
    for o in by_new:
        fresh, pending, bare = [], [], []
        for a, b in zip(by_old[o], by_new[o]):
            base = bits_view(a.tensor).copy()
            td = diff_tensor(b.local, base, b.tensor, chunk_elems=chunk)
            kept = td.pending_form()
            assert all(c.is_dense or (c.xor is None and c.new is d.new) for c, d in zip(kept.chunks, td.chunks))
            fresh += project(td, b.spec, chunk_elems=chunk, old_bits=lambda b=base: b)
            pending += project(kept, b.spec, chunk_elems=chunk, old_bits=lambda b=base: b)
            bare += project(kept, b.spec, chunk_elems=chunk, old_bits=lambda b=base: b, with_xor=False)
        assert _frames(pending, "mixed") == _frames(fresh, "mixed")
        assert _frames(bare, "overwrite") == _frames(fresh, "overwrite")
