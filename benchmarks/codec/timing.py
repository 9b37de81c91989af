"""How the codec is timed: encode as an owner runs it, decode+apply as a live engine between refits does.

Every timing keeps all its repeats (wall and process CPU seconds: all threads), so the JSON carries the
raw samples; the tables use the best (least) wall time of the repeats, the machine being shared.

The receiver (:class:`Receiver`) is one engine's tensors for a step. Before each timed decode+apply they
are set back, untimed, to the committed bits, and the engine's kept class counts
(:mod:`dcr_ray.codec.decoding.classcounts`) to what it held then: the counts of exactly those bits, which a live
engine keeps from its previous apply (primed here by placing the step's class-order items once, the same
walk). ``cold`` timings drop the kept counts first: an engine whose bits were written some other way
since (a dense bootstrap, a peer copy), or its first refit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Timed:
    """All repeats of one timing, and the last result."""

    wall: list = field(default_factory=list)
    cpu: list = field(default_factory=list)
    result: object = None

    @property
    def best(self) -> float:
        return min(self.wall)

    @property
    def best_cpu(self) -> float:
        return min(self.cpu)


def timed(fn, repeats: int, setup=None) -> Timed:
    """``fn()`` (or ``fn(setup())``, ``setup`` untimed) ``repeats`` times."""
    out = Timed()
    for _ in range(repeats):
        arg = setup() if setup else None
        c = time.process_time()
        t = time.perf_counter()
        out.result = fn(arg) if setup else fn()
        out.wall.append(time.perf_counter() - t)
        out.cpu.append(time.process_time() - c)
    return out


def meta():
    from dcr_ray.codec import FrameMeta

    return FrameMeta(transfer="bench", attempt=0, producer="bench", payload=0, base=0, target=1)


def encode(step, *, mode="mixed", zstd_level=None, coding="context"):
    """(deltas, frames) of ``step``: the owner's encode path (diff every tensor, then frames; class-order
    positions only for the context coding, as owners do)."""
    from dcr_ray.codec import diff_tensor, encode_frames
    from dcr_ray.codec.encoding.encode import DEFAULT_ZSTD_LEVEL

    deltas = [diff_tensor(n, step.old[n], t, class_order=coding == "context") for n, t in step.new.items()]
    frames = list(encode_frames(deltas, meta(), mode=mode, coding=coding,
                                zstd_level=DEFAULT_ZSTD_LEVEL if zstd_level is None else zstd_level))
    return deltas, frames


def decode_apply(frames, targets) -> None:
    from dcr_ray.codec import apply_decoded, read_frame

    for f in frames:
        apply_decoded(read_frame(f, targets), targets)


def fresh_targets(step) -> dict:
    """Receiver tensors holding the committed bits (a new copy each call)."""
    import torch

    from dcr_ray.codec import bits_view

    out = {}
    for n, t in step.new.items():
        x = torch.empty_like(t)
        bits_view(x)[:] = step.old[n]
        out[n] = x
    return out


def exact(targets: dict, step) -> bool:
    """Bit-exact: every receiver tensor's integer view equals the new tensor's."""
    import numpy as np

    from dcr_ray.codec import bits_view

    return all(np.array_equal(bits_view(targets[n]), bits_view(t)) for n, t in step.new.items())


class Receiver:
    """One engine's tensors for a step (allocated once), reset to the committed bits before each use."""

    def __init__(self, step):
        self.step = step
        self.targets = fresh_targets(step)
        self._kept: dict = {}

    def prime(self, frames) -> None:
        """Keep the class counts of the committed bits for the items of ``frames``, as a live engine
        holds them from its previous apply."""
        from dcr_ray.codec import read_frame
        from dcr_ray.codec.decoding import classcounts, context

        classcounts.forget()
        self.reset(keep_counts=False)
        for f in frames:
            context.resolve(read_frame(f, self.targets).items, self.targets)
        self._kept = classcounts.snapshot()

    def reset(self, keep_counts: bool = True) -> dict:
        """The tensors, holding the committed bits again, and the kept counts as primed (or none)."""
        from dcr_ray.codec import bits_view
        from dcr_ray.codec.decoding import classcounts

        for n, x in self.targets.items():
            bits_view(x)[:] = self.step.old[n]
        classcounts.restore(self._kept if keep_counts else {})
        return self.targets
