"""An engine's lifecycle as one explicit state: its phase, and the data that phase carries.

Phases (:class:`Phase`) are the one vocabulary of an engine's state: ``EngineActor.state()["phase"]``
reports them, ``dcr-ray status`` prints them. The transitions between them are each one method of
:class:`EngineState` (the engine's parts call them under the engine's lock; nothing else writes these
fields); a transition the current phase does not allow raises :class:`~dcr_ray.errors.EngineStateError`
naming the phase::

    EMPTY / READY / DIRTY --open(attempt)----------------> OPEN      (prepare, in place; a delta only from READY)
                          --open(attempt, staged=True)---> STAGING   (prepare, staged: it serves on meanwhile)
    STAGING --wrote()------------------------------------> OPEN      (activate writes the staged frames)
    OPEN    --wrote()------------------------------------> OPEN      (its transfer wrote in place: ``written``)
    OPEN / STAGING --close(transfer)---------------------> WRITTEN   (it wrote in place: the next attempt repairs)
                                                       \\-> READY / EMPTY / DIRTY   (it wrote nothing)
    OPEN    --park()-------------------------------------> PARKED    (flushed, its writes set aside: it serves)
    PARKED  --unpark()-----------------------------------> OPEN      (activate writes them back)
    PARKED  --close(transfer)----------------------------> READY     (abandoned: nothing of it is in the weights)
    OPEN / WRITTEN --rolled_back()-----------------------> READY     (the undo record restored the bits)
    any but DIRTY --activate(v, id)----------------------> READY(v, id)  (a commit, a replayed delta; over
                                                                       dirty bits only a dense bootstrap's)
    any     --restore(v, id)-----------------------------> READY(v, id)  (bits verified against digests: a
                                                                       peer's copy, a digest match)
    any     --dirty(why)---------------------------------> DIRTY(why) (its bits match no version; the attempt
                                                                     it was in is left)

DIRTY is left only by a dense bootstrap (``open`` of a dense attempt, then its ``activate``) or by
``restore`` of verified bits: no commit, resume or readmission activates an engine whose bits match no
version, and none activates a transfer it did not flush (the receiver checks ``flushed``).

Generation serves in READY, STAGING and PARKED (the weights hold the committed version) and waits in OPEN
and WRITTEN (:attr:`EngineState.paused`); EMPTY and DIRTY refuse it.

Data: ``version`` / ``version_id`` (what it holds: READY, and beneath an OPEN, STAGING or WRITTEN
transfer; None otherwise), ``why`` (its bits match no version: DIRTY, and beneath a dense bootstrap that
repairs them), ``attempt`` (OPEN and STAGING), ``written`` (the transfer that wrote in place: WRITTEN,
and OPEN once its frames landed), ``parked`` (the transfer whose flushed writes are set aside: PARKED),
``flushed`` (the last attempt whose every payload was applied) and
``error`` (the first error of the attempt, which fails its flush).
"""

from __future__ import annotations

import enum

from dcr_ray.actors.engine.attempt import Attempt
from dcr_ray.errors import DcrError, EngineStateError


class Phase(enum.Enum):
    EMPTY = "empty"  #: never bootstrapped: holds no version
    READY = "ready"  #: holds ``version`` of content ``version_id``, settled
    STAGING = "staging"  #: inside ``attempt``, staging its frames while it serves ``version``
    OPEN = "open"  #: inside ``attempt``, writing (generation waits)
    WRITTEN = "written"  #: between attempts of ``written``: in-place writes neither committed nor rolled back
    PARKED = "parked"  #: flushed ``attempt`` in place, its writes set aside until activate: serves ``version``
    DIRTY = "dirty"  #: its bits match no version (``why``): a dense bootstrap or a verified copy restores it


