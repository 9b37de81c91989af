"""How the adopted-engine proxy reaches a vLLM engine: the weight-transfer calls, over Ray or over HTTP.

:class:`~dcr_ray.engines.vllm.adopted.WeightSyncBackend` holds the refit logic once; what differs
between an ``LLM`` / ``AsyncLLM`` Ray actor and an OpenAI-compatible ``vllm serve`` process is only how
each call travels, so that is all this module holds (:class:`WeightSyncCalls`):

:class:`RayWeightSync`
    Ray actor handles (all data-parallel replicas of one engine); frames go as ``bytes``.
:class:`LocalWeightSync`
    A ``vllm.LLM`` in this process (the engines dcr_ray starts, :class:`~dcr_ray.engines.vllm.VllmBackend`).
:class:`HttpWeightSync`
    Server base URLs. The weight-transfer calls go through vLLM's own
    :class:`~vllm.distributed.weight_transfer.clients.HTTPVLLMWeightSyncClient`; frames go as base64
    (``frames_b64``) in the JSON body. vLLM registers these routes (and ``/reset_prefix_cache``,
    ``/weight_info``) only when the server runs with ``VLLM_SERVER_DEV_MODE=1``.

Every call fans out to every replica and waits for all; a failure raises
:class:`~dcr_ray.errors.BackendError` carrying the engine's own message. With tensor parallelism the
``dcr`` backend's workers agree on a refusal and only the last rank raises it (vLLM's ``collective_rpc``
stays in step), and :meth:`WeightSyncCalls.transfer_status` reads every worker's outcome
(``collective_rpc("dcr_transfer_status")``; over HTTP the dev-mode route ``/collective_rpc``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, Sequence

from dcr_ray.engines.vllm.plugin import frames_as_base64
from dcr_ray.errors import BackendError, ConfigError

#: What an HTTP 404 from a weight-transfer route means.
DEV_MODE_HINT = ("vLLM serves its weight-transfer routes (/init_weight_transfer_engine, /update_weights, "
                 "/weight_info, /reset_prefix_cache, ...) only in dev mode: start the server with "
                 "VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{\"backend\": \"dcr\"}'")


class WeightSyncCalls(Protocol):
    """vLLM's weight-transfer calls on one adopted engine (every replica of it)."""

    where: str
    """Where the engine is, for messages."""

    def init_weight_transfer_engine(self, init_info: dict) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict) -> None:
        """``update_info`` may carry ``frames`` as ``bytes``; a transport that cannot send bytes encodes them."""

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    def update_weight_version(self, weight_version: str) -> None:
        """Tag every replica's outputs with ``weight_version`` (no weight is touched)."""

    def transfer_status(self, nonce: str) -> list:
        """Per replica, every worker's ``dcr_transfer_status(nonce)`` (a list of dicts, one per rank; see
        :func:`~dcr_ray.engines.vllm.plugin.dcr_transfer_status`)."""

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """True when every replica dropped its prefix cache (vLLM refuses while requests hold blocks:
        running, or paused in keep mode). ``reset_running_requests``: preempt those requests first (their KV
        is dropped and recomputed when they are scheduled again)."""

    def get_weight_version(self) -> list[str]:
        """The weight version each replica tags its outputs with."""


