"""``dcr-ray chaos``, short seed: every fault kind once on a multi-node cluster (actor deaths, hostile
frames, dropped / duplicated / reordered / delayed payloads, a stalled engine, a node killed during and
between refits, a whole cluster lost, and capacity back after each); nothing mismatched, nothing hostile
applied, every engine of a cluster that is fine serving, the fleet back at its configured size (the
README names the longer soak)."""

from __future__ import annotations

import raytools  # noqa: F401

import pytest

from benchmarks.chaos import FAULT_KINDS, MIN_FRAMES_PER_OWNER, NODE_KINDS, run_chaos, schedule

pytestmark = pytest.mark.slow


def test_the_schedule_covers_every_fault_kind_before_repeating_any():
    first = schedule(30, 20137)[:len(FAULT_KINDS)]
    assert sorted(first) == sorted(FAULT_KINDS) and schedule(30, 20137) == schedule(30, 20137)


def test_a_short_chaos_run_survives_every_fault_kind_bit_exactly():
    # every kind once, then a quiet refit; a 5 s stage timeout (the soak's is 10 s): what a stalled engine
    # and a dropped payload each cost this run, far above a healthy stage of this tiny model
    out = run_chaos(len(FAULT_KINDS) + 1, seed=1, stage_timeout_s=5.0)
    assert out["faults_by_kind"] == {k: 1 for k in FAULT_KINDS}
    assert out["model"] == "stream" and out["frames_per_owner"] >= MIN_FRAMES_PER_OWNER  # kills land mid-stream
    assert out["mismatched_engines"] == 0 and out["bad_frames_applied"] == 0 and out["hung_waits"] == 0
    assert out["committed"] == len(FAULT_KINDS) + 1  # a dead owner's refit commits after replace_owner
    assert out["bad_frames_rejected"] >= 3  # flipped, wrong-key and truncated frames (stale ones are ignored)
    assert out["engines_at_end"] == out["engines_configured"]
    assert out["node_faults"] == {**{k: 1 for k in NODE_KINDS}, "add_node": len(NODE_KINDS)}
    assert out["generation_refused"] == 0
    # an engine re-created after a death heals from the peer of its cluster; the owners send the dense
    # model to nobody (a stalled one is activated, hostile frames and rollbacks write nothing densely)
    assert out["recreated_engines"] >= 1 and out["healed_from_peer"] >= out["recreated_engines"]
    assert out["dense_rebootstraps"] == 0 and out["healed_from_owners"] == 0
    # (in-place rollbacks depend on whether frames landed before a fault; tests/test_recovery.py pins them)
