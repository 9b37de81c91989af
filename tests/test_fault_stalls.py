"""The stall of dcr_ray.testing.faults ends when a drill releases it, and never later than its bound.

No Ray here: the stalled flush runs in a thread of this process, around a recording backend. The drills
that use it on real engines are in test_recovery.py, test_catch_up.py and benchmarks/heal.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from dcr_ray.testing.faults import release_stall, stalled_flush


class _Recorder:
    def __init__(self):
        self.flushed_at = None

    def flush(self):
        self.flushed_at = time.monotonic()


def test_a_released_stall_flushes_at_once_and_release_returns_after_the_flush(tmp_path):
    inner, release = _Recorder(), str(tmp_path / "release")
    t = threading.Thread(target=stalled_flush, args=(inner, 60.0, release))
    t.start()
    time.sleep(0.2)
    assert inner.flushed_at is None and t.is_alive()  # still hung
    t0 = time.monotonic()
    release_stall(release)
    assert inner.flushed_at is not None and inner.flushed_at - t0 < 5.0  # flushed before release returned
    assert not (tmp_path / "release").exists()
    t.join(timeout=5)
    assert not t.is_alive()


def test_a_stall_ends_at_its_bound_without_a_release_and_a_release_nobody_takes_times_out(tmp_path):
    inner = _Recorder()
    t0 = time.monotonic()
    stalled_flush(inner, 0.3, str(tmp_path / "never"))
    assert 0.3 <= inner.flushed_at - t0 < 5.0
    stalled_flush(inner, 0.0, None)  # no release file: a plain timed stall
    with pytest.raises(TimeoutError, match="no stalled flush took the release"):
        release_stall(str(tmp_path / "nobody"), timeout_s=0.2)
