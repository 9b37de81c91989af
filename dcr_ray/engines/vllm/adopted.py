"""Adopted vLLM engines: refit a vLLM fleet dcr_ray did not start, through vLLM's weight-transfer calls.

The engine must run with ``weight_transfer_config={"backend": "dcr"}`` (the plugin registers the
backend in every vLLM process). dcr_ray starts one light *proxy* engine actor per adopted engine; the
proxy takes part in the refit protocol like any engine (validates every frame against the checkpoint's
tensors before forwarding it, journals payload keys, acknowledges at flush, refuses stale or
duplicate payloads) and drives the real engine with vLLM's own calls::

    prepare    -> start_weight_update()            (first frame of an attempt)
    deliver    -> update_weights({base, target, frames: [the frame's bytes]})
    flush      -> finish_weight_update(weight_version=str(target)); reset_prefix_cache()

so the relay tree, the commit record, retries and the dirty-engine handling are the same as for
engines dcr_ray starts. The workers validate every frame again before writing
(:class:`~dcr_ray.engines.vllm.receiver.MirrorReceiver`). From ``finish_weight_update`` on the engine
serves the new bits and tags outputs with their version; a refit that is abandoned after that point
leaves the engine dirty, and the coordinator re-bootstraps it densely.

What the proxy cannot do is read the served weights back (it sees only vLLM's public calls), so its
``tensors()`` refuses: check an adopted engine by its outputs and ``get_weight_version()``.
"""

from __future__ import annotations

from typing import Any, Sequence

from dcr_ray.codec import DecodedFrame
from dcr_ray.engines.base import EngineBackend
from dcr_ray.engines.vllm.checkpoint import checkpoint_specs
from dcr_ray.errors import BackendError, ConfigError


class WeightSyncBackend(EngineBackend):
    """The proxy's backend: forwards validated wire frames to vLLM engine actors' weight-transfer calls."""

    wants_wire_frames = True

    def __init__(self, handles: Sequence[Any], checkpoint: str, *, version: int = 0, key: bytes | None = None,
                 capture: bool | None = None, timeout_s: float = 300.0):
        import ray

        self._ray = ray
        self.handles = list(handles)
        self.timeout_s = timeout_s
        self._specs = checkpoint_specs(checkpoint)
        self.version = version
        self._open: tuple[int, int] | None = None
        self._call("init_weight_transfer_engine", {"init_info": {
            "checkpoint": checkpoint, "version": version, "key": key.hex() if key else None, "capture": capture}})

    def _call(self, method: str, *args) -> list:
        try:
            return self._ray.get([getattr(h, method).remote(*args) for h in self.handles], timeout=self.timeout_s)
        except self._ray.exceptions.RayTaskError as e:
            raise BackendError(f"adopted vLLM engine: {method} failed: {e.as_instanceof_cause()!r}") from e

    # -- contract ----------------------------------------------------------------------------------
    def tensor_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return dict(self._specs)

    def tensors(self):
        raise BackendError("an adopted vLLM engine's weights cannot be read back through vLLM's weight-transfer "
                           "API; compare its outputs and get_weight_version() instead")

    def apply(self, frame: DecodedFrame) -> None:
        raise BackendError("an adopted vLLM engine takes wire frames (apply_wire), not decoded ones")

    def apply_wire(self, data: bytes, frame: DecodedFrame) -> None:
        """Forward one validated frame to every handle (all DP replicas of this engine)."""
        update = (frame.meta.base, frame.meta.target)
        if self._open is None:
            self._call("start_weight_update")
            self._open = update
        elif self._open != update:
            raise BackendError(f"frame for {update[0]}->{update[1]} inside the open update "
                               f"{self._open[0]}->{self._open[1]}")
        try:
            self._call("update_weights", {"update_info": {"base": update[0], "target": update[1], "frames": [data]}})
        except BackendError:
            self._open = None  # vLLM closed its update session; the next frame (a retry) opens another
            raise

    def flush(self) -> None:
        """Reload what the frames touched and tag outputs with the new version; drop KV of old weights."""
        if self._open is None:
            return
        target = self._open[1]
        self._call("finish_weight_update", str(target))
        self._open = None
        self.version = target
        if not all(self._call("reset_prefix_cache")):
            raise BackendError("the adopted vLLM engine refused to reset its prefix cache (requests still "
                               "running): pause its generation around refits")

    def abandon(self) -> None:
        """Close an update whose refit was abandoned without reloading anything (the engine keeps serving
        what it served; its mirror holds no version until the dense bootstrap that follows)."""
        if self._open is None:
            return
        base, target = self._open
        self._call("update_weights", {"update_info": {"base": base, "target": target, "abandon": True}})
        self._call("finish_weight_update")
        self._open = None

    def load_dense(self, tensors) -> None:
        raise BackendError("adopted engines are bootstrapped with dense frames through the refit protocol")

    def activate(self, version: int) -> None:
        self.version = version


class AdoptedVllmEngine:
    """Engine factory for one adopted vLLM engine (give it to ``ClusterSpec(adopt=[...])``).

    ``handles``: the Ray actor handle of an ``LLM`` / ``AsyncLLM`` actor (or of any actor exposing
    vLLM's weight-transfer methods and ``reset_prefix_cache``), or a list of handles that are data
    parallel replicas of one engine. ``checkpoint``: the directory it was started from, holding
    ``version``. ``capture``: see :class:`~dcr_ray.engines.vllm.transfer.DcrInitInfo` (default: on CUDA).
    """

    def __init__(self, handles: Any, *, checkpoint: str, version: int = 0, key: bytes | None = None,
                 capture: bool | None = None):
        self.handles = list(handles) if isinstance(handles, (list, tuple)) else [handles]
        if not self.handles or not all(hasattr(h, "update_weights") for h in self.handles):
            raise ConfigError("AdoptedVllmEngine needs Ray actor handles exposing vLLM's weight-transfer methods "
                              "(init_weight_transfer_engine, start_weight_update, update_weights, "
                              "finish_weight_update)")
        self.checkpoint = checkpoint
        self.version = version
        self.key = key
        self.capture = capture

    def __call__(self) -> WeightSyncBackend:
        return WeightSyncBackend(self.handles, self.checkpoint, version=self.version, key=self.key,
                                 capture=self.capture)
