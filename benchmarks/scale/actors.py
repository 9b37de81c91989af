"""The owner and engine the scale sweep runs: the refit benchmark's, each noting its process's RSS before it
allocates (:func:`benchmarks.scale.probes.start_rss` reads it)."""

from __future__ import annotations

from benchmarks.refit.actors import BenchOwner, SyntheticEngine
from benchmarks.scale.probes import _note_start


class ScaleOwner(BenchOwner):
    """The refit benchmark's synthetic owner, noting its RSS before its tensors exist."""

    def __init__(self, shapes, seed: int = 0):
        _note_start()
        super().__init__(shapes, seed)


class ScaleEngine(SyntheticEngine):
    """The refit benchmark's light receiver, noting the engine process's RSS before it allocates the model."""

    def __call__(self):
        _note_start()
        return super().__call__()
