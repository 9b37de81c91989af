"""A prefork server: imports what every dcr_ray worker needs once, then forks one child per Ray worker.

Each Ray worker that runs torch and transformers spends seconds of CPU importing them before it can do
anything (``dcr-ray bench startup`` measures it per kind of actor). A topology starts one such process per engine and per trainer, and a re-created engine cannot heal until
its imports are done. A child forked from this server starts with those modules already imported.

Protocol (one Unix-socket connection per worker, opened by :mod:`dcr_ray.prefork.client`): the client
sends a 4-byte big-endian length and a JSON object ``{"argv", "cwd", "env"}`` with its stdin, stdout and
stderr attached as ``SCM_RIGHTS`` file descriptors; the server replies with a signed 4-byte integer: the
forked child's pid, or a refusal (:data:`REFUSED`: start the ordinary way; :data:`REFUSED_OWN_PYTHON`: the
same, with the Python that Ray's runtime env activated for this worker). After a pid, one more such
integer follows when the child ends: its exit status as ``os.waitstatus_to_exitcode`` gives it (negative:
the signal that ended it), sent by the child itself as it exits and by the server when it reaps it. The
child takes the client's streams, directory and environment (replacing the server's entirely), starts a
new session, and runs ``argv[0]`` as ``__main__`` with ``argv`` as ``sys.argv``, as the interpreter would
have. It keeps the connection and exits as soon as the client closes it.

Who is served: the socket is created with mode 0600, and the server answers only clients whose uid
(``SO_PEERCRED``) is its own; any other is refused, so that no other user chooses a script, an environment
or a directory that would run as this one.

Fork safety: the server imports modules and runs no threads of its own, no Ray connection, no CUDA and no
parallel region, and :mod:`~dcr_ray.prefork.guards` checks that the preloads left it so (or it refuses every
worker, saying why). Each child reseeds Python's ``random`` (``os.register_at_fork``), numpy's global
random state and torch's default CPU generator from the OS, as an ordinary process seeds them. The OpenMP
runtime read ``OMP_NUM_THREADS`` when the server loaded it (1 unless the server was started with another
value), so a worker that sets another value itself is refused and starts the ordinary way.

Copy-on-write, as Python's ``gc`` documentation advises for processes that fork without exec: the server
imports with the garbage collector off, then moves every object it holds into the collector's permanent
generation (``gc.freeze()``); each child turns collection on again. A child's collections then never walk
the server's objects, so they never write to the pages that hold them and the child does not copy them
(BENCHMARKS.md, ``dcr-ray bench startup``, has what that saves).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import threading

from dcr_ray.prefork import DEFAULT_PRELOAD, FORKED_LINE, REFUSED_LINE
from dcr_ray.prefork.guards import NVML_CHECK, RAY_HOOK, why_not_fork


#: Environment variables that modules read when they are imported (torch, transformers and the hub,
#: numba, the BLAS and OpenMP runtimes, protobuf, dcr_ray's own switches): a worker whose values differ from
#: the server's would inherit modules configured for another environment, so it starts the ordinary way.
#: OMP_NUM_THREADS is compared only where a worker sets it itself (:func:`differs`; Ray sets it later,
#: see ``_report_a_thread_count_ray_changes``); the server's own address, ``DCR_PREFORK_SOCKET``, never.
PINNED_PREFIXES = ("DCR_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "NUMBA_", "MKL_", "KMP_",
                   "OPENBLAS_", "GOMP_", "PROTOCOL_BUFFERS_", "CUDA_", "NVIDIA_", "LD_PRELOAD", "LD_LIBRARY_PATH",
                   "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONNOUSERSITE", "PYTHONUSERBASE", "PYTHONSAFEPATH",
                   "PYTHONWARNINGS", "PYTHONOPTIMIZE")


#: Variables under the prefixes above that no import reads (:data:`~dcr_ray.prefork.guards.NVML_CHECK`: torch
#: reads it at each availability check), so a worker may have its own value.
UNPINNED = frozenset({NVML_CHECK})

#: Set by Ray's runtime env when it activates another Python environment for a worker (``pip`` and ``uv``
#: activate a virtualenv, ``conda`` an environment): such a worker runs that environment's Python.
ACTIVATED = ("VIRTUAL_ENV", "CONDA_PREFIX")

#: The server's replies other than a pid: start the worker the ordinary way with this interpreter, or with
#: ``python`` as the worker's PATH finds it (the one Ray's runtime env activated, as Ray itself runs it).
REFUSED, REFUSED_OWN_PYTHON = -1, -2

#: Set in each forked worker: the pid of the process Ray started for it (the client standing in for it).
CLIENT_PID_ENV = "DCR_PREFORK_CLIENT_PID"


def _peer(conn: socket.socket) -> tuple[int, int]:
    """The connected client's ``(pid, uid)``, as the kernel gives them (``SO_PEERCRED``)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def pinned(env: dict) -> dict:
    return {k: v for k, v in env.items()
            if k.startswith(PINNED_PREFIXES) and k != "OMP_NUM_THREADS" and not k.startswith("DCR_PREFORK_")
            and k not in UNPINNED}


