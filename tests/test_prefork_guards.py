"""dcr_ray.prefork's guards: whom the server serves, when it refuses to fork, and how every failure before a
forked pid ends in the ordinary start.

Real servers and real clients, as Ray would run them (``python -I -S client.py SOCKET script args``), with
no Ray: what is checked is the server's answer and what the client makes of it. Most servers here preload
only ``json``, since the guards do not depend on what is preloaded. Where this machine cannot produce the
failure (no GPU, a root user whom no process limit stops, a kernel that has ``pidfd_open``), a stand-in
produces it and the test says so (:mod:`dcr_ray.testing.prefork_faults`).
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading

import pytest

import dcr_ray.prefork
from dcr_ray.prefork import guards
from dcr_ray.prefork.server import REFUSED_LINE, differs

pytestmark = pytest.mark.skipif(not dcr_ray.prefork.available(), reason="dcr_ray.prefork needs Linux with pidfd_open")

#: What a worker script prints: whether it runs in a child of the server, and which Python runs it.
WHO = "import os, sys; print(os.getppid(), sys.prefix, flush=True)\n"


def _script(tmp_path, body: str, name: str = "worker.py") -> str:
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def _client(sock: str, *argv: str, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """A client as Ray runs one: its interpreter isolated, the worker's argv after the socket."""
    return subprocess.run([sys.executable, "-I", "-S", dcr_ray.prefork.CLIENT, sock, *argv], capture_output=True,
                          text=True, env=env, timeout=timeout)


def _forked(proc: subprocess.CompletedProcess, server) -> bool:
    return proc.stdout.split()[0] == str(server.process.pid)


@pytest.fixture
def light():
    """A server that preloads only ``json``."""
    s = dcr_ray.prefork.start(preload=("json",), wait=True)
    yield s
    s.stop()


def _log(server) -> str:
    with open(server.log_path) as f:
        return f.read()


def test_the_servers_socket_is_mode_0600_from_its_creation_even_in_an_open_directory_with_an_open_umask(tmp_path):
    os.chmod(tmp_path, 0o777)
    sock = str(tmp_path / "server.sock")
    old = os.umask(0)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "dcr_ray.prefork.server", sock, "--preload", "json"],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    finally:
        os.umask(old)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    finally:
        proc.terminate()
        proc.wait(timeout=30)


#: An interpreter that another user can run (this checkout's may sit under root's home).
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


@pytest.mark.skipif(os.getuid() != 0 or SYSTEM_PYTHON is None, reason="needs root and a system python3, to run a "
                    "client as another user")
def test_a_client_of_another_user_is_never_served_and_its_worker_starts_the_ordinary_way_as_that_user(light):
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        script = os.path.join(d, "worker.py")
        with open(script, "w") as f:
            f.write(WHO)
        os.chmod(script, 0o644)

        def as_nobody():
            return subprocess.run([SYSTEM_PYTHON, "-I", "-S", dcr_ray.prefork.CLIENT, light.socket_path, script],
                                  capture_output=True, text=True, user=65534, timeout=60)

        # the socket's directory and mode keep another user out: no connection, so the ordinary start
        shut_out = as_nobody()
        assert shut_out.returncode == 0 and not _forked(shut_out, light), shut_out.stderr
        # and where they are opened to all, the server checks the client's uid itself
        os.chmod(os.path.dirname(light.socket_path), 0o755)
        os.chmod(light.socket_path, 0o777)
        checked = as_nobody()
        assert checked.returncode == 0 and not _forked(checked, light), checked.stderr
        assert f"{REFUSED_LINE}: its uid 65534 is not this server's (0)" in _log(light)
        assert _forked(_client(light.socket_path, script), light)  # its own user is served


def test_a_forked_worker_passes_on_its_exit_status_and_one_killed_by_a_signal_ends_its_client_the_same_way(light,
                                                                                                          tmp_path):
    fails = _script(tmp_path, WHO + "sys.exit(7)\n", "fails.py")
    killed = _script(tmp_path, WHO + "import signal; os.kill(os.getpid(), signal.SIGKILL)\n", "killed.py")
    done = _script(tmp_path, WHO, "done.py")
    results = {name: _client(light.socket_path, path) for name, path in
               (("fails", fails), ("killed", killed), ("done", done))}
    assert all(_forked(r, light) for r in results.values()), {k: r.stderr for k, r in results.items()}
    assert {k: r.returncode for k, r in results.items()} == {"fails": 7, "killed": -9, "done": 0}


