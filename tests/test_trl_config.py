"""The TRL transfer's settings refuse bad values with the fix, before any call reaches a server (fast, no server).

The end-to-end run against TRL's ``AsyncGRPOTrainer`` and a real ``vllm serve`` is ``tests/test_trl_async_grpo.py``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from dcr_ray.config import CodecConfig
from dcr_ray.errors import ConfigError
from dcr_ray.integrations.trl import TrlDcrConfig


def test_the_config_takes_trls_defaults_and_one_or_several_server_urls():
    c = TrlDcrConfig(checkpoint="/ckpt/policy-v0")
    assert c.urls == ["http://localhost:8000"] and c.version == 0 and c.timeout_s == 1800.0
    assert TrlDcrConfig(checkpoint="/c", server_url=["http://a:8000", "http://b:8000"]).urls == ["http://a:8000",
                                                                                                 "http://b:8000"]


@pytest.mark.parametrize("kwargs, says", [
    ({"checkpoint": ""}, "local directory the vLLM server was started from"),
    ({"checkpoint": "/c", "server_url": "localhost:8000"}, "vllm_server_base_url"),
    ({"checkpoint": "/c", "server_url": []}, "no server URL given"),
    ({"checkpoint": "/c", "version": -1}, "integer >= 0"),
    ({"checkpoint": "/c", "version": True}, "integer >= 0"),
    ({"checkpoint": "/c", "codec": {"coding": "plain"}}, "dcr_ray.CodecConfig"),
    ({"checkpoint": "/c", "call_bytes": 0}, "positive integer"),
    ({"checkpoint": "/c", "timeout_s": 0}, "seconds > 0"),
    ({"checkpoint": "/c", "server_timeout_s": "60"}, "seconds > 0"),
])
def test_bad_settings_are_refused_with_what_to_fix(kwargs, says):
    with pytest.raises(ConfigError, match=says):
        TrlDcrConfig(**kwargs)


def test_the_transfer_takes_a_config_or_its_fields_but_not_both():
    pytest.importorskip("vllm")
    from dcr_ray.integrations.trl import DcrWeightTransfer

    t = DcrWeightTransfer(checkpoint="/c", server_url="http://127.0.0.1:9", codec=CodecConfig(coding="plain"))
    assert t.config.urls == ["http://127.0.0.1:9"] and t.version is None
    with pytest.raises(ConfigError, match="not both"):
        DcrWeightTransfer(TrlDcrConfig(checkpoint="/c"), version=1)
    with pytest.raises(ConfigError, match="takes a TrlDcrConfig"):
        DcrWeightTransfer({"checkpoint": "/c"})
    with pytest.raises(ConfigError, match="before init_weight_transfer"):
        t.send_weights(iter([]))


def test_importing_the_trl_package_imports_neither_trl_nor_vllm():
    code = ("import sys, dcr_ray.integrations.trl; "
            "assert 'trl' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)[:5]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
