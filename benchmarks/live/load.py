"""A closed loop of generation against one engine: the next request leaves when the last one returned.

Each request asks for ``tokens`` tokens of one short prompt; every answer carries the engine's own
timestamps (``t_start``: admitted, ``t_end``: answered) and the version it was generated from, so the
gaps between answers, the tokens per second of a window and the versions served over time all come
from the engine's clock.
"""

from __future__ import annotations

import threading
import time


class GenerationLoop:
    """Ray actor (``num_cpus=0``, two threads: :meth:`run` and :meth:`stop`)."""

    def __init__(self, engine, prompt: list[int], tokens: int):
        self.engine, self.prompt, self.tokens = engine, list(prompt), tokens
        self._stop = threading.Event()
        self.records: list[tuple] = []  # (t_sent, t_start, t_end, tokens, version), engine clock but t_sent

    def run(self) -> int:
        import ray

        while not self._stop.is_set():
            t_sent = time.time()
            try:
                res = ray.get(self.engine.generate.remote([self.prompt], self.tokens, 600.0))
            except Exception:  # noqa: BLE001 - a refused request (engine holding no version) is a gap
                time.sleep(0.01)
                continue
            self.records.append((t_sent, res["t_start"], res["t_end"], self.tokens, res["version"]))
        return len(self.records)

    def stop(self) -> list[tuple]:
        self._stop.set()
        return list(self.records)

    def snapshot(self) -> list[tuple]:
        return list(self.records)


def tokens_per_second(records: list[tuple], t0: float, t1: float) -> float:
    """Tokens answered in ``[t0, t1]`` per second (an answer counts at its ``t_end``)."""
    if t1 <= t0:
        return 0.0
    return sum(r[3] for r in records if t0 <= r[2] <= t1) / (t1 - t0)


def longest_gap(records: list[tuple], t0: float, t1: float) -> float:
    """The longest time in ``[t0, t1]`` without an answer (engine clock): between consecutive answers,
    and from ``t0`` to the first / the last to ``t1``."""
    ends = sorted(r[2] for r in records if t0 <= r[2] <= t1)
    edges = [t0, *ends, t1]
    return max(b - a for a, b in zip(edges, edges[1:]))
