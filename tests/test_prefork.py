"""dcr_ray.prefork: Ray workers forked from a server that imported torch and transformers once.

Real Ray, a real server process and real forks. The module starts a server of its own (not the one conftest
starts for the whole run) and its actors name it, so that what a test checks is this server's doing; they
run in one local Ray started for the module, emptied after each test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import ray

import dcr_ray.prefork
from dcr_ray.errors import ConfigError
from dcr_ray.prefork.server import CLIENT_PID_ENV, differs

from raytools import fresh_local_ray, init_local_ray, sweep_actors  # noqa: F401  (fresh_local_ray: a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dcr_ray.prefork.available(), reason="dcr_ray.prefork needs Linux")]


@ray.remote(num_cpus=0)
class Probe:
    def __init__(self):
        self.preloaded = "transformers.modeling_utils" in sys.modules  # before any import here

    def facts(self) -> dict:
        import gc

        import torch

        return {"pid": os.getpid(), "ppid": os.getppid(), "preloaded": self.preloaded,
                "frozen": gc.get_freeze_count(), "collects": gc.isenabled(),
                "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
                "job": os.environ.get("RAY_JOB_ID"), "cwd": os.getcwd(),
                "client": int(os.environ.get(CLIENT_PID_ENV, "0"))}


@pytest.fixture(scope="module")
def server():
    s = dcr_ray.prefork.start(wait=True)
    yield s
    s.stop()


@pytest.fixture
def ray_on(server, fresh_local_ray):
    """A local Ray started for this module after ``server`` (so its workers' environment is the server's,
    whatever the test process imported before), emptied after each test; this module's actors name
    ``server``'s runtime env (a ``py_executable`` of their own, so the suite's hook steps aside for them)."""
    yield server
    sweep_actors()


def _runtime_env(server) -> dict:
    return {"runtime_env": server.runtime_env()}


def test_an_actor_forked_from_the_server_starts_with_its_modules_imported_and_its_own_thread_count(ray_on):
    a = Probe.options(**_runtime_env(ray_on)).remote()
    f = ray.get(a.facts.remote(), timeout=120)
    assert f["preloaded"], f
    assert f["ppid"] == ray_on.process.pid  # a child of the server, registered under its own pid
    # the server's imports are frozen (the child's collections leave their pages shared), and the child
    # collects its own garbage again (the server imports with collection off)
    assert f["frozen"] > 100_000 and f["collects"], f
    assert f["omp"] == "1" and f["threads"] == 1, f  # Ray's OMP_NUM_THREADS for a num_cpus=0 actor, applied
    assert f["job"] == ray.get_runtime_context().get_job_id()
    assert f["cwd"] == os.getcwd()


def test_a_killed_forked_actor_is_restarted_by_ray_and_its_stand_in_process_ends(ray_on):
    a = Probe.options(max_restarts=1, max_task_retries=-1, **_runtime_env(ray_on)).remote()
    first = ray.get(a.facts.remote(), timeout=120)
    os.kill(first["pid"], 9)
    second = ray.get(a.facts.remote(), timeout=120)
    assert second["pid"] != first["pid"] and second["preloaded"], second
    # the process Ray started for the first (the client standing in for it) ended with it
    import psutil

    deadline = time.monotonic() + 30
    while psutil.pid_exists(first["client"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(first["client"])


def test_a_forked_worker_whose_stand_in_process_dies_exits_too(ray_on):
    a = Probe.options(**_runtime_env(ray_on)).remote()
    f = ray.get(a.facts.remote(), timeout=120)
    import psutil

    assert f["client"] > 0, f  # forked (an ordinary worker has no stand-in: os.kill(0) would hit this test)
    os.kill(f["client"], 9)
    psutil.Process(f["pid"]).wait(timeout=30)  # raises TimeoutExpired if the worker outlived its client


def test_a_worker_whose_environment_differs_where_imports_read_it_starts_the_ordinary_way(ray_on):
    a = Probe.options(runtime_env={**ray_on.runtime_env(), "env_vars": {"DCR_RAY_JIT": "0"}}).remote()
    f = ray.get(a.facts.remote(), timeout=120)
    assert not f["preloaded"] and f["ppid"] != ray_on.process.pid and f["frozen"] == 0
    server_env = {"DCR_RAY_JIT": "1", "OMP_NUM_THREADS": "1", "DCR_PREFORK_SOCKET": "a"}
    assert differs(server_env, {"DCR_PREFORK_SOCKET": "b"}) == ["DCR_RAY_JIT"]  # OMP_NUM_THREADS: Ray sets it later
    assert differs(server_env, {"DCR_RAY_JIT": "1", "OMP_NUM_THREADS": "4"}) == ["OMP_NUM_THREADS"]
    # protobuf, preloaded for Ray, picks its implementation when imported
    assert differs(server_env, {**server_env, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}) == [
        "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"]


def test_thirty_refused_workers_at_once_all_start_the_ordinary_way(server):
    """The server answers a refusal and closes at once. A client that then made one more (empty) send got
    EPIPE and died before its worker registered, and Ray waited 60 s for it (6 of 20 such clients here)."""
    env = {**os.environ, "DCR_TEST_REFUSED": "1"}
    clients = [subprocess.Popen([sys.executable, "-I", "-S", dcr_ray.prefork.CLIENT, server.socket_path, "-c", "pass"],
                                env=env, stderr=subprocess.PIPE, text=True) for _ in range(30)]
    failed = [err[-500:] for err in (c.communicate(timeout=120)[1] for c in clients) if err]
    assert failed == [] and [c.returncode for c in clients] == [0] * 30


def test_with_the_server_gone_workers_start_the_ordinary_way(ray_on):
    gone = dcr_ray.prefork.runtime_env_for(os.path.join(os.path.dirname(ray_on.socket_path), "none.sock"))
    f = ray.get(Probe.options(runtime_env=gone).remote().facts.remote(), timeout=120)
    assert not f["preloaded"] and f["ppid"] != ray_on.process.pid and f["frozen"] == 0


def test_a_preload_that_imports_ray_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="imports ray; leave out every module that does"):
        dcr_ray.prefork.start(preload=("ray",), wait=True)


def test_a_job_that_connects_to_a_running_ray_gets_only_the_arguments_such_a_ray_accepts(ray_on, tmp_path):
    """A Ray that is already running refuses ``_system_config``: only a new local Ray is given it."""
    import json

    assert "_system_config" in ray_on.ray_init_kwargs(address="local")
    kwargs = ray_on.ray_init_kwargs(address=ray.get_runtime_context().gcs_address)
    assert set(kwargs) == {"address", "runtime_env"}
    script = tmp_path / "connect.py"
    script.write_text("import json, os, sys, ray\n"
                      "ray.init(**json.loads(sys.argv[1]), logging_level='ERROR', log_to_driver=False)\n"
                      "ppid = ray.get(ray.remote(num_cpus=0)(lambda: os.getppid()).remote(), timeout=120)\n"
                      "print('ppid', ppid)\n")
    proc = subprocess.run([sys.executable, str(script), json.dumps(kwargs)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"ppid {ray_on.process.pid}" in proc.stdout  # its workers are forked from the server


def test_an_actor_whose_runtime_env_installs_pip_packages_runs_them_in_their_own_python_not_forked(ray_on, tmp_path):
    """Ray's ``pip`` runtime env activates a virtualenv and runs the worker with its Python; an actor that has
    one beside the server's ``py_executable`` (its own, or inherited from its job) is refused by the server
    and started with that Python, so the packages it installed are the ones it imports. A real pip install
    of a local wheel, offline."""
    import zipfile

    wheel = tmp_path / "dcr_prefork_probe-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("dcr_prefork_probe/__init__.py", "WHERE = __file__\n")
        z.writestr("dcr_prefork_probe-0.1.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: dcr-prefork-probe\nVersion: 0.1\n")
        z.writestr("dcr_prefork_probe-0.1.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("dcr_prefork_probe-0.1.dist-info/RECORD", "")

    @ray.remote(num_cpus=0)
    def where():
        import dcr_prefork_probe

        return sys.prefix, dcr_prefork_probe.WHERE, os.getppid()

    env = {**ray_on.runtime_env(), "pip": {"packages": [str(wheel)], "pip_install_options": ["--no-index"]}}
    prefix, module, ppid = ray.get(where.options(runtime_env=env).remote(), timeout=600)
    assert module.startswith(prefix) and "runtime_resources" in prefix and ppid != ray_on.process.pid
    with open(ray_on.log_path) as f:
        assert "Ray activated another Python environment for it (VIRTUAL_ENV)" in f.read()


def test_a_ray_started_for_forked_workers_starts_no_ordinary_worker_that_none_of_its_actors_could_use(server):
    import psutil

    init_local_ray(**server.ray_init_kwargs(address="local"))
    try:
        f = ray.get(Probe.remote().facts.remote(), timeout=120)  # Ray has prestarted by now, if it does
        assert f["ppid"] == server.process.pid
        node = f"--node_id={ray.get_runtime_context().get_node_id()}"  # this driver's Ray, not one stopping
        [raylet] = [p for p in psutil.Process().children() if p.name() == "raylet" and node in p.cmdline()]
        assert [c.pid for c in raylet.children() if c.cmdline()[:1] == ["ray::IDLE"]] == []
        # and the suite's environment (PreforkServer.environ) says the same to every ray.init of its run
        assert server.environ()["RAY_prestart_worker_first_driver"] == "0"
    finally:
        ray.shutdown()
