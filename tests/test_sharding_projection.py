"""Projection of local changed sets into canonical coordinates gives exactly what gather-then-diff gives.

Hypothesis draws layouts (TP 1/2/4/8 column and row splits, FSDP world 1-8 with uneven and empty tails,
2-D meshes, fused QKV with GQA in Megatron's interleave and vLLM's concatenation, fused gate/up, stacked
experts with EP and TP inside experts, vocab padding, tied embeddings, replicated tensors split among
replicas, transposed copies, pipeline stages, residual norms stored as ``w - 1``), several side by side,
random BF16/FP32 changes (bit flips, NaN payloads, -0/+0) and small chunk sizes, so chunk edges and
dense chunks are crossed. Comparisons are on integer views.
"""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from test_sharding_cases import check_bootstrap, check_projection, models

chunks = st.sampled_from([4, 7, 16, 64, 1 << 20])
rates = st.sampled_from([0.0, 0.01, 0.1, 0.5, 0.97])


@settings(max_examples=60, deadline=None)
@given(models(), st.integers(0, 2**32 - 1), rates, chunks)
def test_projected_changes_equal_gather_then_diff_and_frames_rebuild_the_canonical_tensors(layout, seed, rate, chunk):
    check_projection(layout, seed, rate, chunk)


@settings(max_examples=40, deadline=None)
@given(models(), st.integers(0, 2**32 - 1), chunks)
def test_a_projected_bootstrap_sends_every_canonical_element_once_and_no_padding(layout, seed, chunk):
    check_bootstrap(layout, seed, chunk)
