"""Object-storage transport against a real S3-compatible server (moto's server mode) on loopback."""

from __future__ import annotations

from raytools import local_ray  # noqa: F401  (local_ray: module-scoped Ray fixture)

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

import dcr_ray
from dcr_ray.testing.models import ModelSpec
from dcr_ray.testing.trainer import TinyTrainer

pytestmark = pytest.mark.slow
pytest.importorskip("s3fs", reason="s3fs is needed for s3:// storage (pip install dcr_ray[s3])")
pytest.importorskip("moto", reason="moto[server] provides the S3-compatible test server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
    port = _free_port()
    exe = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("moto_server did not start")
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def test_refits_through_an_s3_compatible_store_are_bit_exact_keep_only_committed_payloads_and_leave_none_at_shutdown(
        s3_server, local_ray):
    import s3fs

    opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3_server,
                                                                      "region_name": "us-east-1"}}
    import boto3

    boto3.client("s3", endpoint_url=s3_server, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket="dcr-test")
    fs = s3fs.S3FileSystem(**opts)
    spec = ModelSpec(size="tiny")
    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainers = [Trainer.remote(spec, lr=1e-4, rank=r, world=2) for r in range(2)]
    cfg = dcr_ray.RefitConfig(
        transport=dcr_ray.TransportConfig(kind="object_store", storage_url="s3://dcr-test/refits",
                                          storage_options=opts),
        codec=dcr_ray.CodecConfig(key=b"shared-secret"))
    refit = dcr_ray.launch(owners=trainers, clusters=[dcr_ray.ClusterSpec(name="remote", engines=2)],
                           engine=dcr_ray.HFEngine(spec.with_seed(3)), config=cfg)
    committed = []
    for step in range(2):
        ray.get([t.step.remote(seed=step) for t in trainers])
        report = refit.run()
        assert report.version == step + 1 and report.changed > 0
        committed.append(f"dcr-test/refits/{report.transfer}/a{report.attempts - 1}/")
    want = ray.get(trainers[0].rollout_state.remote())
    for eng in refit.engines().values():
        got = ray.get(eng.tensors.remote())
        for n in want:
            assert torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)), n
    fs.invalidate_cache()
    kept = fs.find("dcr-test/refits")  # the committed attempts stay for catch-up, nothing else
    assert kept and all(any(p.startswith(c) for c in committed) for p in kept), kept
    refit.shutdown()
    fs.invalidate_cache()
    assert fs.find("dcr-test/refits") == []  # and none after shutdown

