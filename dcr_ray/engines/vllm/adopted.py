"""Adopted vLLM engines: refit a vLLM fleet dcr_ray did not start, through vLLM's weight-transfer calls.

The engine must run with ``weight_transfer_config={"backend": "dcr"}`` (the plugin registers the
backend in every vLLM process). dcr_ray starts one light *proxy* engine actor per adopted engine; the
proxy takes part in the refit protocol like any engine (validates every frame against the checkpoint's
tensors before forwarding it, journals payload keys, acknowledges at flush, refuses stale or
duplicate payloads) and drives the real engine with vLLM's own calls::

    prepare    -> start_weight_update()            (first frame of an attempt)
    deliver    -> update_weights({base, target, frames: [the frame's bytes]})
    flush      -> finish_weight_update(); update_weight_version(str(target)); reset_prefix_cache()
                  (see "Requests held across an update" below)

and after each of those calls it reads every worker's outcome (``collective_rpc("dcr_transfer_status")``,
see :mod:`~dcr_ray.engines.vllm.worker.transfer`): with tensor parallelism the workers agree on a "no" and only
the last rank raises it, so vLLM's ``collective_rpc`` stays in step and every worker's session is
closed; the status names each rank's reason. Any "no" is a :class:`~dcr_ray.errors.BackendError` here
(a session some worker still reports open is closed without a version); the version label moves only
after every worker said yes to ``finish``.

so the relay tree, the commit record, retries and the dirty-engine handling are the same as for
engines dcr_ray starts. The calls reach the engine through Ray actor handles (``LLM`` / ``AsyncLLM``
actors) or over HTTP (``vllm serve`` processes, :class:`AdoptedVllmServer`); only the transport of the
calls differs (:mod:`~dcr_ray.engines.vllm.sync`). The workers validate every frame again before writing
(:class:`~dcr_ray.engines.vllm.worker.receiver.MirrorReceiver`). From ``finish_weight_update`` on the engine
serves the new bits and tags outputs with their version; a refit that is abandoned after that point
leaves the engine dirty, and the coordinator re-bootstraps it densely.

Joining: before a dense bootstrap the coordinator asks the proxy whether the engine already holds the
committed version (:meth:`WeightSyncBackend.matches_digests`): the engine's workers digest the
canonical tensors they serve, box by box, against the owners' committed digests inside one
``update_weights({"verify": ...})`` call that writes nothing. An engine started from the committed
checkpoint joins without a single dense frame; any other is refit densely.

Requests held across an update: a framework that pauses its engine around a refit in vLLM's keep mode
(``pause_generation(mode="keep", clear_cache=False)``, as PipelineRL and SkyRL's in-flight updates do)
holds its running requests, with their KV blocks, across the update; vLLM then refuses
``reset_prefix_cache()``. The update itself goes through either way (the weights and the version label are
the new version's before the reset is asked). What the proxy does with the KV computed under the old
version is ``held_requests``:

- ``"recompute"`` (the default): ``reset_prefix_cache(reset_running_requests=True)``: vLLM preempts the
  held requests (they resume from their tokens, their KV recomputed under the new version when the
  framework resumes generation) and drops the prefix cache. No KV of the old version survives: no request,
  held or new, reads it. vLLM's own ``pause_generation(mode="keep")`` with ``clear_cache=True`` does the
  same at the pause.
- ``"keep"``: the held requests keep their KV (PipelineRL's in-flight semantics); the prefix cache, which
  vLLM cannot drop while they hold blocks, is left, so a new request may reuse a prefix cached under the
  old version unless the framework salts its requests by weight version (``cache_salt``, e.g. the
  version ``get_weight_version()`` reports). Engines dcr_ray starts do exactly that themselves
  (:mod:`~dcr_ray.engines.vllm.batch`).

``prefix_cache`` says what the last update did: ``"reset"`` (nothing held a block), ``"recomputed"`` or
``"kept"``.

What the proxy cannot do is read the served weights back (it sees only vLLM's public calls): its
``read_back()`` is None, so the engine actor's ``tensors()`` says so; check an adopted engine by its
outputs and ``get_weight_version()``.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Mapping, Sequence, get_args

from dcr_ray.codec import DecodedFrame
from dcr_ray.engines.base import WireBackend
from dcr_ray.engines.vllm.checkpoint import checkpoint_specs
from dcr_ray.engines.vllm.sync import WeightSyncCalls, check_urls, make_calls
from dcr_ray.errors import BackendError, ConfigError

log = logging.getLogger(__name__)

#: What the proxy does with the KV of requests a framework holds across an update (module doc).
HeldRequests = Literal["recompute", "keep"]


class OutOfStepError(BackendError):
    """A worker's reply answered another request: vLLM's ``collective_rpc`` on this engine is out of step
    (a worker raised inside a tensor-parallel call), so no later answer can be trusted; restart it."""


class WeightSyncBackend(WireBackend):
    """The proxy's backend: forwards validated wire frames through vLLM's weight-transfer calls.

    ``calls`` is how the calls reach the engine (:mod:`~dcr_ray.engines.vllm.sync`: Ray actor handles or
    server URLs); this class holds the refit logic for both. Every call is followed by a read of every
    worker's status (:meth:`_checked`), so each worker's reason is known whether or not the call raised.
    """

    #: what the engine is called in messages (followed by where it is)
    engine_kind = "adopted vLLM engine"

    def __init__(self, calls: WeightSyncCalls | Sequence[Any], checkpoint: str, *, version: int = 0,
                 key: bytes | None = None, capture: bool | None = None, timeout_s: float = 300.0,
                 init_extra: Mapping[str, Any] | None = None, held_requests: HeldRequests = "recompute"):
        _check_held(held_requests)
        self.held_requests = held_requests
        self.prefix_cache: str | None = None  #: what the last update did to the old version's KV (module doc)
        if not hasattr(calls, "update_weights") or isinstance(calls, (list, tuple)):
            calls = make_calls(list(calls), timeout_s)  # Ray actor handles (the older signature) or URLs
        self.calls: WeightSyncCalls = calls
        self.timeout_s = timeout_s
        self._specs = checkpoint_specs(checkpoint)
        self.version = version
        self._open: tuple[int, int] | None = None
        self._nonce = 0
        self._seen: dict[tuple[int, int], int] = {}  # (replica, rank) -> the last call number it reported
        self._session_open = False  # some worker reported vLLM's update session open (set by _statuses)
        self._statuses(None)  # where each worker's call count stands before this proxy's first call
        self._checked("init", self.calls.init_weight_transfer_engine, {
            "checkpoint": checkpoint, "version": version, "key": key.hex() if key else None, "capture": capture,
            **(init_extra or {})})

    @property
    def _engine(self) -> str:
        return f"{self.engine_kind} at {self.calls.where}"

    # -- the status protocol ---------------------------------------------------------------------------
    def _statuses(self, op: str | None) -> list[str]:
        """Every worker's status after call ``op``; returns the refusals (``[]``: every worker said yes;
        ``op=None``: only records where each worker's call count stands). A reply that does not echo
        this request's nonce is :class:`OutOfStepError` at once (the engine's replies are out of step);
        a status whose call count did not move past the last one seen, or that names another call, is a
        refusal (``op`` never reached the dcr engine: vLLM refused it first), so an old outcome is never
        taken for this call's."""
        self._nonce += 1
        nonce = f"{id(self):x}-{self._nonce}"
        replies = self.calls.transfer_status(nonce)
        refused = []
        for i, ranks in enumerate(replies):
            if not isinstance(ranks, list) or not ranks:
                raise BackendError(f"{self._engine}: replica {i} answered "
                                   f"dcr_transfer_status with {str(ranks)[:200]}")
            for j, st in enumerate(ranks):
                if not isinstance(st, dict) or st.get("nonce") != nonce:
                    raise OutOfStepError(
                        f"{self._engine}: replica {i} rank {j} answered with another "
                        f"call's reply ({str(st)[:200]}): its workers' replies are out of step (a worker raised "
                        f"inside a tensor-parallel collective_rpc); restart the engine")
                where = (i, int(st.get("rank") if st.get("rank") is not None else j))
                seq = int(st.get("seq", -1))
                if op is not None:
                    if seq <= self._seen.get(where, 0) or st.get("op") != op:
                        refused.append(f"replica {i} rank {where[1]}: {op} did not reach the dcr engine "
                                       f"(its last call is {st.get('op')} #{seq})")
                    elif not st.get("ok"):
                        refused.append(f"replica {i} rank {where[1]}: {st.get('error')}")
                self._seen[where] = max(seq, self._seen.get(where, 0))
                if st.get("session"):
                    self._session_open = True
        return refused

    def _checked(self, op: str, call, *args) -> None:
        """``call(*args)`` (vLLM's call ``op``), then every worker's status. If the call raised or any
        worker says no: vLLM's update session is closed (``finish_weight_update`` without a version, so
        the version label does not move) and :class:`BackendError` names every worker's reason."""
        raised = None
        try:
            call(*args)
        except BackendError as e:
            raised = e
        self._session_open = False
        try:
            refused = self._statuses(op)
        except OutOfStepError as e:
            if raised is None:
                raise
            raise OutOfStepError(f"{e} (after {op} failed: {raised})") from raised
        if raised is None and not refused:
            return
        if self._session_open and op != "init":
            try:
                self.calls.finish_weight_update()
                self._statuses("finish")
            except BackendError as e:
                log.warning("%s: closing the refused update failed: %s", self._engine, e)
        why = "; ".join(refused) or str(raised)
        raise BackendError(f"{self._engine}: {op} refused: {why}") from raised

    # -- contract ----------------------------------------------------------------------------------
    def tensor_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return dict(self._specs)

    def apply_wire(self, data: bytes, frame: DecodedFrame) -> None:
        """Forward one validated frame to every replica of this engine."""
        self.send_frames([data], frame.meta.base, frame.meta.target)

    def send_frames(self, frames: list[bytes], base: int, target: int) -> None:
        """Forward frames of the update ``base -> target`` to every replica in one ``update_weights`` call
        (the first call of an update opens it with ``start_weight_update``); :class:`BackendError` if any
        worker refuses (vLLM's session is then closed, and the next call opens another)."""
        update = (base, target)
        if self._open is None:
            self._checked("start", self.calls.start_weight_update)
            self._open = update
        elif self._open != update:
            raise BackendError(f"frame for {update[0]}->{update[1]} inside the open update "
                               f"{self._open[0]}->{self._open[1]}")
        try:
            self._checked("update", self.calls.update_weights, {"base": update[0], "target": update[1],
                                                                "frames": list(frames)})
        except BackendError:
            self._open = None  # vLLM's update session is closed; the next frame (a retry) opens another
            raise

    def flush(self) -> None:
        """Reload what the frames touched, then tag outputs with the new version (only once every worker
        said yes); drop KV of old weights."""
        if self._open is None:
            return
        target = self._open[1]
        self._open = None
        self._checked("finish", self.calls.finish_weight_update)
        self.version = target  # every worker said yes: they serve target from here on
        self.calls.update_weight_version(str(target))
        self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        """Drop the KV of the old version (module doc, "Requests held across an update")."""
        if self.calls.reset_prefix_cache():
            self.prefix_cache = "reset"
            return
        if self.held_requests == "keep":
            self.prefix_cache = "kept"
            log.info("%s: requests hold KV blocks across the update; they keep them, and so does the prefix "
                     "cache (held_requests='keep')", self._engine)
            return
        if not self.calls.reset_prefix_cache(reset_running_requests=True):
            raise BackendError(f"{self._engine} refused to reset its prefix cache even with its running requests "
                               f"preempted (a KV transfer of a request still in flight?): the weights are the new "
                               f"version's, and a new request may reuse an older prefix until it is reset")
        self.prefix_cache = "recomputed"

    def abandon(self) -> None:
        """Close an update whose refit was abandoned without reloading anything (the engine keeps serving
        what it served; the workers' mirrors get back the bits the update's frames replaced)."""
        if self._open is None:
            return
        base, target = self._open
        self._open = None
        self._checked("update", self.calls.update_weights, {"base": base, "target": target, "abandon": True})
        self._checked("finish", self.calls.finish_weight_update)

    def matches_digests(self, version: int, digests: Mapping[tuple, str]) -> bool:
        """Whether every worker of the engine holds the boxes digested in ``digests`` (the owners' committed
        ``version``); if so its outputs are tagged with ``version`` and no dense bootstrap is needed.

        The workers digest what they serve (:meth:`~dcr_ray.engines.vllm.worker.receiver.MirrorReceiver.verify`)
        inside one ``update_weights`` call that writes nothing; a mismatch, or a worker that cannot prove
        its bits (a mirror whose version is unknown, a tensor-parallel shard on the capture path), is a
        refusal in that worker's status and this returns False (the session closed, nothing moved).
        """
        if self._open is not None:
            return False
        boxes = [[name, list(start), list(stop), d] for (name, start, stop), d in digests.items()]
        try:
            self._checked("start", self.calls.start_weight_update)
            self._checked("update", self.calls.update_weights, {"base": version, "target": version, "verify": boxes})
        except OutOfStepError:
            raise
        except BackendError as e:
            log.info("%s does not hold version %d: %s", self._engine, version, e)
            return False
        self._checked("finish", self.calls.finish_weight_update)
        self.calls.update_weight_version(str(version))
        self._reset_prefix_cache()
        self.version = version
        return True

    def activate(self, version: int) -> None:
        self.version = version


