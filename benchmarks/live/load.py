"""Clients of an engine: closed loops of generation, each streaming its answers token by token.

Each :class:`GenerationLoop` is one client: it sends a request for ``tokens`` tokens of a short prompt,
and the next one when the last answer is complete. Several loops per engine are concurrent requests.
Every answer carries the engine's own timestamps (``t_start``: admitted, ``t_end``: answered), the
version it was generated from and, with :mod:`.stream` installed, the time of each of its tokens.

What a client sees is its stream of tokens: :func:`client_gaps` are the gaps between consecutive tokens
of one client, across its requests (the first token of a request follows the last token of the one
before, or the request's sending). A request that waits at admission while the engine is paused, or
whose decode slows because the engine's cores are busy with something else, shows as a long gap.
"""

from __future__ import annotations

import threading
import time


class GenerationLoop:
    """Ray actor (``num_cpus=0``, two threads: :meth:`run` and :meth:`stop`): one client of one engine."""

    def __init__(self, engine, prompt: list[int], tokens: int):
        self.engine, self.prompt, self.tokens = engine, list(prompt), tokens
        self._stop = threading.Event()
        #: (t_sent, t_start, t_end, tokens, version, token_times): engine clock, but t_sent
        self.records: list[tuple] = []

    def run(self) -> int:
        import ray

        while not self._stop.is_set():
            t_sent = time.time()
            try:
                res = ray.get(self.engine.generate.remote([self.prompt], self.tokens, 600.0))
            except Exception:  # noqa: BLE001 - a refused request (engine holding no version) is a gap
                time.sleep(0.01)
                continue
            times = res["outputs"][0].get("token_times") or [res["t_end"]]
            self.records.append((t_sent, res["t_start"], res["t_end"], self.tokens, res["version"], times))
        return len(self.records)

    def stop(self) -> list[tuple]:
        self._stop.set()
        return list(self.records)

    def snapshot(self) -> list[tuple]:
        return list(self.records)


def tokens_per_second(records: list[tuple], t0: float, t1: float) -> float:
    """Tokens answered in ``[t0, t1]`` per second (each token at its own time)."""
    if t1 <= t0:
        return 0.0
    return sum(1 for r in records for t in r[5] if t0 <= t <= t1) / (t1 - t0)


def longest_gap(records: list[tuple], t0: float, t1: float) -> float:
    """The longest time in ``[t0, t1]`` without an answer (engine clock): between consecutive answers,
    and from ``t0`` to the first / the last to ``t1``."""
    ends = sorted(r[2] for r in records if t0 <= r[2] <= t1)
    edges = [t0, *ends, t1]
    return max(b - a for a, b in zip(edges, edges[1:]))


def client_gaps(records: list[tuple]) -> list[tuple[float, float]]:
    """One client's gaps ``(a, b)`` between consecutive tokens, across its requests in order."""
    out, last = [], None
    for t_sent, _t0, _t1, _n, _v, times in sorted(records, key=lambda r: r[0]):
        prev = t_sent if last is None else last
        for t in times:
            out.append((prev, t))
            prev = t
        last = prev
    return out


def token_steps(records: list[tuple], t0: float, t1: float) -> list[float]:
    """The gaps between consecutive tokens of one request (a decoding step as its client sees it), for the
    requests' tokens inside ``[t0, t1]``."""
    out = []
    for r in records:
        times = [t for t in r[5] if t0 <= t <= t1]
        out += [b - a for a, b in zip(times, times[1:])]
    return out


def gaps_within(gaps: list[tuple[float, float]], t0: float, t1: float) -> list[float]:
    """The seconds of every gap that overlaps ``[t0, t1]`` (a client waiting through the whole window
    counts once, with all of its wait)."""
    return [b - a for a, b in gaps if a < t1 and b > t0]


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of ``xs``, or None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]
