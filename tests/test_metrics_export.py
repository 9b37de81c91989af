"""Every metric in ``dcr_ray.metrics`` reaches Ray's Prometheus endpoint, tagged by cluster and engine.

A real Ray instance exports metrics on a port this test picks (reported every second instead of every
ten); a real refit with one injected apply failure (so a payload is rejected and the attempt retried)
records all of them, and the test scrapes the endpoint over HTTP until it finds each name.
"""

from __future__ import annotations

import raytools  # noqa: F401  (loopback environment before ray is imported)

import re
import socket
import time
import urllib.request

import pytest
import ray

import dcr_ray
from dcr_ray import metrics
from dcr_ray.testing.faults import FlakyEngine
from dcr_ray.testing.models import ModelSpec
from dcr_ray.testing.trainer import TinyTrainer

pytestmark = pytest.mark.slow
SPEC = ModelSpec(size="tiny", seed=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_with_metrics():
    if ray.is_initialized():
        ray.shutdown()
    port = _free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             _metrics_export_port=port, _system_config={"metrics_report_interval_ms": 1000})
    yield f"http://127.0.0.1:{port}/metrics"
    ray.shutdown()


def _scrape_until(url: str, names: tuple[str, ...], timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        try:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            text = ""
        if all(f"ray_{n}" in text for n in names):
            return text
        time.sleep(1)
    missing = [n for n in names if f"ray_{n}" not in text]
    raise AssertionError(f"not exported within {timeout_s} s: {missing}")


def test_a_refit_exports_every_dcr_metric_with_cluster_and_engine_tags(ray_with_metrics):
    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainer = Trainer.remote(SPEC, lr=1e-3)
    refit = dcr_ray.launch(owners=[trainer], clusters=[dcr_ray.ClusterSpec(name="a", engines=2)],
                           engine=FlakyEngine(dcr_ray.HFEngine(SPEC), fail_after=0))
    try:
        ray.get(trainer.step.remote(seed=0))
        report = refit.run()
        assert report.version == 1 and report.retries >= 1  # the injected failure was rejected, then retried
        ray.kill(refit.engines()["a/e1"])  # it heals in the background: the healing metrics are exported too
        ray.get(trainer.step.remote(seed=1))
        refit.run()
        refit.wait_healed(timeout=120)
        text = _scrape_until(ray_with_metrics, metrics.NAMES)
        for engine in ("a/e0", "a/e1"):  # a/e1's dead actor keeps its last series beside the new one's
            pattern = rf'(ray_dcr_engine_version\{{[^}}]*engine="{engine}"[^}}]*\}}) (\S+)'
            for _ in range(30):  # the re-created actor's first report may lag a scrape
                if any('cluster="a"' in ln and float(v) == 2.0 for ln, v in re.findall(pattern, text)):
                    break
                time.sleep(1)
                text = _scrape_until(ray_with_metrics, metrics.NAMES)
            else:
                raise AssertionError(f"{engine} exports no version 2: {re.findall(pattern, text)}")
        assert re.search(r'ray_dcr_relay_bytes_in_bytes\w*\{[^}]*cluster="a"[^}]*relay="a/head"', text)
        assert re.search(r'ray_dcr_coordinator_link_bytes\w*\{[^}]*cluster="a"', text)
        assert re.search(r'ray_dcr_owner_wire_bytes\w*\{[^}]*owner="owner0"', text)
    finally:
        refit.shutdown()
