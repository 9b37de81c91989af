"""A prefork server: imports what every dcr_ray worker needs once, then forks one child per Ray worker.

Each Ray worker that runs torch and transformers spends about 3.4 CPU-seconds importing them before it can
do anything (on this project's 2-core CI machine, about 1.7 s of wall time when two start at once). A
topology starts one such process per engine and per trainer, and a re-created engine cannot heal until
its imports are done. A child forked from this server starts with those modules already imported.

Protocol (one Unix-socket connection per worker, opened by :mod:`dcr_ray.prefork.client`): the client
sends a 4-byte big-endian length and a JSON object ``{"argv", "cwd", "env"}`` with its stdin, stdout and
stderr attached as ``SCM_RIGHTS`` file descriptors; the server forks and replies with the child's pid as
4 bytes. The child takes the client's streams, directory and environment (replacing the server's
entirely), starts a new session, and runs ``argv[0]`` as ``__main__`` with ``argv`` as ``sys.argv``, as the
interpreter would have. It keeps the connection and exits as soon as the client closes it.

Fork safety: the server imports modules and runs no threads of its own, no Ray connection, no CUDA and no
parallel region; each child reseeds Python's ``random`` (``os.register_at_fork``). The OpenMP runtime
read ``OMP_NUM_THREADS`` when the server loaded it (1 unless the server was started with another value),
so a worker that sets another value itself is refused and starts the ordinary way.

Copy-on-write, as Python's ``gc`` documentation advises for processes that fork without exec: the server
imports with the garbage collector off, then moves every object it holds into the collector's permanent
generation (``gc.freeze()``); each child turns collection on again. A child's collections then never walk
the server's objects, so they never write to the pages that hold them and the child does not copy them:
a trivial forked actor started in about 0.65 CPU-s instead of 1.0 (six at once on this 2-core machine:
3.9 CPU-s and 2.1 s instead of 5.8 CPU-s and 3.0 s), and the server is ready in 2.7 s instead of 3.75.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import runpy
import signal
import socket
import struct
import sys
import threading

from dcr_ray.prefork import DEFAULT_PRELOAD, FORKED_LINE, REFUSED_LINE


#: Environment variables that modules read when they are imported (torch, transformers and the hub,
#: numba, the BLAS and OpenMP runtimes, protobuf, dcr_ray's own switches): a worker whose values differ from
#: the server's would inherit modules configured for another environment, so it starts the ordinary way.
#: OMP_NUM_THREADS is compared only where a worker sets it itself (:func:`differs`; Ray sets it later,
#: see ``_report_a_thread_count_ray_changes``); the server's own address, ``DCR_PREFORK_SOCKET``, never.
PINNED_PREFIXES = ("DCR_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "NUMBA_", "MKL_", "KMP_",
                   "OPENBLAS_", "GOMP_", "PROTOCOL_BUFFERS_", "CUDA_", "NVIDIA_", "LD_PRELOAD", "LD_LIBRARY_PATH",
                   "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONNOUSERSITE", "PYTHONUSERBASE", "PYTHONSAFEPATH",
                   "PYTHONWARNINGS", "PYTHONOPTIMIZE")


#: Set in each forked worker: the pid of the process Ray started for it (the client standing in for it).
CLIENT_PID_ENV = "DCR_PREFORK_CLIENT_PID"


def _peer_pid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def pinned(env: dict) -> dict:
    return {k: v for k, v in env.items()
            if k.startswith(PINNED_PREFIXES) and k != "OMP_NUM_THREADS" and not k.startswith("DCR_PREFORK_")}


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

    ray_sets = ray_utils.set_omp_num_threads_if_unset

    def set_then_check() -> bool:
        changed = ray_sets()
        now = os.environ.get("OMP_NUM_THREADS")
        if now != loaded:
            print(f"dcr_ray.prefork: this worker was forked with OpenMP sized for OMP_NUM_THREADS={loaded}, "
                  f"and Ray asks for {now}; it runs with {loaded}. Set OMP_NUM_THREADS in the actor's "
                  "runtime_env env_vars to start it the ordinary way", file=sys.stderr, flush=True)
        return changed

    ray_utils.set_omp_num_threads_if_unset = set_then_check


def _become_worker(listener: socket.socket, conn: socket.socket, request: dict, fds: list[int],
                   loaded_threads: str) -> None:
    """In the child: take the client's place and run the worker. Never returns."""
    code = 1
    try:
        gc.enable()  # the server ran without collections since its imports (serve)
        listener.close()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[CLIENT_PID_ENV] = str(_peer_pid(conn))
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
    if threading.active_count() > 1:
        raise SystemExit(f"preload {preload} left Python threads running; a forked child would lack them")


def _exit_with_parent() -> None:
    """Ask Linux to send this process SIGTERM when the process that started it ends."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def serve(sock_path: str, preload: list[str]) -> None:
    """Preload, then fork a worker for each connection until terminated."""
    own_env = dict(os.environ)
    gc.disable()  # imports run ~20% faster without collections, and leave no freed holes in shared pages
    preload_all(preload)
    gc.freeze()  # the children's collections leave what was imported here alone: no copy-on-write of it
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        conn.settimeout(30.0)  # a client that connects and never sends does not hold the others up
        try:
            request, fds = _read_request(conn)
        except (OSError, ValueError, ConnectionError):
            conn.close()
            continue
        conn.settimeout(None)  # the child keeps the connection: blocking, as its client is
        refused = differs(own_env, request["env"])
        if refused:
            print(f"{REFUSED_LINE}: its {', '.join(refused)} differ from this server's", file=sys.stderr,
                  flush=True)
            pid = -1
        else:
            pid = os.fork()
            if pid > 0:
                print(f"{FORKED_LINE} {pid}", file=sys.stderr, flush=True)
            if pid == 0:
                _become_worker(listener, conn, request, fds, own_env.get("OMP_NUM_THREADS", ""))
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(struct.pack("!i", pid))
        except OSError:
            pass  # the client left; the child sees its connection closed and exits
        conn.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("socket", help="Unix socket path to listen on")
    parser.add_argument("--preload", default=",".join(DEFAULT_PRELOAD),
                        help="comma-separated modules to import before forking (module:function also calls it)")
    parser.add_argument("--exit-with-parent", action="store_true", help="stop when the starting process ends")
    args = parser.parse_args(argv)
    # Before anything loads OpenMP: Ray's value for an actor with at most one CPU (see
    # _report_a_thread_count_ray_changes); a value set by whoever starts the server is kept.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.exit_with_parent:
        _exit_with_parent()
    serve(args.socket, [m for m in args.preload.split(",") if m])


if __name__ == "__main__":
    main()
