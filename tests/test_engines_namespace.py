"""Every engine factory comes from one namespace, ``dcr_ray.engines``, without importing vLLM early."""

from __future__ import annotations

import subprocess
import sys


def test_hf_and_vllm_engine_factories_come_from_dcr_ray_engines_and_vllm_loads_only_when_asked_for():
    code = ("import sys, dcr_ray, dcr_ray.engines as e\n"
            "assert dcr_ray.HFEngine is e.HFEngine\n"
            "assert 'vllm' not in sys.modules\n"
            "from dcr_ray.engines import VllmEngine\n"
            "from dcr_ray.engines.vllm import VllmEngine as direct\n"
            "assert VllmEngine is direct\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
