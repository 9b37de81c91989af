"""The trainer side of vLLM's ``dcr`` weight-transfer backend: a vLLM-style trainer sends only changed bits.

vLLM pairs every weight-transfer backend with a trainer-side engine registered under the same name in
``WeightTransferTrainerFactory``; this is ``dcr``'s (registered by dcr_ray's vLLM plugin, and on import of
this module)::

    from vllm.distributed.weight_transfer import (ModuleSource, RayVLLMWeightSyncClient,
                                                  WeightTransferTrainerFactory)
    from dcr_ray.integrations.vllm.trainer import DcrTrainerInitInfo

    llm = ray.remote(LLM).remote(model="/ckpt", weight_transfer_config={"backend": "dcr"})
    sender = WeightTransferTrainerFactory.trainer_init(
        DcrTrainerInitInfo(checkpoint="/ckpt", rank=rank),   # the directory the engines started from
        client=RayVLLMWeightSyncClient(llm),                 # or HTTPVLLMWeightSyncClient("http://host:8000")
        source=ModuleSource(model))                          # optional: or pass pairs to send_weights
    for step in range(steps):
        train_one_step(model)
        sender.send_weights()          # or sender.send_weights(model.named_parameters()) without a source

``send_weights`` runs on every trainer rank; each iterates the source (materialising an FSDP ``DTensor``
is a collective), only rank 0 (the sender) keeps the tensors and touches the client. The sender holds a
dcr_ray owner (:class:`~dcr_ray.actors.owner.delta.DeltaOwner`) whose baseline starts as the checkpoint's bits
(what the engines serve at ``version``); each round it casts every tensor to the checkpoint's dtype,
diffs it against the baseline, and sends the changed elements as XOR / OVERWRITE frames
(``start_weight_update``, ``update_weights`` with up to ``call_bytes`` of frames per call,
``finish_weight_update``); the engines' workers validate every frame, apply it and reload the touched
fused groups, so they serve exactly what a dense load of the same tensors would give. The version label
moves (``weight_version`` = the round's version) and the prefix cache is dropped only once every worker
said yes; only then does the owner promote its baseline. Any refusal abandons the round everywhere (the
workers' mirrors get back the bits the round replaced, the baseline stays) and raises
:class:`~dcr_ray.errors.BackendError`; the next ``send_weights`` diffs from the same baseline again. A
round in which no bit changed calls nothing.

Every worker's outcome is read after each call (``collective_rpc("dcr_transfer_status")``, see
:mod:`~dcr_ray.engines.vllm.worker.transfer`) when the client is vLLM's ``RayVLLMWeightSyncClient`` (handles of
``LLM`` / ``AsyncLLM`` actors) or ``HTTPVLLMWeightSyncClient`` (a server in ``VLLM_SERVER_DEV_MODE=1``,
which serves ``/collective_rpc``); with another client only its raises are seen, which is vLLM's
contract at one worker, not with tensor parallelism.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager, Iterable

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, WeightSource
from vllm.distributed.weight_transfer import clients as vllm_clients
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient

from dcr_ray.actors.owner.delta import DeltaOwner
from dcr_ray.config import CodecConfig, OwnerConfig, RefitConfig
from dcr_ray.engines.vllm.adopted import WeightSyncBackend
from dcr_ray.engines.vllm.checkpoint import checkpoint_files, iter_checkpoint
from dcr_ray.engines.vllm.compat import iter_source, source_sender_holds_all
from dcr_ray.engines.vllm.plugin import BACKEND_NAME, frames_as_base64, register_trainer
from dcr_ray.engines.vllm.sync import HttpWeightSync, RayWeightSync
from dcr_ray.errors import BackendError, ConfigError

log = logging.getLogger(__name__)


@dataclass
class DcrTrainerInitInfo(TrainerInitInfo):
    """What the ``dcr`` trainer engine needs (``rank``, keyword-only, is this trainer process's rank)."""

    backend: ClassVar[str] = BACKEND_NAME

    checkpoint: str
    """The checkpoint directory the vLLM engines were started from; it holds the bits they serve at
    ``version`` (the sender's first baseline; the engines' workers read it too)."""
    version: int = 0
    """The version the engines serve now (0: the checkpoint as started). Each round sends ``version + 1``."""
    codec: CodecConfig = field(default_factory=CodecConfig)
    """Frame encoding (bucket size, coding, the frame key the engines check)."""
    call_bytes: int = 64 << 20
    """Frame bytes sent per ``update_weights`` call, at most (one frame may exceed it alone)."""
    timeout_s: float = 300.0
    """Bound on each weight-transfer call through vLLM's built-in clients."""
    capture: bool | None = None
    """The engines' capture setting (see :class:`~dcr_ray.engines.vllm.worker.transfer.DcrInitInfo`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint, str) or not self.checkpoint:
            raise ConfigError("DcrTrainerInitInfo.checkpoint must be the directory the vLLM engines were started "
                              "from, e.g. DcrTrainerInitInfo(checkpoint='/ckpt', rank=0)")
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ConfigError(f"DcrTrainerInitInfo.version must be an integer >= 0 (the version the engines "
                              f"serve), got {self.version!r}")
        if not isinstance(self.codec, CodecConfig):
            raise ConfigError(f"DcrTrainerInitInfo.codec must be a dcr_ray.CodecConfig, got "
                              f"{type(self.codec).__name__}")
        if isinstance(self.call_bytes, bool) or not isinstance(self.call_bytes, int) or self.call_bytes <= 0:
            raise ConfigError(f"DcrTrainerInitInfo.call_bytes must be a positive integer, got {self.call_bytes!r}")
        if not self.timeout_s > 0:
            raise ConfigError(f"DcrTrainerInitInfo.timeout_s must be > 0, got {self.timeout_s!r}")


class ClientCalls:
    """vLLM's weight-transfer calls through a ``VLLMWeightSyncClient`` (the calls the adopted-engine logic,
    :class:`~dcr_ray.engines.vllm.adopted.WeightSyncBackend`, makes and checks).

    The four calls go through ``client``; every worker's status, the version label and the prefix cache
    through the same endpoints (:class:`~dcr_ray.engines.vllm.sync.RayWeightSync` /
    :class:`~dcr_ray.engines.vllm.sync.HttpWeightSync`) for vLLM's built-in clients, and through ``client``
    itself when it is one of those (a :class:`~dcr_ray.engines.vllm.sync.WeightSyncCalls`). Another client
    answers the status itself from the calls it made (a raise is its only "no")."""

    def __init__(self, client: Any, timeout_s: float = 300.0):
        self.client = client
        self.where = type(client).__name__
        self._http = isinstance(client, HTTPVLLMWeightSyncClient)
        if isinstance(client, RayVLLMWeightSyncClient):
            self._side = RayWeightSync(client.handles, timeout_s)
        elif self._http:
            self._side = HttpWeightSync([client.base_url], timeout_s)
        elif callable(getattr(client, "transfer_status", None)):
            # dcr_ray's own calls (engines/vllm/sync.py): they read status, version and cache themselves
            self._side, self.where = client, getattr(client, "where", self.where)
        else:
            self._side = None
        self._seq, self._op = 0, None

    def _call(self, op: str, method: str, *args) -> None:
        self._seq, self._op = self._seq + 1, op
        try:
            getattr(self.client, method)(*args)
        except BackendError:
            raise
        except Exception as e:  # a refusal raised by the engine (one worker) or by the transport
            raise BackendError(f"{self.where}.{method} failed: {type(e).__name__}: {e}") from e

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init", "init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start", "start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        if self._http and not getattr(getattr(vllm_clients, "_json_safe_update_info", None), "_dcr_frames", False):
            update_info = frames_as_base64(update_info)  # vLLM's client cannot encode them itself
        self._call("update", "update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None:
            self._call("finish", "finish_weight_update")
        else:
            self._call("finish", "finish_weight_update", weight_version)

    def update_weight_version(self, weight_version: str) -> None:
        if self._side is not None:
            self._side.update_weight_version(weight_version)
        elif hasattr(self.client, "update_weight_version"):
            self.client.update_weight_version(weight_version)

    def transfer_status(self, nonce: str) -> list:
        if self._side is not None:
            return self._side.transfer_status(nonce)
        return [[{"nonce": nonce, "rank": 0, "seq": self._seq, "op": self._op, "ok": True, "error": None,
                  "session": False}]]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        if self._side is not None:
            return self._side.reset_prefix_cache(reset_running_requests)
        reset = getattr(self.client, "reset_prefix_cache", None)
        if reset is None:
            return True
        return (reset(reset_running_requests=True) if reset_running_requests else reset()) is not False

    def get_weight_version(self) -> list[str]:
        return self._side.get_weight_version() if self._side is not None else []


class _Batches:
    """The owner's sink: frames go out in ``update_weights`` calls of at most ``limit`` bytes."""

    def __init__(self, backend: WeightSyncBackend, base: int, target: int, limit: int):
        self.backend, self.base, self.target, self.limit = backend, base, target, limit
        self.buf: list[bytes] = []
        self.size = self.frames = self.calls = 0

    def send(self, frame: bytes, key) -> None:
        if self.buf and self.size + len(frame) > self.limit:
            self.drain()
        self.buf.append(frame)
        self.size += len(frame)
        self.frames += 1

    def drain(self) -> None:
        if self.buf:
            self.backend.send_frames(self.buf, self.base, self.target)
            self.calls += 1
            self.buf, self.size = [], 0


