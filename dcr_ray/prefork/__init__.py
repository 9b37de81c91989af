"""Ray workers that start with torch and transformers already imported: a fork server per machine.

A Ray actor is a new Python process, and one that runs torch and transformers pays about 3.4 CPU-seconds
of imports before its ``__init__`` runs: a topology pays it once per engine and trainer, and a re-created
engine cannot heal until its imports are done. :func:`start` runs a :mod:`~dcr_ray.prefork.server` that
imports those modules (and loads the codec kernels) once, and :meth:`PreforkServer.runtime_env` is the
``runtime_env`` under which Ray's workers on this machine are forked from it instead
(:mod:`~dcr_ray.prefork.client` is the executable Ray runs, through Ray's ``py_executable`` field)::

    server = dcr_ray.prefork.start(extra=("my_model.modeling",))  # returns at once; imports run beside ray.init
    ray.init(**server.ray_init_kwargs(address="local"))  # a new Ray: runtime_env and _system_config
    server.wait_ready()                          # before the first actor, or it starts the ordinary way
    ...
    ray.shutdown()
    server.stop()

It is opt-in, Linux only, and per machine: a server serves the Ray nodes on the host that runs it (a
``ray.cluster_utils.Cluster`` on one machine included). On a cluster, run
``python -m dcr_ray.prefork.server PATH`` on each node and give every job the runtime env of
:func:`runtime_env_for` ``(PATH)``. Ray identifies, kills and restarts forked workers as it does any
other (they register under their own pid), and the process Ray started exits with its worker's status.

Every doubt ends in the ordinary start: a worker starts the ordinary way where no server answers, where
the server closes or fails before it names a forked pid, where this kernel lacks ``pidfd_open``, where
its environment differs from the server's where imports read it, where Ray's runtime env activated
another Python environment for it (``pip``, ``uv``, ``conda``), and where the server found its own
process unsafe to fork from (:mod:`~dcr_ray.prefork.guards`: CUDA initialised or a thread running after
the preloads, Ray's private hook not as expected). The server serves its own user only (its socket is
mode 0600, and it checks each client's uid).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import selectors
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

from dcr_ray.errors import ConfigError

#: What every dcr_ray engine or trainer on ``transformers`` loads before it can work, whatever its model:
#: torch, ``transformers``' model and generation base (most of a model's import time), and the codec's
#: compiled kernels; then the third-party modules that every Ray worker's ``import ray`` loads (Ray requires
#: them), since Ray itself cannot be preloaded (its core library reads the worker's job id when it is
#: loaded). A model's own modules (``transformers.models.qwen2.modeling_qwen2``, say) are the caller's to
#: add: ``start(extra=...)``. ``module:function`` entries are imported, then called.
DEFAULT_PRELOAD = ("torch", "transformers.modeling_utils", "transformers.generation.utils",
                   "dcr_ray.codec.compiled.kernels:warm_up_here", "requests", "jsonschema",
                   "google.protobuf.json_format")
CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "client.py")

#: How the server's log begins its line for each worker it forked and each it refused (:meth:`PreforkServer.counts`).
FORKED_LINE, REFUSED_LINE = "forked worker", "refused a worker"


log = logging.getLogger(__name__)


def available() -> bool:
    """Whether this platform can fork workers: Linux, with a kernel that has ``pidfd_open`` (5.3 and later;
    an older one answers ``ENOSYS``) and ``SCM_RIGHTS``."""
    if sys.platform != "linux" or not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


#: Set to a server's socket path, with ``RAY_RUNTIME_ENV_HOOK`` set to :data:`HOOK`, and every
#: ``ray.init`` in this process and the processes it starts forks its workers from that server.
SOCKET_ENV = "DCR_PREFORK_SOCKET"
HOOK = "dcr_ray.prefork.runtime_env_hook"


def ray_system_config() -> dict:
    """``ray.init(_system_config=...)`` for a new Ray whose workers fork from a server (a new dict each call:
    ``ray.init`` adds to the one it is given; a Ray that is already running refuses it). Ray starts one
    ordinary worker per CPU when the first driver connects, for a job without a runtime env; a job whose
    runtime env forks its workers never uses them, and they would take CPU from the start-up."""
    return {"prestart_worker_first_driver": False}


def runtime_env_for(socket_path: str) -> dict:
    """The ``runtime_env`` whose workers are forked from the server listening at ``socket_path``."""
    client = " ".join(shlex.quote(p) for p in (sys.executable, "-I", "-S", CLIENT, socket_path))
    return {"py_executable": client}


#: ``runtime_env`` fields under which a worker runs another Python (``pip``, ``uv`` and ``conda`` activate an
#: environment of their own; a container or image brings its own) or names its own executable: a job with
#: one is never given the server's :func:`runtime_env_for`.
OWN_PYTHON_FIELDS = ("py_executable", "pip", "uv", "conda", "container", "image_uri")


def runtime_env_hook(runtime_env: dict | None) -> dict:
    """Ray's ``RAY_RUNTIME_ENV_HOOK``: the job's ``runtime_env``, forking from the server at
    ``$DCR_PREFORK_SOCKET`` unless the job runs another Python (:data:`OWN_PYTHON_FIELDS`). An actor
    whose own ``runtime_env`` adds ``pip``, ``uv`` or ``conda`` inherits the job's executable; its client
    sees the environment Ray activated and starts it the ordinary way, with that environment's Python."""
    env = dict(runtime_env or {})
    sock = os.environ.get(SOCKET_ENV)
    if sock and not any(env.get(k) for k in OWN_PYTHON_FIELDS):
        deadline = time.monotonic() + 60.0
        while not os.path.exists(sock) and os.path.isdir(os.path.dirname(sock)) and time.monotonic() < deadline:
            time.sleep(0.05)  # a server still importing: its socket appears when it accepts workers
        env.update(runtime_env_for(sock))
    return env