class AdoptedVllmEngine:
    """Engine factory for one adopted vLLM engine (give it to ``ClusterSpec(adopt=[...])``).

    ``handles``: what reaches the engine, either

    - the Ray actor handle of an ``LLM`` / ``AsyncLLM`` actor (or of any actor exposing vLLM's
      weight-transfer methods and ``reset_prefix_cache``), or a list of handles that are data parallel
      replicas of one engine; or
    - the base URL of an OpenAI-compatible ``vllm serve`` process (``"http://host:8000"``), or a list of
      URLs of replicas, started with ``VLLM_SERVER_DEV_MODE=1`` and
      ``--weight-transfer-config '{"backend": "dcr"}'`` (see :class:`AdoptedVllmServer`).

    ``checkpoint``: the directory it was started from, holding ``version`` (readable by the proxy and by
    the engine's workers). ``capture``: see :class:`~dcr_ray.engines.vllm.worker.transfer.DcrInitInfo` (default:
    on CUDA). ``timeout_s``: bound on each weight-transfer call. ``held_requests``: what happens to the KV
    of requests the framework holds across an update in vLLM's keep mode, ``"recompute"`` or ``"keep"``
    (see :mod:`~dcr_ray.engines.vllm.adopted`).

    When the engine joins, its workers digest the tensors they serve; if every tensor equals the owners'
    committed version it joins as it is, else it is refit densely (see :meth:`WeightSyncBackend.matches_digests`).
    """

    def __init__(self, handles: Any, *, checkpoint: str, version: int = 0, key: bytes | None = None,
                 capture: bool | None = None, timeout_s: float = 300.0, held_requests: HeldRequests = "recompute"):
        _check_held(held_requests)
        targets = list(handles) if isinstance(handles, (list, tuple)) else [handles]
        urls = [t for t in targets if isinstance(t, str)]
        if urls:
            if len(urls) != len(targets):
                raise ConfigError("AdoptedVllmEngine takes Ray actor handles or server URLs for one engine, "
                                  "not both")
            targets = check_urls(urls)
        elif not targets or not all(hasattr(h, "update_weights") for h in targets):
            raise ConfigError("AdoptedVllmEngine needs Ray actor handles exposing vLLM's weight-transfer methods "
                              "(init_weight_transfer_engine, start_weight_update, update_weights, "
                              "finish_weight_update), or vLLM server URLs ('http://host:port')")
        if not isinstance(checkpoint, str) or not checkpoint:
            raise ConfigError("AdoptedVllmEngine needs checkpoint=<the directory the engine was started from>")
        if timeout_s <= 0:
            raise ConfigError(f"AdoptedVllmEngine.timeout_s must be > 0, got {timeout_s}")
        self.handles = targets
        self.checkpoint = checkpoint
        self.version = version
        self.key = key
        self.capture = capture
        self.timeout_s = timeout_s
        self.held_requests = held_requests

    @property
    def urls(self) -> list[str]:
        """The server URLs, when this engine is adopted over HTTP (else empty)."""
        return [t for t in self.handles if isinstance(t, str)]

    def __call__(self) -> WeightSyncBackend:
        return WeightSyncBackend(make_calls(self.handles, self.timeout_s), self.checkpoint, version=self.version,
                                 key=self.key, capture=self.capture, timeout_s=self.timeout_s,
                                 held_requests=self.held_requests)