class DcrTrainerWeightTransferEngine(TrainerWeightTransferEngine[DcrTrainerInitInfo]):
    """Trainer-side ``dcr`` engine: one dcr_ray owner on the sender, fed each round (module docstring).

    Build it with ``WeightTransferTrainerFactory.trainer_init(DcrTrainerInitInfo(...), client=...,
    source=...)`` on every trainer rank."""

    init_info_cls = DcrTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource | None = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info: DcrTrainerInitInfo | None = None
        self.backend: WeightSyncBackend | None = None
        self.owner: DeltaOwner | None = None
        self.specs: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.version: int | None = None
        self.last: dict[str, Any] = {}
        self._run = uuid.uuid4().hex[:8]

    @classmethod
    def trainer_init(cls, init_info: DcrTrainerInitInfo, *, client: Any,
                     source: WeightSource | None = None) -> "DcrTrainerWeightTransferEngine":
        """On the sender: initialise the engines' ``dcr`` backend (``init_weight_transfer_engine``, checked
        on every worker) and take the checkpoint's bits as the owner's baseline. Other ranks only keep
        ``source``."""
        if not isinstance(init_info, DcrTrainerInitInfo):
            raise ConfigError(f"the dcr trainer engine takes a DcrTrainerInitInfo, got {type(init_info).__name__}")
        if source is not None and not isinstance(source, WeightSource):
            raise ConfigError(f"source must be a vLLM WeightSource (e.g. ModuleSource(model)), got "
                              f"{type(source).__name__}; or pass (name, tensor) pairs to send_weights")
        if source is not None and not source_sender_holds_all(source):  # the same answer on every rank
            raise ConfigError("the dcr trainer engine sends from rank 0, which must hold every parameter; a "
                              "WeightSource split among ranks (held_names(), or owned_names(rank) from vLLM 0.33) "
                              "needs one dcr_ray owner per rank (dcr_ray.launch with the ranks' owners)")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.info, engine.version = init_info, init_info.version
        if not engine.is_sender:
            return engine
        checkpoint_files(init_info.checkpoint)  # a clear error for a directory without safetensors
        key = init_info.codec.key
        engine.backend = WeightSyncBackend(ClientCalls(client, init_info.timeout_s), init_info.checkpoint,
                                           version=init_info.version, key=key, capture=init_info.capture,
                                           timeout_s=init_info.timeout_s)
        engine.specs = engine.backend.tensor_specs()
        engine.owner = DeltaOwner("vllm-trainer", RefitConfig(codec=init_info.codec,
                                                               owners=OwnerConfig(promote="inline")), in_memory=True)
        engine.owner.attach(dict(iter_checkpoint(checkpoint_files(init_info.checkpoint))), init_info.version)
        return engine

    def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None, *,
                     apply_window: Callable[[], ContextManager] | None = None) -> dict[str, Any]:
        """Send what changed since the last round: ``weights`` (``(name, tensor)`` pairs, e.g.
        ``model.named_parameters()``), else a fresh pass over the source. Called on every rank (each
        iterates); the sender returns the round's summary (``version``, ``changed`` elements, ``frames``,
        ``calls``, ``wire_bytes``, ``seconds``), the others ``{}``.

        ``apply_window``: a context manager factory entered around the apply (``finish_weight_update``,
        the version label, the prefix cache) of a round that sent frames; the frames before it only reach
        the workers' mirrors, so a caller that pauses generation for the apply alone pauses there."""
        if weights is None and self.source is None:
            raise ConfigError("send_weights() has nothing to send: give a WeightSource to trainer_init, or the "
                              "(name, tensor) pairs to send_weights(pairs)")
        if self.is_sender and self.owner is None:
            raise ConfigError("send_weights after shutdown (or without trainer_init): build the engine with "
                              "WeightTransferTrainerFactory.trainer_init(DcrTrainerInitInfo(...), client=...)")
        t0 = time.perf_counter()
        tensors, problems = self._collect(weights if weights is not None else iter_source(self.source))
        if not self.is_sender:
            return {}
        if problems:
            raise ConfigError(f"send_weights: nothing sent; {len(problems)} tensor(s) cannot be sent: "
                              + "; ".join(problems[:4]))
        base, target = self.version, self.version + 1
        sink = _Batches(self.backend, base, target, self.info.call_bytes)
        try:
            summary = self.owner.stream(tensors, transfer=f"vllm-{self._run}-v{target}", attempt=0, base=base,
                                        target=target, sink=sink)
            if sink.frames:
                with apply_window() if apply_window is not None else contextlib.nullcontext():
                    self.backend.flush()
        except BaseException:
            self._abandon(target)
            raise
        if sink.frames:
            self.owner.promote(target)
            self.version = target
        else:
            self.owner.discard()  # nothing changed: no call, the version stays
        self.last = {"version": self.version, "changed": summary["changed"], "frames": sink.frames,
                     "calls": sink.calls, "wire_bytes": summary["wire_bytes"],
                     "seconds": time.perf_counter() - t0}
        log.info("dcr trainer engine: version %d, %d changed elements in %d frames (%d bytes, %d calls), %.2f s",
                 self.version, self.last["changed"], sink.frames, summary["wire_bytes"], sink.calls,
                 self.last["seconds"])
        return dict(self.last)

    def _collect(self, pairs) -> tuple[dict[str, torch.Tensor], list[str]]:
        """Every pair iterated (all ranks, in order); the sender keeps each tensor cast to its checkpoint
        dtype, on the host. Returns the tensors and what cannot be sent (refused after the whole pass,
        so ranks iterating in lockstep never stop half way)."""
        tensors: dict[str, torch.Tensor] = {}
        problems: list[str] = []
        for name, t in pairs:
            if not self.is_sender:
                continue
            spec = self.specs.get(name)
            if spec is None:
                problems.append(f"{name!r} is not a tensor of the checkpoint {self.info.checkpoint!r}")
                continue
            if t is None:
                problems.append(f"{name!r} is not held by rank 0 (the sender)")
                continue
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != spec[1]:
                problems.append(f"{name!r} has shape {tuple(getattr(t, 'shape', ()))}, the checkpoint {spec[1]}")
                continue
            dtype = getattr(torch, spec[0])
            if t.dtype != dtype and not (t.dtype.is_floating_point and dtype.is_floating_point):
                problems.append(f"{name!r} is {t.dtype}, the checkpoint holds {dtype} (only floating tensors "
                                f"are cast)")
                continue
            tensors[name] = t.detach().to(dtype=dtype).cpu().contiguous()
        return tensors, problems

    def _abandon(self, target: int) -> None:
        """A failed round: the workers drop it (unless every one already serves it), the owner too."""
        if self.backend.version == target:  # every worker finished: they serve target; keep in step with them
            self.owner.promote(target)
            self.version = target
            return
        try:
            self.backend.abandon()
        except Exception as e:  # the engines refuse the next round's base until they are reset
            log.warning("dcr trainer engine: closing the failed round on the engines failed: %s", e)
        self.owner.discard()

    def shutdown(self) -> None:
        """Drop the owner's baseline (host memory); the engines keep serving. A later ``trainer_init``
        reconnects (from the checkpoint of the version they serve)."""
        self.owner = self.backend = None


register_trainer()

__all__ = ["BACKEND_NAME", "ClientCalls", "DcrTrainerInitInfo", "DcrTrainerWeightTransferEngine"]
