"""An engine's lifecycle (:mod:`dcr_ray.actors.engine.state`): each transition lands in the phase the
module doc names, with the data that phase carries."""

import pytest

from dcr_ray.actors.engine.attempt import Attempt
from dcr_ray.actors.engine.state import EngineState, Phase
from dcr_ray.errors import EngineStateError, FrameError


def _ready(version: int = 3, version_id: str = "v3-x") -> EngineState:
    st = EngineState()
    st.activate(version, version_id)
    return st


def test_a_new_engine_holds_nothing_and_is_not_paused():
    st = EngineState()
    assert (st.phase, st.version, st.why, st.transfer, st.paused, st.settled) == (Phase.EMPTY, None, None, None,
                                                                                 False, False)


def test_an_attempt_that_wrote_in_place_leaves_the_engine_written_between_attempts_until_rolled_back():
    st = _ready()
    st.open(Attempt("v4-a", 0, 3, 4, "v3-x"))
    assert (st.phase, st.paused, st.is_in("v4-a", 0), st.is_in("v4-a", 1)) == (Phase.OPEN, True, True, False)
    st.wrote()
    st.close("v4-a")
    assert (st.phase, st.transfer, st.version, st.paused) == (Phase.WRITTEN, "v4-a", 3, True)
    st.rolled_back()
    assert (st.phase, st.transfer, st.version, st.version_id, st.settled) == (Phase.READY, None, 3, "v3-x", True)


def test_closing_an_attempt_that_wrote_nothing_settles_on_what_the_engine_held():
    st = _ready()
    st.open(Attempt("v4-a", 0, 3, 4))
    st.close("other")  # another transfer's close leaves this attempt open
    assert st.phase is Phase.OPEN
    st.close("v4-a")
    assert (st.phase, st.version) == (Phase.READY, 3)


def test_dirty_bits_hold_no_version_and_a_dense_bootstrap_over_them_keeps_them_dirty_until_it_activates():
    st = _ready()
    st.open(Attempt("v4-a", 0, 3, 4))
    st.wrote()
    st.close("v4-a")
    st.dirty("abandoned")
    assert (st.phase, st.version, st.version_id, st.why, st.written) == (Phase.DIRTY, None, None, "abandoned", None)
    st.open(Attempt("boot3-b", 0, -1, 3))
    assert (st.phase, st.why) == (Phase.OPEN, "abandoned")
    st.activate(3, "v3-x")
    assert (st.phase, st.version, st.why, st.attempt, st.written) == (Phase.READY, 3, None, None, None)


def test_a_new_attempt_forgets_the_last_ones_error_and_fail_first_keeps_the_first():
    st = _ready()
    st.open(Attempt("v4-a", 0, 3, 4))
    first, second = FrameError("first"), FrameError("second")
    st.fail_first(first)
    st.fail_first(second)
    assert st.error is first
    st.fail(second)
    assert st.error is second
    st.open(Attempt("v4-a", 1, 3, 4))
    assert st.error is None


def test_a_staged_attempt_serves_on_while_it_stages_and_pauses_from_its_first_write():
    st = _ready()
    st.open(Attempt("v4-a", 0, 3, 4, "v3-x"), staged=True)
    assert (st.phase, st.paused, st.version) == (Phase.STAGING, False, 3)  # generation goes on at v3
    st.wrote()  # the flush writes the staged frames
    assert (st.phase, st.paused, st.written) == (Phase.OPEN, True, "v4-a")
    st.activate(4, "v4-a")
    assert (st.phase, st.paused, st.version) == (Phase.READY, False, 4)


def test_a_staged_retry_over_in_place_writes_of_the_same_transfer_opens_paused():
    st = _ready()
    st.open(Attempt("v4-a", 0, 3, 4), staged=True)
    st.wrote()
    st.close("v4-a")
    assert st.phase is Phase.WRITTEN
    st.open(Attempt("v4-a", 1, 3, 4), staged=True)  # half-written bits: no serving until repaired
    assert (st.phase, st.paused) == (Phase.OPEN, True)


