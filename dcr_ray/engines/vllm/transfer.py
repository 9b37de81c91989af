"""The ``dcr`` backend of vLLM's weight-transfer API: dcr_ray frames applied inside every vLLM worker.

Select it when starting vLLM (``weight_transfer_config={"backend": "dcr"}``; the plugin in
:mod:`~dcr_ray.engines.vllm.plugin` registers it in every vLLM process), then drive it with vLLM's
own calls, on an ``LLM`` / ``AsyncLLM`` or through ``RayVLLMWeightSyncClient`` /
``HTTPVLLMWeightSyncClient``::

    init_weight_transfer_engine({"init_info": {"checkpoint": "/ckpt", "version": 0, "key": None}})
    start_weight_update()
    update_weights({"update_info": {"base": v, "target": v + 1, "frames": [frame bytes, ...]}})
    finish_weight_update(weight_version=str(v + 1))
    # a refit that will not finish: update_weights({"update_info": {"base": v, "target": v + 1,
    #                                                               "abandon": True}}), then finish
    # does this worker serve committed version v? (writes nothing; fails on any mismatch)
    update_weights({"update_info": {"base": v, "target": v, "verify": [[name, start, stop, digest], ...]}})

``checkpoint`` is the directory the engine was started from (its canonical tensors seed the host
mirror); ``key`` the hex of the shared frame key, if refits sign frames with one. Over HTTP, send
``frames_b64`` (base64 strings) instead of ``frames``. Every frame of one ``update_weights`` call is
validated before any is written; ``finish_weight_update`` reloads the touched fused groups (see
:class:`~dcr_ray.engines.vllm.receiver.MirrorReceiver`). dcr_ray's adopted-engine proxy
(:mod:`~dcr_ray.engines.vllm.adopted`) makes exactly these calls, so the relay tree, commit record and
retries work for engines dcr_ray did not start.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from dcr_ray.engines.vllm.receiver import MirrorReceiver
from dcr_ray.errors import ConfigError, EngineStateError

BACKEND_NAME = "dcr"


@dataclass
class DcrInitInfo(WeightTransferInitInfo):
    checkpoint: str
    """The checkpoint directory the engine was started from (its canonical names and bits)."""
    version: int = 0
    """The policy version that checkpoint holds."""
    key: str | None = None
    """Hex of the frame key (``CodecConfig.key``), or None for unkeyed frames."""
    verify_reload: bool = True
    """Reload the checkpoint's own bits once and refuse to start if any served bit changes."""
    capture: bool | None = None
    """Write changes of tensors whose loader path is a plain view copy straight into live storage (no
    host mirror for them). ``None``: when the model lives on CUDA. Refused on CPU: CPU vLLM derives
    packed copies from loaded weights (e.g. a tied ``lm_head`` from ``embed_tokens``) that a sparse
    write into the source tensor would leave stale."""


@dataclass
class DcrUpdateInfo(WeightTransferUpdateInfo):
    base: int
    """The version the frames were built on (the version this engine holds)."""
    target: int
    """The version the engine holds after ``finish_weight_update``."""
    frames: list[bytes] = field(default_factory=list)
    frames_b64: list[str] = field(default_factory=list)
    """The same frames, base64-encoded (for the JSON of the HTTP routes)."""
    abandon: bool = False
    """Leave the open update without reloading anything (the refit it belonged to was abandoned)."""
    verify: list | None = None
    """Instead of frames: ``[[name, start, stop, digest], ...]``, committed digests of canonical boxes
    (:mod:`dcr_ray.sharding.digest`). Nothing is written; the call fails with
    :class:`~dcr_ray.errors.EngineStateError` unless every box of what this worker serves has
    that digest (see :meth:`MirrorReceiver.verify`). ``base`` = ``target`` = the committed version."""


class DcrWeightTransferEngine(WeightTransferEngine[DcrInitInfo, DcrUpdateInfo]):
    """Per-worker engine: a :class:`MirrorReceiver` fed by ``update_weights``."""

    init_info_cls = DcrInitInfo
    update_info_cls = DcrUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: MirrorReceiver | None = None
        self._shut_down: MirrorReceiver | None = None  # the receiver before shutdown (a reconnect checks it)
        self.last_finish: dict[str, int] = {}

    def init_transfer_engine(self, init_info: DcrInitInfo) -> None:
        key = bytes.fromhex(init_info.key) if init_info.key else None
        capture = init_info.capture if init_info.capture is not None else self.device.type == "cuda"
        if capture and self.device.type != "cuda":
            raise ConfigError("capture=True needs vLLM on CUDA: CPU vLLM repacks loaded weights into derived "
                              "copies that sparse writes would leave stale; use capture=False (the mirror path)")
        receiver = MirrorReceiver(self.model, self.vllm_config, init_info.checkpoint, key=key,
                                  version=init_info.version, capture=capture)
        previous = self.receiver or self._shut_down
        if previous is not None:  # a trainer reconnects: what the worker serves must be that checkpoint,
            receiver.adopt_served(previous)  # shown without writing (a reload would overwrite what it serves)
        elif init_info.verify_reload:
            receiver.check_reload_is_a_fresh_load()
        self.receiver, self._shut_down = receiver, None

    def start_weight_update(self) -> None:
        self._receiver()  # nothing to prepare: frames land in the mirror, the reload runs at finish

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # CPU writes: nothing to synchronize

    def receive_weights(self, update_info: DcrUpdateInfo) -> None:
        r = self._receiver()
        try:
            self._receive(r, update_info)
        except BaseException:
            r.reset()  # every failure closes the update: the mirror is back at its base, the version unmoved
            raise

    def _receive(self, r: MirrorReceiver, update_info: DcrUpdateInfo) -> None:
        if update_info.abandon:
            r.abandon()
            return
        if update_info.verify is not None:
            if update_info.frames or update_info.frames_b64:
                raise ConfigError("update_weights: 'verify' checks digests and writes nothing; send frames "
                                  "in another call")
            if update_info.base != update_info.target:
                raise ConfigError(f"update_weights: a digest check names one version (base == target), got "
                                  f"{update_info.base}->{update_info.target}")
            r.verify(update_info.verify, update_info.base)
            return
        frames = list(update_info.frames) + [base64.b64decode(s) for s in update_info.frames_b64]
        r.apply(frames, update_info.base, update_info.target)

    def finish_weight_update(self) -> None:
        r = self._receiver()
        if r.target is not None:  # only an update whose frames were all validated and written is open
            try:
                self.last_finish = r.finish()
            except BaseException:
                r.reset()
                raise

    def shutdown(self) -> None:
        """Release the trainer connection; the worker keeps serving, and a later
        ``init_weight_transfer_engine`` takes over from what it serves (see ``adopt_served``)."""
        if self.receiver is not None:
            self.receiver.reset()
        self._shut_down, self.receiver = self.receiver, None

    def _receiver(self) -> MirrorReceiver:
        if self.receiver is None:
            raise EngineStateError("the dcr weight-transfer engine was not initialised: call "
                                   "init_weight_transfer_engine({'checkpoint': ...}) first")
        return self.receiver