class _EngineMethodCalls:
    """The weight-transfer calls of an object that has vLLM's engine methods (``LLM``, ``AsyncLLM`` or an
    actor exposing them): each is one ``_call(method, *args)``, which the subclass carries."""

    def _call(self, method: str, *args) -> Any:
        raise NotImplementedError

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._call("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None:  # the engine's default (an actor wrapper may not take the keyword)
            self._call("finish_weight_update")
        else:
            self._call("finish_weight_update", weight_version)

    def update_weight_version(self, weight_version: str) -> None:
        self._call("update_weight_version", weight_version)


class RayWeightSync(_EngineMethodCalls):
    """The calls on Ray actor handles of ``LLM`` / ``AsyncLLM`` (or any actor exposing the same methods)."""

    def __init__(self, handles: Sequence[Any], timeout_s: float = 300.0):
        import ray

        self._ray = ray
        self.handles = list(handles)
        self.timeout_s = timeout_s
        self.where = f"{len(self.handles)} Ray actor(s)"

    def _call(self, method: str, *args) -> list:
        try:
            return self._ray.get([getattr(h, method).remote(*args) for h in self.handles], timeout=self.timeout_s)
        except self._ray.exceptions.RayTaskError as e:
            raise BackendError(f"adopted vLLM engine: {method} failed: {e.as_instanceof_cause()!r}") from e

    def transfer_status(self, nonce: str) -> list:
        missing = [h for h in self.handles if not hasattr(h, "collective_rpc")]
        if missing:
            raise BackendError("an adopted vLLM Ray actor must expose vLLM's collective_rpc(method, timeout=None, "
                               "args=(), kwargs=None) (LLM and AsyncLLM do; a wrapper actor forwards it to the "
                               f"engine inside); {len(missing)} of {len(self.handles)} handle(s) do not")
        try:
            return self._ray.get([h.collective_rpc.remote("dcr_transfer_status", args=(nonce,))
                                  for h in self.handles], timeout=self.timeout_s)
        except self._ray.exceptions.RayTaskError as e:
            raise BackendError(f"adopted vLLM engine: collective_rpc('dcr_transfer_status') failed: "
                               f"{e.as_instanceof_cause()!r}") from e

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return all(self._call("reset_prefix_cache", *([True] if reset_running_requests else [])))

    def get_weight_version(self) -> list[str]:
        return self._call("get_weight_version")


class LocalWeightSync(_EngineMethodCalls):
    """The calls on a ``vllm.LLM`` of this process (one replica); a failure is a :class:`BackendError`
    carrying the engine's own message."""

    def __init__(self, llm: Any, where: str):
        self.llm = llm
        self.where = where

    def _call(self, method: str, *args) -> Any:
        try:
            return getattr(self.llm, method)(*args)
        except Exception as e:
            raise BackendError(f"vLLM engine at {self.where}: {method} failed: {e!r}") from e

    def transfer_status(self, nonce: str) -> list:
        return [self._call("collective_rpc", "dcr_transfer_status", None, (nonce,))]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return bool(self._call("reset_prefix_cache", *([True] if reset_running_requests else [])))

    def get_weight_version(self) -> list[str]:
        return [self._call("get_weight_version")]


def check_urls(urls: Sequence[str]) -> list[str]:
    """Server base URLs, without trailing slashes; :class:`ConfigError` for anything that is not http(s)."""
    out = []
    for u in urls:
        if not isinstance(u, str) or not u.startswith(("http://", "https://")):
            raise ConfigError(f"a vLLM server is adopted by its base URL, e.g. 'http://host:8000'; got {u!r}")
        out.append(u.rstrip("/"))
    if not out:
        raise ConfigError("no server URL given")
    return out


class HttpWeightSync:
    """The calls on OpenAI-compatible vLLM servers (``vllm serve``), one base URL per replica."""

    def __init__(self, urls: Sequence[str], timeout_s: float = 300.0):
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self.urls = check_urls(urls)
        self.timeout_s = timeout_s
        self.clients = [HTTPVLLMWeightSyncClient(u, timeout=timeout_s) for u in self.urls]
        self.where = ", ".join(self.urls)
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(8, len(self.urls))))

    def _each(self, what: str, fn) -> list:
        """``fn(i)`` for every replica ``i`` (in parallel); HTTP and connection errors as BackendError."""
        import requests

        def run(i):
            try:
                return fn(i)
            except requests.HTTPError as e:
                resp = e.response
                code = resp.status_code if resp is not None else "?"
                if code == 404:
                    raise BackendError(f"vLLM server {self.urls[i]}: {what} is not served (HTTP 404). "
                                       f"{DEV_MODE_HINT}") from None
                body = _error_message(resp)
                raise BackendError(f"vLLM server {self.urls[i]}: {what} failed (HTTP {code}): {body}") from None
            except requests.RequestException as e:
                raise BackendError(f"vLLM server {self.urls[i]}: {what} failed: {e!r}") from None

        return list(self._pool.map(run, range(len(self.urls))))

    def _request(self, i: int, method: str, path: str, **kw):
        import requests

        r = requests.request(method, f"{self.urls[i]}/{path}", timeout=self.timeout_s, **kw)
        r.raise_for_status()
        return r.json()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._each("init_weight_transfer_engine", lambda i: self.clients[i].init_weight_transfer_engine(init_info))

    def start_weight_update(self) -> None:
        self._each("start_weight_update", lambda i: self.clients[i].start_weight_update())

    def update_weights(self, update_info: dict) -> None:
        info = frames_as_base64(dict(update_info))  # JSON carries no bytes: the backend reads frames_b64
        self._each("update_weights", lambda i: self.clients[i].update_weights(info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each("finish_weight_update", lambda i: self.clients[i].finish_weight_update(weight_version))

    def update_weight_version(self, weight_version: str) -> None:
        self._each("update_weight_version", lambda i: self._request(i, "POST", "update_weight_version",
                                                                    json={"new_version": weight_version}))

    def transfer_status(self, nonce: str) -> list:
        body = {"method": "dcr_transfer_status", "args": [nonce]}
        return [r.get("results") if isinstance(r, dict) else r
                for r in self._each("collective_rpc", lambda i: self._request(i, "POST", "collective_rpc", json=body))]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        params = {"reset_running_requests": "true"} if reset_running_requests else None
        return all(bool(r.get("success", True)) if isinstance(r, dict) else True
                   for r in self._each("reset_prefix_cache",
                                       lambda i: self._request(i, "POST", "reset_prefix_cache", params=params)))

    def get_weight_version(self) -> list[str]:
        return [r["weight_version"] for r in self._each("weight_info",
                                                         lambda i: self._request(i, "GET", "weight_info"))]


def _error_message(resp) -> str:
    """The message in a vLLM error response (``{"error": {"message": ...}}``), else the body's start."""
    if resp is None:
        return "no response"
    try:
        err = resp.json().get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if err is not None:
            return str(err)
    except ValueError:
        pass
    return resp.text[:500]


def make_calls(targets: Sequence[Any], timeout_s: float = 300.0) -> WeightSyncCalls:
    """:class:`HttpWeightSync` for URL strings, :class:`RayWeightSync` for actor handles (never mixed)."""
    urls = [t for t in targets if isinstance(t, str)]
    if urls and len(urls) != len(targets):
        raise ConfigError("one adopted engine is either Ray actor handles or server URLs, not both")
    return HttpWeightSync(urls, timeout_s) if urls else RayWeightSync(targets, timeout_s)


__all__ = ["DEV_MODE_HINT", "HttpWeightSync", "LocalWeightSync", "RayWeightSync", "WeightSyncCalls", "check_urls",
           "make_calls"]
