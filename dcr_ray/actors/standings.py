"""Every engine's standing in the topology, kept in one container (Ray Serve's ``ReplicaStateContainer``
idea): which engines take part in the next refit, and why the others do not.

=============  ==========================================================================================
``REQUIRED``   holds the committed version settled; takes part in the next refit
``JOINING``    being brought to the committed version by a dense bootstrap (launch, a lost cluster)
``EVICTED``    alive, but did not answer a stage within the timeout; rejoins once it answers
``HEALING``    outside the refits, getting the committed version in the background
``OUT``        outside the refits with nothing scheduled (its heal failed, or an abandoned refit left it
               holding no version and it could not be restored); ``Refit.rejoin`` brings it back
=============  ==========================================================================================

The coordinator's parts change a standing only through :class:`Standings`' methods, under the
coordinator's lock; ``CoordinatorState.required`` is a read-only view of the REQUIRED ones.
``status()`` shows every engine's standing (``standings``).
"""

from __future__ import annotations

import enum
from typing import Iterable


class Standing(enum.Enum):
    REQUIRED = "required"
    JOINING = "joining"
    EVICTED = "evicted"
    HEALING = "healing"
    OUT = "out"


class Standings:
    """engine id -> :class:`Standing`; the only place an engine's standing changes."""

    def __init__(self) -> None:
        self._of: dict[str, Standing] = {}

    @property
    def required(self) -> frozenset[str]:
        """The engines that take part in the next refit."""
        return frozenset(e for e, s in self._of.items() if s is Standing.REQUIRED)

    def of(self, engine_id: str) -> Standing | None:
        return self._of.get(engine_id)

    def with_standing(self, standing: Standing) -> list[str]:
        return sorted(e for e, s in self._of.items() if s is standing)

    def as_dict(self) -> dict[str, str]:
        """engine id -> standing name, for ``status()``."""
        return {e: s.value for e, s in sorted(self._of.items())}

    def _set(self, engine_ids: Iterable[str], standing: Standing) -> None:
        for e in engine_ids:
            self._of[e] = standing

    # -- transitions (each one names why) -------------------------------------------------------------
    def require(self, engine_ids: Iterable[str]) -> None:
        """They hold the committed version settled: in the next refit."""
        self._set(engine_ids, Standing.REQUIRED)

    def joining(self, engine_ids: Iterable[str]) -> None:
        """A dense bootstrap brings them to the committed version."""
        self._set(engine_ids, Standing.JOINING)

    def evict(self, engine_ids: Iterable[str]) -> None:
        """They did not answer a stage in time (alive but hung)."""
        self._set(engine_ids, Standing.EVICTED)

    def heal(self, engine_ids: Iterable[str]) -> None:
        """They get the committed version in the background."""
        self._set(engine_ids, Standing.HEALING)

    def out(self, engine_ids: Iterable[str]) -> None:
        """They stay out until someone asks them back (``Refit.rejoin``)."""
        self._set(engine_ids, Standing.OUT)