class AdoptedVllmServer(AdoptedVllmEngine):
    """Engine factory for an OpenAI-compatible vLLM server dcr_ray did not start, adopted by its URL.

    ::

        VLLM_SERVER_DEV_MODE=1 vllm serve /ckpt --weight-transfer-config '{"backend": "dcr"}'
        ClusterSpec(name="users", adopt=[AdoptedVllmServer("http://host:8000", checkpoint="/ckpt")])

    ``url``: the server's base URL, or a list of URLs of data-parallel replicas of one engine. The proxy
    drives the server's weight-transfer routes with vLLM's ``HTTPVLLMWeightSyncClient`` (frames as
    base64 in the JSON body); ``/reset_prefix_cache`` and ``/weight_info`` as well, so the server
    needs ``VLLM_SERVER_DEV_MODE=1`` (vLLM registers those routes only then). The proxy and the
    server's workers both read ``checkpoint``. Other arguments: see :class:`AdoptedVllmEngine`.
    """

    def __init__(self, url: str | Sequence[str], *, checkpoint: str, version: int = 0, key: bytes | None = None,
                 capture: bool | None = None, timeout_s: float = 300.0, held_requests: HeldRequests = "recompute"):
        urls = [url] if isinstance(url, str) else list(url)
        super().__init__(check_urls(urls), checkpoint=checkpoint, version=version, key=key, capture=capture,
                         timeout_s=timeout_s, held_requests=held_requests)


def _check_held(held_requests) -> None:
    if held_requests not in get_args(HeldRequests):
        raise ConfigError(f"held_requests must be one of {get_args(HeldRequests)} (what happens to the KV of requests "
                          f"a framework holds across an update in vLLM's keep mode), got {held_requests!r}")