@dataclasses.dataclass
class PreforkServer:
    """A prefork server this process started (see the module docstring)."""

    socket_path: str
    log_path: str
    process: subprocess.Popen
    preload: tuple[str, ...]
    ready: bool = False
    #: Why the server forks no worker (its guards found its process unsafe to fork from), or None.
    refusing: str | None = None

    def runtime_env(self) -> dict:
        """The ``runtime_env`` (for ``ray.init`` or one actor's options) that forks workers from here."""
        return runtime_env_for(self.socket_path)

    def ray_init_kwargs(self, address: str | None = None) -> dict:
        """``ray.init``'s arguments for a job whose workers fork from here: ``address`` (passed on as
        ``ray.init`` takes it) and this server's :meth:`runtime_env`; with ``address="local"`` (a new Ray of
        this job's own) also :func:`ray_system_config`, which a Ray that is already running refuses (any
        other address, None included, may connect to one). A job with a runtime env of its own adds its
        fields to ``["runtime_env"]`` (one of :data:`OWN_PYTHON_FIELDS` starts its workers the ordinary way)."""
        kwargs = {"address": address, "runtime_env": self.runtime_env()}
        if address == "local":
            kwargs["_system_config"] = ray_system_config()
        return kwargs

    def wait_ready(self, timeout_s: float = 120.0) -> "PreforkServer":
        """Block until the server answers workers (its preloads done); raise ``ConfigError`` if it died.

        A server whose guards found its process unsafe to fork from still answers, sending every worker
        to the ordinary start: :attr:`refusing` says why, and a warning is logged once."""
        if self.ready:
            return self
        sel = selectors.DefaultSelector()
        sel.register(self.process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        line = ""
        while not line and time.monotonic() < deadline:
            if sel.select(max(0.0, deadline - time.monotonic())):
                line = self.process.stdout.readline().strip() or "exited"
        sel.close()
        if line.startswith("refusing: "):
            self.refusing = line[len("refusing: "):]
            log.warning("dcr_ray.prefork: every Ray worker starts the ordinary way: %s", self.refusing)
        elif line != "ready":
            with open(self.log_path, errors="replace") as f:
                tail = f.read()[-2000:]
            self.stop()
            raise ConfigError(f"the prefork server did not start within {timeout_s:.0f} s; check that every entry "
                              f"of preload={list(self.preload)} imports here. The end of its log:\n{tail}")
        self.ready = True
        return self

    def environ(self) -> dict:
        """Environment variables that make every ``ray.init`` in this process, and in the processes it
        starts (an example run as a subprocess, say), fork its workers from this server (and start no
        worker it cannot use: :func:`ray_system_config`, as Ray reads it from the environment)."""
        return {SOCKET_ENV: self.socket_path, "RAY_RUNTIME_ENV_HOOK": HOOK,
                **{f"RAY_{k}": str(int(v)) for k, v in ray_system_config().items()}}

    def counts(self) -> dict:
        """``{"forked": workers forked so far, "refused": workers sent to start the ordinary way}``."""
        try:
            with open(self.log_path, errors="replace") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            lines = []
        return {"forked": sum(x.startswith(FORKED_LINE) for x in lines),
                "refused": sum(x.startswith(REFUSED_LINE) for x in lines)}

    def alive(self) -> bool:
        """Whether the server process is still running."""
        return self.process.poll() is None

    def stop(self) -> None:
        """Stop the server. Workers it forked keep running; new ones start the ordinary way."""
        if self.alive():
            self.process.terminate()
            self.process.wait(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()
        shutil.rmtree(os.path.dirname(self.socket_path), ignore_errors=True)

    def __enter__(self) -> "PreforkServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start(preload=DEFAULT_PRELOAD, extra=(), wait: bool = False, timeout_s: float = 120.0) -> PreforkServer:
    """Start a prefork server that loads ``preload`` and then ``extra`` (a model's own modules, say
    ``("transformers.models.qwen2.modeling_qwen2",)``); with ``wait``, return once it answers workers.

    Without ``wait`` it returns at once, so its imports overlap the caller's ``ray.init``; call
    :meth:`PreforkServer.wait_ready` before the first actor that should be forked.
    """
    preload = (*preload, *extra)
    if not available():
        raise ConfigError(f"dcr_ray.prefork needs Linux (pidfd, SCM_RIGHTS); this is {sys.platform}: "
                          "leave it off and workers start the ordinary way")
    home = tempfile.mkdtemp(prefix="dcr-prefork-")
    sock, log = os.path.join(home, "server.sock"), os.path.join(home, "server.log")
    with open(log, "wb") as err:  # never the caller's stderr: a pipe reading it would wait on the server
        proc = subprocess.Popen(
            [sys.executable, "-m", "dcr_ray.prefork.server", sock, "--preload", ",".join(preload),
             "--exit-with-parent"],
            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    server = PreforkServer(sock, log, proc, tuple(preload))
    return server.wait_ready(timeout_s) if wait else server
