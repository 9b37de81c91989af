"""The stand-in "python" that Ray execs for a worker when a prefork server is in use (stdlib only).

Ray runs ``<py_executable> default_worker.py ARGS...`` for each worker. With ``py_executable`` set to
``python -I -S client.py SOCKET``, this script instead asks the prefork server at SOCKET for a child
forked from a process that has already imported torch, transformers and dcr_ray, hands it this
process's argv, working directory, environment and standard streams, and then stands in for it:

- it returns when the child ends (Linux ``pidfd``), so whoever waits on this process waits on the worker;
- a SIGTERM or SIGINT sent here is passed on to the child;
- if this process dies in any way, the child sees its connection close and exits too.

The worker registers with the raylet under its own pid, so Ray's calls (``ray.kill``, the raylet's
kill of an idle worker) reach the child directly. If the server cannot be reached, this process runs
the worker itself (``os.execv`` of the real interpreter), so a stopped server slows workers down but
never stops them from starting. The same holds where the server refuses a worker whose environment
would change what the server imported (:func:`dcr_ray.prefork.server.differs`).
"""

import json
import os
import select
import signal
import socket
import struct
import sys


def ordinary(argv: list) -> None:
    """Become the worker the ordinary way: this interpreter runs it and imports everything itself."""
    os.execv(sys.executable, [sys.executable, *argv])


def main() -> int:
    sock_path, argv = sys.argv[1], sys.argv[2:]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(sock_path)
    except OSError:
        ordinary(argv)  # no server here
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    message = struct.pack("!I", len(request)) + request
    sent = socket.send_fds(conn, [message], [0, 1, 2])  # the streams travel with the first bytes
    if sent < len(message):  # never an empty send: a server that refused has already closed (EPIPE)
        conn.sendall(message[sent:])
    reply = b""
    while len(reply) < 4:
        part = conn.recv(4 - len(reply))
        if not part:
            return 1  # the server refused or died before forking
        reply += part
    pid = struct.unpack("!i", reply)[0]
    if pid <= 0:
        ordinary(argv)  # refused: this worker's environment differs from what the server imported under

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return 0  # it has already ended
    while True:
        try:
            select.select([pidfd], [], [])
            return 0
        except InterruptedError:
            continue


if __name__ == "__main__":
    sys.exit(main())