class EngineState:
    """One engine's phase and the data it carries (see the module doc for the transitions)."""

    def __init__(self):
        self.phase = Phase.EMPTY
        self.version: int | None = None
        #: identity of the content held: the transfer that produced ``version`` (the commit record's
        #: ``transfer``); delta frames must name it as their ``base_id``
        self.version_id: str | None = None
        self.why: str | None = None
        self.attempt: Attempt | None = None
        self.written: str | None = None
        self.parked: str | None = None
        self.flushed: tuple[str, int] | None = None
        self.error: DcrError | None = None

    def __repr__(self) -> str:
        inner = {Phase.READY: f"v{self.version}", Phase.OPEN: self.attempt and self.attempt.transfer,
                 Phase.PARKED: self.parked,
                 Phase.STAGING: self.attempt and self.attempt.transfer, Phase.WRITTEN: self.written,
                 Phase.DIRTY: self.why}.get(self.phase)
        return f"{self.phase.value}({inner})" if inner else self.phase.value

    # -- questions --------------------------------------------------------------------------------
    @property
    def settled(self) -> bool:
        """Holds a version with no transfer open and nothing written in place (it may hand its bits over)."""
        return self.phase is Phase.READY

    @property
    def paused(self) -> bool:
        """Generation waits: a transfer writes, or wrote in place between its attempts."""
        return self.phase in (Phase.OPEN, Phase.WRITTEN)

    @property
    def transfer(self) -> str | None:
        """The transfer it is in, or whose in-place writes it holds."""
        return self.attempt.transfer if self.attempt is not None else self.written

    def is_in(self, transfer: str, attempt: int | None = None) -> bool:
        """Whether it is inside ``transfer`` (its attempt ``attempt``, when given)."""
        a = self.attempt
        return a is not None and a.transfer == transfer and (attempt is None or a.attempt == attempt)

    def _need(self, what: str, *phases: Phase) -> None:
        if self.phase not in phases:
            raise EngineStateError(f"engine state: {what} is not allowed in phase {self.phase.value} "
                                   f"(only in {', '.join(p.value for p in phases)})")

    # -- transitions ------------------------------------------------------------------------------
    def open(self, attempt: Attempt, *, staged: bool = False) -> None:
        """Enter ``attempt`` (prepare): OPEN, or STAGING when its frames are staged while the engine serves
        (never over in-place writes of the same transfer: those are repaired in place). A new attempt
        forgets the previous one's error. A delta is refused over writes of another transfer and in
        DIRTY; a dense bootstrap opens from any phase."""
        if self.written not in (None, attempt.transfer) and not attempt.dense:
            raise EngineStateError(f"engine state: open() of {attempt.transfer} over in-place writes of transfer "
                                   f"{self.written} that were neither committed nor rolled back (only a dense "
                                   f"bootstrap may replace them)")
        if self.phase is Phase.DIRTY and not attempt.dense:
            raise EngineStateError(f"engine state: open() of a delta ({attempt.transfer}) is not allowed in phase "
                                   f"dirty (only a dense bootstrap)")
        self.attempt, self.error = attempt, None
        self.parked = None  # writes set aside are out of the weights: a new attempt starts from the version held
        self.phase = Phase.STAGING if staged and self.written is None else Phase.OPEN

    def wrote(self) -> None:
        """The open attempt's transfer writes into the backend in place (its later attempts repair it);
        a staging engine stops serving from here until activate or rollback."""
        self._need("wrote()", Phase.OPEN, Phase.STAGING)
        self.written = self.attempt.transfer
        self.phase = Phase.OPEN

    def fail(self, error: DcrError) -> None:
        """Record ``error`` as the attempt's error (the flush raises the latest)."""
        self.error = error

    def fail_first(self, error: DcrError) -> None:
        """Record ``error`` unless the attempt already failed (that error stays the one to raise)."""
        self.error = self.error or error

    def flushed_now(self) -> None:
        self._need("flushed_now()", Phase.OPEN, Phase.STAGING, Phase.PARKED)
        self.flushed = (self.attempt.transfer, self.attempt.attempt)

    def park(self) -> None:
        """The flushed attempt's in-place writes were set aside (the engine holds its version's bits again,
        the writes kept to be written back at activate): generation serves meanwhile."""
        self._need("park()", Phase.OPEN)
        if self.written != self.attempt.transfer or self.flushed != (self.attempt.transfer, self.attempt.attempt):
            raise EngineStateError(f"engine state: park() needs a flushed attempt that wrote in place (written "
                                   f"{self.written!r}, flushed {self.flushed!r}, attempt {self.attempt!r})")
        self.parked, self.written = self.written, None
        self.phase = Phase.PARKED

    def unpark(self) -> None:
        """The set-aside writes go back into the weights (activate): generation waits again."""
        self._need("unpark()", Phase.PARKED)
        self.written, self.parked = self.parked, None
        self.phase = Phase.OPEN

    def close(self, transfer: str) -> None:
        """Leave the open attempt of ``transfer`` (its next attempt re-prepares); in-place writes stay,
        set-aside ones are dropped. Allowed in every phase: outside that attempt it changes nothing."""
        if self.is_in(transfer):
            self.attempt = None
            if self.parked == transfer:
                self.parked = None
            self._settle()

    def rolled_back(self) -> None:
        """The in-place writes were undone: it holds what it held before the transfer."""
        self._need("rolled_back()", Phase.OPEN, Phase.STAGING, Phase.WRITTEN)
        self.written = None
        self.attempt = None
        self._settle()

    def activate(self, version: int, version_id: str | None) -> None:
        """Hold committed ``version`` of ``version_id`` settled (after the record, a dense bootstrap or a
        replayed catch-up). Refused over dirty bits unless the open attempt is a dense bootstrap, which
        replaced every bit: bits in doubt become a version only by :meth:`restore`, once verified."""
        if self.why is not None and not (self.attempt is not None and self.attempt.dense):
            raise EngineStateError(f"engine state: activate(v{version}) is not allowed over dirty bits ({self.why}); "
                                   f"only a dense bootstrap or a verified copy restores them")
        self._ready(version, version_id)

    def restore(self, version: int, version_id: str | None) -> None:
        """Hold committed ``version`` of ``version_id`` settled: its bits were verified against that
        version's digests (a peer's copy, a digest match). Allowed in every phase."""
        self._ready(version, version_id)

    def _ready(self, version: int, version_id: str | None) -> None:
        self.version, self.version_id = version, version_id
        self.attempt = self.written = self.parked = self.why = None
        self.phase = Phase.READY

    def dirty(self, why: str) -> None:
        """Its bits match no version (``why``); nothing it wrote in place can be rolled back any more. Allowed
        in every phase: any phase can learn that its bits are in doubt. The attempt it was in is left, and
        its flush forgotten: the phase reads dirty, and no activation of that transfer finds it."""
        self.attempt = self.written = self.parked = self.flushed = None
        self.why = why
        self.version = self.version_id = None
        self._settle()

    def _settle(self) -> None:
        """The phase that the data now say (every transition ends here or sets it directly)."""
        self.phase = (Phase.PARKED if self.attempt is not None and self.parked is not None
                      else Phase.OPEN if self.attempt is not None else Phase.WRITTEN if self.written is not None
                      else Phase.DIRTY if self.why is not None else Phase.EMPTY if self.version is None
                      else Phase.READY)
