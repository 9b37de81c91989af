"""Every engine's standing as the coordinator sees it: one vocabulary, one container, one transition table.

The standing answers "does this engine take part in the next refit, and if not, what is being done about
it" (the engine's own :class:`~dcr_ray.actors.engine.state.Phase` answers "what do its weights hold").
Healing is not a separate table of phase strings: each step of a heal is a standing.

=======================  ====================================================================================
``required``             holds the committed version settled; takes part in the next refit
``joining``              a dense bootstrap from the owners brings it to the committed version (launch, an
                         engine an abandoned refit wrote into, a heal's last resort)
``evicted``              alive, but did not answer a stage within the timeout; rejoins once it answers
``queued``               heals in the background: waits for the healing worker
``waiting for capacity`` heals once a live node can host its cluster (a lost region)
``re-creating``          its actor died: a new one is being created
``starting``             its actor starts (process, imports, the model built)
``catching up``          replays the deltas it missed from its cluster's catch-up window
``copying``              takes a peer's copy of the committed version
``failed``               its heal failed: queued again after the next commit, or by ``Refit.rejoin``
``out``                  outside the refits with nothing scheduled (an abandoned refit left it holding no
                         version and it could not be restored); ``Refit.rejoin`` brings it back
=======================  ====================================================================================

Transitions follow :data:`MOVES` (a standing -> the standings it may become); an illegal one raises
:class:`~dcr_ray.errors.EngineStateError` naming both. The coordinator's parts change a standing only
through :meth:`Standings.move`; the container's own lock orders concurrent writers (a refit, the
healing worker), and the required set changes only under the coordinator's lock as well (a heal's join
takes it). ``CoordinatorState.required`` is a read-only view; ``status()["standings"]`` and
``status()["healing"][engine]["standing"]`` show these names.
"""

from __future__ import annotations

import enum
import threading
from typing import Iterable

from dcr_ray.errors import EngineStateError


class Standing(enum.Enum):
    REQUIRED = "required"
    JOINING = "joining"
    EVICTED = "evicted"
    QUEUED = "queued"
    WAITING = "waiting for capacity"
    RECREATING = "re-creating"
    STARTING = "starting"
    CATCHING_UP = "catching up"
    COPYING = "copying"
    FAILED = "failed"
    OUT = "out"

    @property
    def healing(self) -> bool:
        """Whether the engine is being healed in the background (it has a row in the healing table)."""
        return self in HEALING


#: Standings of an engine that heals in the background (``failed`` and ``joining`` included: a heal that
#: failed waits to be queued again, and a heal's last resort is a dense bootstrap).
HEALING = frozenset({Standing.QUEUED, Standing.WAITING, Standing.RECREATING, Standing.STARTING,
                     Standing.CATCHING_UP, Standing.COPYING, Standing.FAILED})

_S = Standing
_ROUND = {_S.STARTING, _S.CATCHING_UP, _S.COPYING, _S.RECREATING}  # a heal's rounds, in any order
#: standing (None: not known yet) -> the standings it may become
MOVES: dict[Standing | None, frozenset[Standing]] = {
    None: frozenset({_S.REQUIRED, _S.JOINING, _S.QUEUED}),
    _S.REQUIRED: frozenset({_S.REQUIRED, _S.EVICTED, _S.QUEUED, _S.JOINING, _S.OUT}),
    _S.EVICTED: frozenset({_S.EVICTED, _S.REQUIRED, _S.QUEUED}),
    _S.QUEUED: frozenset({_S.QUEUED, _S.WAITING, _S.REQUIRED, _S.JOINING, _S.FAILED} | _ROUND),
    _S.WAITING: frozenset({_S.WAITING, _S.QUEUED, _S.RECREATING, _S.STARTING}),
    _S.RECREATING: frozenset({_S.QUEUED, _S.WAITING, _S.FAILED} | _ROUND),
    _S.STARTING: frozenset({_S.QUEUED, _S.WAITING, _S.REQUIRED, _S.JOINING, _S.FAILED} | _ROUND),
    _S.CATCHING_UP: frozenset({_S.QUEUED, _S.REQUIRED, _S.JOINING, _S.FAILED} | _ROUND),
    _S.COPYING: frozenset({_S.QUEUED, _S.REQUIRED, _S.JOINING, _S.FAILED} | _ROUND),
    _S.JOINING: frozenset({_S.JOINING, _S.REQUIRED, _S.QUEUED, _S.FAILED, _S.OUT}),
    _S.FAILED: frozenset({_S.FAILED, _S.QUEUED}),
    _S.OUT: frozenset({_S.OUT, _S.QUEUED, _S.JOINING}),
}


class Standings:
    """engine id -> :class:`Standing`; the only place an engine's standing changes."""

    def __init__(self) -> None:
        self._of: dict[str, Standing] = {}
        self._lock = threading.Lock()

    @property
    def required(self) -> frozenset[str]:
        """The engines that take part in the next refit."""
        with self._lock:
            return frozenset(e for e, s in self._of.items() if s is Standing.REQUIRED)

    def of(self, engine_id: str) -> Standing | None:
        return self._of.get(engine_id)

    def with_standing(self, *standings: Standing) -> list[str]:
        with self._lock:
            return sorted(e for e, s in self._of.items() if s in standings)

    def as_dict(self) -> dict[str, str]:
        """engine id -> standing name, for ``status()``."""
        with self._lock:
            return {e: s.value for e, s in sorted(self._of.items())}

    def move(self, engine_ids: Iterable[str], to: Standing) -> None:
        """``engine_ids`` become ``to``; all or none: a move :data:`MOVES` does not allow raises
        ``EngineStateError`` naming the engine and both standings, and changes nothing."""
        ids = list(engine_ids)
        with self._lock:
            for e in ids:
                now = self._of.get(e)
                if to not in MOVES[now]:
                    raise EngineStateError(
                        f"engine {e}: its standing {now.value if now else 'unknown'!r} cannot become {to.value!r} "
                        f"(from {now.value if now else 'unknown'!r}: {sorted(s.value for s in MOVES[now])})")
            for e in ids:
                self._of[e] = to

    # -- the coordinator's named steps ---------------------------------------------------------------
    def require(self, engine_ids: Iterable[str]) -> None:
        """They hold the committed version settled: in the next refit."""
        self.move(engine_ids, Standing.REQUIRED)

    def joining(self, engine_ids: Iterable[str]) -> None:
        """A dense bootstrap brings them to the committed version."""
        self.move(engine_ids, Standing.JOINING)

    def evict(self, engine_ids: Iterable[str]) -> None:
        """They did not answer a stage in time (alive but hung)."""
        self.move(engine_ids, Standing.EVICTED)

    def heal(self, engine_ids: Iterable[str]) -> None:
        """They get the committed version in the background (queued for the healing worker)."""
        self.move(engine_ids, Standing.QUEUED)

    def out(self, engine_ids: Iterable[str]) -> None:
        """They stay out until someone asks them back (``Refit.rejoin``)."""
        self.move(engine_ids, Standing.OUT)