def activated(server_env: dict, worker_env: dict) -> list[str]:
    """The :data:`ACTIVATED` variables whose values differ: another Python environment for this worker."""
    return [k for k in ACTIVATED if server_env.get(k) != worker_env.get(k)]


def differs(server_env: dict, worker_env: dict) -> list[str]:
    """The pinned variables whose values differ between the server's environment and a worker's, and
    OMP_NUM_THREADS where the worker sets it at start to another value than the server loaded OpenMP with."""
    a, b = pinned(server_env), pinned(worker_env)
    out = [k for k in a.keys() | b.keys() if a.get(k) != b.get(k)]
    if "OMP_NUM_THREADS" in worker_env and worker_env["OMP_NUM_THREADS"] != server_env.get("OMP_NUM_THREADS"):
        out.append("OMP_NUM_THREADS")
    return sorted(out)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise ConnectionError("the client closed the connection mid-request")
        data += part
    return data


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _flags, _addr = socket.recv_fds(conn, 4, 3)
    head += _recv_exact(conn, 4 - len(head))
    (length,) = struct.unpack("!I", head)
    return json.loads(_recv_exact(conn, length)), list(fds)


def _exit_when_closed(conn: socket.socket) -> None:
    """The client (the process Ray started) is gone: so is this worker."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    os._exit(1)


def _report_a_thread_count_ray_changes(loaded: str) -> None:
    """OpenMP read OMP_NUM_THREADS once, when the server loaded it (``loaded``), and sizes every thread's
    parallel regions from that. Ray sets a worker's OMP_NUM_THREADS from its CPUs just before the first
    task, unless the worker's environment has it: 1 for an actor with at most one CPU (dcr_ray's actors
    among them), which is the server's default. A worker that ends up with another value keeps the
    server's on every thread (a per-thread ``torch.set_num_threads`` would leave threads disagreeing,
    which vLLM's CPU attention refuses) and says so in its log."""
    import ray._private.utils as ray_utils  # loaded here, after the worker's environment is in place

    ray_sets = getattr(ray_utils, RAY_HOOK, None)
    if not callable(ray_sets):  # the server checked Ray's source before it forked (guards); never wrap a stranger
        return

    def set_then_check() -> bool:
        changed = ray_sets()
        now = os.environ.get("OMP_NUM_THREADS")
        if now != loaded:
            print(f"dcr_ray.prefork: this worker was forked with OpenMP sized for OMP_NUM_THREADS={loaded}, "
                  f"and Ray asks for {now}; it runs with {loaded}. Set OMP_NUM_THREADS in the actor's "
                  "runtime_env env_vars to start it the ordinary way", file=sys.stderr, flush=True)
        return changed

    setattr(ray_utils, RAY_HOOK, set_then_check)