def test_a_transition_the_phase_does_not_allow_is_refused_naming_the_phase():
    st = _ready()
    with pytest.raises(EngineStateError, match="wrote\\(\\) is not allowed in phase ready"):
        st.wrote()
    with pytest.raises(EngineStateError, match="rolled_back\\(\\) is not allowed in phase ready"):
        st.rolled_back()
    assert (st.phase, st.version) == (Phase.READY, 3)


def test_a_flushed_attempt_parks_its_writes_serves_its_version_and_unparks_at_activation():
    st = _ready()
    st.open(Attempt("v4-a", 0, 3, 4, "v3-x"))
    st.wrote()
    with pytest.raises(EngineStateError, match="park\\(\\) needs a flushed attempt"):
        st.park()
    st.flushed_now()
    st.park()
    assert (st.phase, st.paused, st.version, st.transfer, st.written) == (Phase.PARKED, False, 3, "v4-a", None)
    st.flushed_now()  # a repeated flush of the same attempt is still answered
    st.unpark()
    assert (st.phase, st.paused, st.written) == (Phase.OPEN, True, "v4-a")
    st.activate(4, "v4-a")
    assert (st.phase, st.parked, st.version) == (Phase.READY, None, 4)


def test_closing_a_parked_attempt_drops_its_set_aside_writes_and_serves_what_the_engine_held():
    st = _ready()
    st.open(Attempt("v4-a", 0, 3, 4, "v3-x"))
    st.wrote()
    st.flushed_now()
    st.park()
    st.close("v4-a")
    assert (st.phase, st.parked, st.written, st.version, st.settled) == (Phase.READY, None, None, 3, True)
    with pytest.raises(EngineStateError, match="unpark\\(\\) is not allowed in phase ready"):
        st.unpark()


def test_a_delta_does_not_open_over_another_transfers_writes_or_a_dirty_engine_but_a_dense_bootstrap_does():
    from dcr_ray.codec.format import BOOTSTRAP_BASE

    st = _ready()
    st.open(Attempt("v4-a", 0, 3, 4, "v3-x"))
    st.wrote()
    st.close("v4-a")
    with pytest.raises(EngineStateError, match="over in-place writes of transfer v4-a"):
        st.open(Attempt("v4-b", 0, 3, 4, "v3-x"))
    st.dirty("abandoned")
    with pytest.raises(EngineStateError, match="not allowed in phase dirty"):
        st.open(Attempt("v4-b", 0, 3, 4, "v3-x"))
    st.open(Attempt("boot3", 0, BOOTSTRAP_BASE, 3))
    assert st.phase is Phase.OPEN


def test_bits_in_doubt_read_dirty_and_only_a_dense_bootstrap_or_a_verified_copy_leaves_dirty():
    from dcr_ray.codec.format import BOOTSTRAP_BASE

    st = _ready()
    st.open(Attempt("v4-a", 0, 3, 4, "v3-x"))
    st.wrote()
    st.flushed_now()
    st.dirty("a failed write-back")  # e.g. a failed park, a failed staged write
    assert (st.phase, st.attempt, st.flushed, st.transfer, st.is_in("v4-a")) == (Phase.DIRTY, None, None, None, False)
    with pytest.raises(EngineStateError, match="not allowed over dirty bits"):
        st.activate(4, "v4-a")  # a commit, a resume or a readmission of the transfer it was in
    assert (st.phase, st.version) == (Phase.DIRTY, None)
    st.open(Attempt("boot3", 0, BOOTSTRAP_BASE, 3))
    st.dirty("the bootstrap's write failed")
    with pytest.raises(EngineStateError, match="not allowed over dirty bits"):
        st.activate(3, "v3-x")  # a bootstrap that did not finish restores nothing
    st.open(Attempt("boot3", 1, BOOTSTRAP_BASE, 3))
    st.activate(3, "v3-x")  # a dense bootstrap replaced every bit
    assert (st.phase, st.version, st.why) == (Phase.READY, 3, None)
    st.dirty("healing from a peer")
    st.restore(4, "v4-a")  # a copy verified against the version's digests
    assert (st.phase, st.version, st.version_id) == (Phase.READY, 4, "v4-a")
