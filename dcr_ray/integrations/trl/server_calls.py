"""The HTTP calls a TRL sync makes on its vLLM server(s): dcr_ray's weight-transfer calls plus TRL's pause.

:class:`TrlServerCalls` is dcr_ray's :class:`~dcr_ray.engines.vllm.sync.HttpWeightSync` (vLLM's weight-transfer
routes through vLLM's ``HTTPVLLMWeightSyncClient``, every worker's status read after each call) with the routes
TRL's own ``VLLMClient`` uses around a sync: ``/health``, ``/pause?mode=keep`` (in-flight requests are frozen
in the queue, their tokens so far kept) and ``/resume``. vLLM serves the pause and weight-transfer routes
only with ``VLLM_SERVER_DEV_MODE=1``, which TRL's AsyncGRPO already requires.

One call differs from the adopted-server proxy's: the prefix-cache reset after an apply passes
``reset_running_requests=True``. vLLM refuses a plain reset while running requests hold KV blocks; with the
flag it preempts them, so they recompute their KV with the new weights (their tokens so far stay). vLLM
0.32's ``/pause`` already does this when it pauses (``clear_cache`` defaults to true, also with
``mode=keep``); the flag keeps it true for an apply that runs without a pause (``send_weights`` without a
``pause()`` before it). Either way no request continues on KV the old weights computed, and no new request
hits a prefix cached under them.
"""

from __future__ import annotations

import time
from typing import Sequence

from dcr_ray.engines.vllm.sync import HttpWeightSync
from dcr_ray.errors import BackendError

#: How TRL pauses its server (``VLLMClient.pause``): requests are frozen, not aborted.
PAUSE_MODE = "keep"


class TrlServerCalls(HttpWeightSync):
    """dcr_ray's HTTP weight-transfer calls on every server of ``urls``, plus readiness and pause/resume."""

    def __init__(self, urls: Sequence[str], timeout_s: float = 1800.0):
        super().__init__(urls, timeout_s)

    def wait_ready(self, timeout_s: float, poll_s: float = 0.5) -> None:
        """Until every server answers ``/health`` with 200; :class:`BackendError` naming the silent ones
        after ``timeout_s``."""
        import requests

        waiting = list(self.urls)
        deadline = time.monotonic() + timeout_s
        while waiting:
            for url in list(waiting):
                try:
                    if requests.get(f"{url}/health", timeout=5).status_code == 200:
                        waiting.remove(url)
                except requests.RequestException:
                    pass
            if not waiting:
                return
            if time.monotonic() >= deadline:
                raise BackendError(f"vLLM server(s) {waiting} did not answer /health within {timeout_s:.0f} s "
                                   f"(TrlDcrConfig.server_timeout_s); is the server started and reachable?")
            time.sleep(poll_s)

    def pause(self) -> None:
        """Pause generation on every server as TRL does (``mode=keep``). If any server refuses, the ones
        that paused are resumed before the :class:`BackendError` is raised."""
        try:
            self._each("pause", lambda i: self._request(i, "POST", "pause", params={"mode": PAUSE_MODE}))
        except BackendError:
            try:
                self.resume()
            except BackendError:
                pass  # the pause's own error (an HTTP 404 names VLLM_SERVER_DEV_MODE) says more
            raise

    def resume(self) -> None:
        """Resume generation on every server."""
        self._each("resume", lambda i: self._request(i, "POST", "resume"))

    def is_paused(self) -> list[bool]:
        """Whether each server's scheduler is paused."""
        return [bool(r.get("is_paused")) for r in self._each("is_paused",
                                                              lambda i: self._request(i, "GET", "is_paused"))]

    def reset_prefix_cache(self, reset_running_requests: bool = True) -> bool:
        """Drop every server's prefix cache, preempting requests that hold blocks (module docstring: always,
        whatever ``reset_running_requests`` says)."""
        return all(bool(r.get("success", True)) if isinstance(r, dict) else True
                   for r in self._each("reset_prefix_cache", lambda i: self._request(
                       i, "POST", "reset_prefix_cache", params={"reset_running_requests": "true"})))


__all__ = ["PAUSE_MODE", "TrlServerCalls"]