def test_a_server_that_closes_before_it_replies_sends_the_worker_to_the_ordinary_start(tmp_path):
    """A stand-in server: it takes the request, then closes without a word (as one that dies mid-answer)."""
    sock_path = str(tmp_path / "closing.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(4)

    def close_each():
        for _ in range(2):
            conn, _ = listener.accept()
            conn.recv(1 << 16)
            conn.close()

    threading.Thread(target=close_each, daemon=True).start()
    script = _script(tmp_path, WHO + "sys.exit(3)\n")
    results = [_client(sock_path, script) for _ in range(2)]
    listener.close()
    assert [r.returncode for r in results] == [3, 3], [r.stderr[-500:] for r in results]
    assert all(r.stdout.split()[0] == str(os.getpid()) for r in results)  # run by the client itself, not forked


def test_a_fork_that_fails_sends_the_worker_to_the_ordinary_start_and_the_server_keeps_serving(tmp_path):
    """Stand-in: the server's os.fork raises EAGAIN (as a process limit would; the tests run as root)."""
    server = dcr_ray.prefork.start(preload=("json",), extra=("dcr_ray.testing.prefork_faults:fork_fails",), wait=True)
    try:
        script = _script(tmp_path, WHO + "sys.exit(5)\n")
        results = [_client(server.socket_path, script) for _ in range(2)]
        assert [r.returncode for r in results] == [5, 5] and not any(_forked(r, server) for r in results)
        assert _log(server).count(f"{REFUSED_LINE}: fork failed ([Errno 11]") == 2 and server.alive()
    finally:
        server.stop()


def test_a_kernel_without_pidfd_open_starts_workers_the_ordinary_way(light, tmp_path, monkeypatch):
    """Stand-in: os.pidfd_open raises ENOSYS, as on Linux before 5.3, in the client and in this process."""
    enosys = "import errno, os\ndef _enosys(*a):\n    raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))\n" \
             "os.pidfd_open = _enosys\n"
    wrapper = _script(tmp_path, enosys + "import runpy, sys\nsys.argv = sys.argv[1:]\n"
                                         "runpy.run_path(sys.argv[0], run_name='__main__')\n", "old_kernel.py")
    script = _script(tmp_path, WHO + "sys.exit(4)\n")
    proc = subprocess.run([sys.executable, "-I", "-S", wrapper, dcr_ray.prefork.CLIENT, light.socket_path, script],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4 and not _forked(proc, light), proc.stderr[-500:]
    assert "forked worker" not in _log(light)

    def no_pidfd(*_a):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    assert not dcr_ray.prefork.available()


@pytest.mark.slow
@pytest.mark.parametrize("preload, says", [
    ("parallel_region", "threads run in the server after its preloads"),  # real: OpenMP's pool stays
    ("cuda_initialised", "CUDA is initialised in the server"),  # stand-in: no GPU here
    ("fork_poisoned", "PyTorch refuses CUDA in every forked worker"),  # stand-in: a CPU torch
])
def test_a_server_left_unsafe_to_fork_from_by_its_preloads_refuses_every_worker_and_says_why(preload, says, tmp_path,
                                                                                             caplog):
    server = dcr_ray.prefork.start(preload=("torch",), extra=(f"dcr_ray.testing.prefork_faults:{preload}",),
                                   wait=True)
    try:
        assert says in (server.refusing or "") and says in caplog.text
        proc = _client(server.socket_path, _script(tmp_path, WHO))
        assert proc.returncode == 0 and not _forked(proc, server), proc.stderr[-500:]
        assert f"{REFUSED_LINE}: {server.refusing}" in _log(server)
    finally:
        server.stop()


def test_a_worker_is_forked_with_its_own_value_of_torchs_nvml_check_since_no_import_reads_it(light, tmp_path):
    assert differs({guards.NVML_CHECK: "1"}, {}) == [] and differs({"PYTORCH_JIT": "1"}, {}) == ["PYTORCH_JIT"]
    script = _script(tmp_path, WHO + f"print(os.environ.get({guards.NVML_CHECK!r}))\n")
    for value in ("0", None):
        env = {k: v for k, v in os.environ.items() if k != guards.NVML_CHECK}
        if value is not None:
            env[guards.NVML_CHECK] = value
        proc = _client(light.socket_path, script, env=env)
        assert _forked(proc, light) and proc.stdout.split()[-1] == str(value), proc.stderr[-500:]


def test_a_ray_whose_private_hook_changed_gets_no_forked_worker_and_the_server_says_why(tmp_path):
    assert guards.ray_hook_problem() is None  # the Ray installed here is as expected
    fake = tmp_path / "ray" / "_private"
    fake.mkdir(parents=True)
    (tmp_path / "ray" / "__init__.py").write_text("")
    (fake / "utils.py").write_text("def set_omp_num_threads_if_unset(num_cpus):\n    pass\n")
    assert "takes arguments now" in guards.ray_hook_problem(str(tmp_path / "ray"))
    (fake / "utils.py").write_text("def another():\n    pass\n")
    assert "has no set_omp_num_threads_if_unset()" in guards.ray_hook_problem(str(tmp_path / "ray"))
    # a server that finds that Ray first on its path refuses every worker (a real server and client; the
    # worker script never imports Ray)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.getcwd()}"}
    proc = subprocess.Popen([sys.executable, "-m", "dcr_ray.prefork.server", str(tmp_path / "s.sock"), "--preload",
                             "json"], stdout=subprocess.PIPE, text=True, env=env, stderr=subprocess.DEVNULL)
    try:
        line = proc.stdout.readline()
        assert line.startswith("refusing: ") and "has no set_omp_num_threads_if_unset()" in line, line
        client = _client(str(tmp_path / "s.sock"), _script(tmp_path, WHO + "sys.exit(6)\n"), env=env)
        assert client.returncode == 6 and client.stdout.split()[0] == str(os.getpid()), client.stderr[-500:]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_worker_whose_python_environment_ray_activated_starts_with_that_environments_python(light, tmp_path,
                                                                                            monkeypatch):
    """What Ray's ``pip``, ``uv`` and ``conda`` runtime envs do before they exec the worker: activate an
    environment (VIRTUAL_ENV or CONDA_PREFIX, and its bin first on PATH). A real virtualenv here."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    script = _script(tmp_path, WHO)
    env = {**os.environ, "VIRTUAL_ENV": str(venv), "PATH": f"{venv}/bin:{os.environ['PATH']}"}
    proc = _client(light.socket_path, script, env=env)
    assert proc.returncode == 0 and proc.stdout.split() == [str(os.getpid()), str(venv)], proc.stderr[-500:]
    assert "Ray activated another Python environment for it (VIRTUAL_ENV)" in _log(light)
    # a job whose own runtime env runs another Python is never given the server's executable
    monkeypatch.setenv(dcr_ray.prefork.SOCKET_ENV, light.socket_path)
    for field, value in (("pip", ["x"]), ("uv", ["x"]), ("conda", "env"), ("container", {"image": "i"}),
                         ("image_uri", "i"), ("py_executable", "python3")):
        assert dcr_ray.prefork.runtime_env_hook({field: value}) == {field: value}
    assert "py_executable" in dcr_ray.prefork.runtime_env_hook({"env_vars": {"A": "1"}})


@pytest.mark.slow
def test_each_forked_worker_draws_its_own_numpy_and_torch_numbers_as_ordinary_processes_do(tmp_path):
    server = dcr_ray.prefork.start(preload=("torch", "numpy"), wait=True)
    try:
        script = _script(tmp_path, WHO + "import numpy, torch\nprint(numpy.random.randint(1 << 30), "
                                         "torch.randint(1 << 30, (1,)).item())\n")
        forked = [_client(server.socket_path, script) for _ in range(3)]
        assert all(_forked(p, server) for p in forked), [p.stderr[-300:] for p in forked]
        # reseeded in each child from the OS (the server's state would give three equal draws of each)
        assert len({p.stdout.split()[-2] for p in forked}) == 3 and len({p.stdout.split()[-1] for p in forked}) == 3
    finally:
        server.stop()


def test_the_default_preload_is_the_librarys_own_and_a_model_adds_its_modules():
    assert not any(m.startswith("transformers.models.") for m in dcr_ray.prefork.DEFAULT_PRELOAD)
    server = dcr_ray.prefork.start(preload=("json",), extra=("csv",), wait=True)
    try:
        assert server.preload == ("json", "csv") and server.refusing is None
    finally:
        server.stop()
