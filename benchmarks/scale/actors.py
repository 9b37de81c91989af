"""The owner the scale sweep runs: the refit benchmark's, noting its process's RSS before it allocates
(:func:`benchmarks.scale.probes.start_rss` reads it). The engine factory is in :mod:`benchmarks.scale.probes`:
the coordinator unpickles it, and this module imports torch."""

from __future__ import annotations

from benchmarks.refit.actors import BenchOwner
from benchmarks.scale.probes import _note_start


class ScaleOwner(BenchOwner):
    """The refit benchmark's synthetic owner, noting its RSS before its tensors exist."""

    def __init__(self, shapes, seed: int = 0):
        _note_start()
        super().__init__(shapes, seed)