def _reseed() -> None:
    """Random state a child must not share with its siblings or the server, reseeded from the OS as each
    library seeds itself in an ordinary process: numpy's global state and torch's default CPU generator
    (Python's ``random`` reseeds itself at fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "default_generator"):
        torch.default_generator.seed()


def _become_worker(inherited: list, conn: socket.socket, request: dict, fds: list[int], loaded_threads: str) -> None:
    """In the child: take the client's place and run the worker. Never returns; its last act is to send its
    exit status to the client (the server sends it too, when it reaps the child: a worker that ends through
    ``os._exit`` or a signal never reaches this function's end)."""
    code = 1
    try:
        gc.enable()  # the server ran without collections since its imports (serve)
        for other in inherited:  # the listener, the selector, other workers' connections and pidfds
            if isinstance(other, int):
                os.close(other)
            else:
                other.close()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[CLIENT_PID_ENV] = str(_peer(conn)[0])
        _reseed()
        _report_a_thread_count_ray_changes(loaded_threads)
        threading.Thread(target=_exit_when_closed, args=(conn,), daemon=True, name="dcr-prefork-client").start()
        argv = request["argv"]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the worker's own failure: print it where Ray keeps its stderr
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            conn.sendall(struct.pack("!i", code))
        except BaseException:  # noqa: BLE001 - the client may be gone; exiting is all that is left
            pass
        finally:
            os._exit(code)


def preload_all(preload: list[str]) -> None:
    """Import each ``module``, or import ``module`` and call its ``function()`` for ``module:function``."""
    for entry in preload:
        name, _, function = entry.partition(":")
        module = importlib.import_module(name)
        if function:
            getattr(module, function)()
    if "ray" in sys.modules:
        # Ray's core library reads its environment (the worker's job id among it) when it is loaded, so a
        # child would start with the server's: each worker loads Ray itself, after taking its environment.
        raise SystemExit(f"preload {preload} imports ray; leave out every module that does")


def _exit_with_parent() -> None:
    """Ask Linux to send this process SIGTERM when the process that started it ends."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _listen(sock_path: str) -> socket.socket:
    """The server's socket, mode 0600 from its creation (the umask is set around ``bind``)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(sock_path)
    finally:
        os.umask(old)
    os.chmod(sock_path, 0o600)
    listener.listen(64)
    return listener


class _Server:
    """The serving loop: one selector over the listener and each live child's pidfd."""

    def __init__(self, listener: socket.socket, own_env: dict, refusing: str | None):
        self.listener, self.own_env, self.refusing = listener, own_env, refusing
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ)
        self.children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the client's connection)

    def run(self) -> None:
        while True:
            for key, _ in self.sel.select():
                if key.fileobj is self.listener:
                    self.answer(*self.listener.accept())
                else:
                    self.reap(key.fd)

    def refusal(self, uid: int, env: dict) -> tuple[int, str | None]:
        """``(REFUSED or REFUSED_OWN_PYTHON, why)`` for a worker this server must not fork, else ``(0, None)``."""
        if uid != os.getuid():
            return REFUSED, f"its uid {uid} is not this server's ({os.getuid()})"
        if self.refusing:
            return REFUSED, self.refusing
        own_python = activated(self.own_env, env)
        if own_python:
            return REFUSED_OWN_PYTHON, f"Ray activated another Python environment for it ({', '.join(own_python)})"
        different = differs(self.own_env, env)
        if different:
            return REFUSED, f"its {', '.join(different)} differ from this server's"
        return 0, None

    def answer(self, conn: socket.socket, _addr) -> None:
        conn.settimeout(30.0)  # a client that connects and never sends does not hold the others up
        try:
            request, fds = _read_request(conn)
        except (OSError, ValueError, ConnectionError):
            conn.close()
            return
        try:
            uid = _peer(conn)[1]
        except OSError:
            uid = -1  # unknown: refused below
        conn.settimeout(None)  # the child keeps the connection: blocking, as its client is
        reply, why = self.refusal(uid, request.get("env", {}))
        if not why:
            try:
                reply = os.fork()
            except OSError as e:
                reply, why = REFUSED, f"fork failed ({e})"
            if reply == 0:
                inherited = [self.listener, self.sel, *self.children, *(c for _, c in self.children.values())]
                _become_worker(inherited, conn, request, fds, self.own_env.get("OMP_NUM_THREADS", ""))
        print(f"{FORKED_LINE} {reply}" if reply > 0 else f"{REFUSED_LINE}: {why}", file=sys.stderr, flush=True)
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(struct.pack("!i", reply))
        except OSError:
            pass  # the client left; a child sees its connection closed and exits
        if reply > 0:
            pidfd = os.pidfd_open(reply)
            self.sel.register(pidfd, selectors.EVENT_READ)
            self.children[pidfd] = (reply, conn)
        else:
            conn.close()

    def reap(self, pidfd: int) -> None:
        """A child ended: tell its client how (the server is its parent, so it alone sees a signal)."""
        pid, conn = self.children.pop(pidfd)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        try:
            conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
        except OSError:
            pass
        conn.close()


def serve(sock_path: str, preload: list[str]) -> None:
    """Preload, check the process is safe to fork from, then answer each connection until terminated."""
    # torch's availability check, if a preload makes one, must not initialise the CUDA driver here (guards)
    os.environ.setdefault(NVML_CHECK, "1")
    own_env = dict(os.environ)
    gc.disable()  # imports run ~20% faster without collections, and leave no freed holes in shared pages
    preload_all(preload)
    gc.freeze()  # the children's collections leave what was imported here alone: no copy-on-write of it
    refusing = why_not_fork()
    listener = _listen(sock_path)
    if refusing:
        print(f"refusing every worker: {refusing}", file=sys.stderr, flush=True)
    print("ready" if not refusing else f"refusing: {refusing}", flush=True)
    _Server(listener, own_env, refusing).run()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("socket", help="Unix socket path to listen on")
    parser.add_argument("--preload", default=",".join(DEFAULT_PRELOAD),
                        help="comma-separated modules to import before forking (module:function also calls it)")
    parser.add_argument("--extra", default="", help="more modules to import after --preload (a model's own, say)")
    parser.add_argument("--exit-with-parent", action="store_true", help="stop when the starting process ends")
    args = parser.parse_args(argv)
    # Before anything loads OpenMP: Ray's value for an actor with at most one CPU (see
    # _report_a_thread_count_ray_changes); a value set by whoever starts the server is kept.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.exit_with_parent:
        _exit_with_parent()
    serve(args.socket, [m for m in f"{args.preload},{args.extra}".split(",") if m])


if __name__ == "__main__":
    main()
