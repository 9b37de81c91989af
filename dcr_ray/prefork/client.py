"""The stand-in "python" that Ray execs for a worker when a prefork server is in use (stdlib only).

Ray runs ``<py_executable> default_worker.py ARGS...`` for each worker. With ``py_executable`` set to
``python -I -S client.py SOCKET``, this script instead asks the prefork server at SOCKET for a child
forked from a process that has already imported torch, transformers and dcr_ray, hands it this
process's argv, working directory, environment and standard streams, and then stands in for it:

- it exits when the child ends, with the child's exit status (a child ended by a signal ends this
  process with the same signal), so whoever waits on this process waits on the worker;
- a SIGTERM or SIGINT sent here is passed on to the child;
- if this process dies in any way, the child sees its connection close and exits too.

The worker registers with the raylet under its own pid, so Ray's calls (``ray.kill``, the raylet's
kill of an idle worker) reach the child directly.

Until a child's pid arrives, every failure starts the worker the ordinary way (``os.execv`` of the real
interpreter, which imports everything itself): this kernel lacks ``pidfd_open`` (``ENOSYS`` before Linux
5.3), no server answers, the server closes or fails before it replies, or it refuses the worker (its
environment differs from the server's where imports read it, or the server's guards found it unsafe to
fork from). A worker for which Ray's runtime env activated another Python environment (``pip``, ``uv``,
``conda``) is refused too, and started with ``python`` from its PATH: that environment's, as Ray itself
would run it. A stopped server slows workers down but never stops them from starting.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import time

#: The server's refusals (``dcr_ray.prefork.server``; this script imports nothing outside the stdlib).
REFUSED, REFUSED_OWN_PYTHON = -1, -2

#: How long to wait for the exit status once the child has ended (the server sends it when it reaps).
STATUS_GRACE_S = 5.0


def ordinary(argv: list, own_python: bool = False) -> None:
    """Become the worker the ordinary way: an interpreter runs it and imports everything itself. With
    ``own_python``, the ``python`` on this worker's PATH (the environment Ray activated for it)."""
    if own_python:
        os.execvp("python", ["python", *argv])
    os.execv(sys.executable, [sys.executable, *argv])


def _pidfd_works() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):  # ENOSYS on a kernel before 5.3; EPERM under some seccomp filters
        return False
    return True


def _recv_int(conn: socket.socket) -> int | None:
    """One signed 4-byte integer, or None if the connection ends first."""
    data = b""
    while len(data) < 4:
        part = conn.recv(4 - len(data))
        if not part:
            return None
        data += part
    return struct.unpack("!i", data)[0]


def request_fork(sock_path: str, argv: list) -> tuple[socket.socket, int]:
    """Send this worker to the server; ``(connection, reply)``. Raises ``OSError`` on any failure."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(sock_path)
        request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        message = struct.pack("!I", len(request)) + request
        sent = socket.send_fds(conn, [message], [0, 1, 2])  # the streams travel with the first bytes
        if sent < len(message):  # never an empty send: a server that refused may have closed already (EPIPE)
            conn.sendall(message[sent:])
        reply = _recv_int(conn)
    except OSError:
        conn.close()
        raise
    if reply is None:
        conn.close()
        raise ConnectionError("the prefork server closed the connection before it replied")
    return conn, reply


def wait_for(conn: socket.socket, pid: int) -> int:
    """Stand in for the child ``pid`` until it ends; its exit status (negative: the signal that ended it),
    or 1 where none came (its server had stopped, and the child ended without sending its own)."""
    try:
        pidfd = os.pidfd_open(pid)
        deadline = None
    except ProcessLookupError:  # already ended and reaped: its status is on the way
        pidfd, deadline = None, time.monotonic() + STATUS_GRACE_S
    status = None
    while True:
        watch = [conn] if deadline is not None else [conn, pidfd]
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select(watch, [], [], timeout)  # retried on EINTR (PEP 475)
        if conn in ready:
            status = _recv_int(conn)  # None: the connection ended without one
            break
        if not ready:
            break
        deadline = time.monotonic() + STATUS_GRACE_S  # the child ended: its status follows, from it or the server
    if status is None:
        print(f"dcr_ray.prefork: worker {pid} ended and no exit status came (its server had stopped)",
              file=sys.stderr, flush=True)
        return 1
    return status


def exit_as(status: int) -> None:
    """End this process as the worker ended: with its exit code, or killed by the same signal."""
    if status >= 0:
        sys.exit(status)
    sig = -status
    try:
        signal.signal(sig, signal.SIG_DFL)
    except (OSError, ValueError):  # SIGKILL and SIGSTOP cannot be handled: they keep their default
        pass
    os.kill(os.getpid(), sig)
    sys.exit(128 + sig)  # a signal that does not end a process by default


def main() -> int:
    sock_path, argv = sys.argv[1], sys.argv[2:]
    if not _pidfd_works():
        ordinary(argv)
    try:
        conn, pid = request_fork(sock_path, argv)
    except OSError:  # no server, or it closed or failed before replying
        ordinary(argv)
    if pid <= 0:
        conn.close()
        ordinary(argv, own_python=pid == REFUSED_OWN_PYTHON)

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    exit_as(wait_for(conn, pid))
    return 1


if __name__ == "__main__":
    sys.exit(main())
