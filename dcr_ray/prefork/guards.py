"""Whether a prefork server's process is safe to fork Ray workers from, checked once its preloads are done.

A forked child starts with one thread (the one that forked) and a copy of the parent's memory, locks and
library state included. The server forks workers only where, after its preloads:

- **one thread runs**, as the kernel counts them (``/proc/self/task``), native threads included: an OpenMP
  pool that a parallel region started, a numba or BLAS pool, a Python thread. A child would inherit their
  locks in whatever state they were and lack the threads that release them;
- **CUDA is untouched**: torch has not initialised CUDA (``torch.cuda.is_initialized()``), and the fork is not
  *poisoned*. PyTorch marks every child of a process that initialised the CUDA driver (which
  ``torch.cuda.is_available()`` does, unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``) as a bad fork, where any
  CUDA call raises "Cannot re-initialize CUDA in forked subprocess". A probe child asks torch itself
  (``torch.cuda._is_in_bad_fork()``). The server sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` for its own
  preloads, so that a model module's availability check does not poison it;
- **this kernel has** ``pidfd_open`` (Linux 5.3; an older kernel answers ``ENOSYS``): the server and its
  clients wait on their children through it;
- **Ray's private hook is as expected**: each forked worker wraps ``ray._private.utils.`` :data:`RAY_HOOK`
  (Ray calls it to set a worker's ``OMP_NUM_THREADS``; see ``server._report_a_thread_count_ray_changes``).
  It is read from Ray's source, since the server must not import Ray. A Ray without it starts its workers
  in a way this code does not know, so none is forked.

:func:`why_not_fork` gives the first reason found, or None. A server with a reason still answers every
client, sending each to the ordinary start, and says why (``PreforkServer.refusing``).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys

#: The private function of ``ray._private.utils`` that each forked worker wraps.
RAY_HOOK = "set_omp_num_threads_if_unset"

#: Read by torch at each availability check (never at import), so a worker may have its own value: the server
#: sets it for its preloads, and it is not among the variables a worker must share with the server.
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def thread_count() -> int:
    """Threads of this process, as the kernel counts them (native threads included)."""
    return len(os.listdir("/proc/self/task"))


def _threads() -> str | None:
    n = thread_count()
    if n > 1:
        return (f"{n} threads run in the server after its preloads (a forked worker would start with one, holding "
                "the others' locks); leave out the preload that starts them, or the parallel region that does")
    return None


def _bad_fork_probe(torch) -> bool | None:
    """Whether a child forked now is in PyTorch's bad fork (None: this torch cannot say)."""
    probe = getattr(torch.cuda, "_is_in_bad_fork", None) or getattr(torch._C, "_cuda_isInBadFork", None)
    if probe is None:
        return None
    pid = os.fork()
    if pid == 0:  # the probe child: answer through the exit status, run nothing else
        try:
            os._exit(1 if probe() else 0)
        except BaseException:  # noqa: BLE001 - any failure is a "cannot tell"
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return {0: False, 1: True}.get(code)


def _cuda() -> str | None:
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "cuda"):
        return None
    if torch.cuda.is_initialized():
        return ("CUDA is initialised in the server (torch.cuda.is_initialized()): a forked worker could not use it; "
                "leave out the preload that touches the GPU")
    if not hasattr(torch._C, "_cuda_getDeviceCount"):
        return None  # a torch built without CUDA: nothing can poison a fork
    bad = _bad_fork_probe(torch)
    if bad is None:
        return "this torch cannot say whether a forked worker could use CUDA (no torch.cuda._is_in_bad_fork)"
    if bad:
        return (f"a preload initialised the CUDA driver, so PyTorch refuses CUDA in every forked worker (a call to "
                f"torch.cuda.is_available() without {NVML_CHECK}=1, say); leave it out")
    return None


def _pidfd() -> str | None:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as e:
        return f"this kernel or Python has no pidfd_open ({e}); Linux 5.3 and Python 3.9 have it"
    return None


def ray_hook_problem(ray_dir: str | None = None) -> str | None:
    """Why the Ray installed here (or the one at ``ray_dir``) lacks the hook forked workers wrap, or None.
    Read from its source: ``ray._private.utils`` must define :data:`RAY_HOOK` taking no argument."""
    if ray_dir is None:
        spec = importlib.util.find_spec("ray")  # a top-level package: found, not imported
        if spec is None or not spec.submodule_search_locations:
            return None  # no Ray here: no Ray worker will ask
        ray_dir = list(spec.submodule_search_locations)[0]
    path = os.path.join(ray_dir, "_private", "utils.py")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError) as e:
        return f"cannot read Ray's {path} ({e}), where forked workers expect ray._private.utils.{RAY_HOOK}()"
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == RAY_HOOK:
            a = node.args
            if not (a.posonlyargs or a.args or a.vararg or a.kwonlyargs or a.kwarg):
                return None
            return f"Ray's ray._private.utils.{RAY_HOOK} takes arguments now ({path}); this dcr_ray wraps it without"
    return (f"Ray's {path} has no {RAY_HOOK}(), which each forked worker wraps to see the OMP_NUM_THREADS Ray "
            "gives it: this Ray starts workers in a way this dcr_ray does not know")


def why_not_fork() -> str | None:
    """The first reason this process is unsafe to fork Ray workers from, or None (module docstring).
    Threads are counted first: the CUDA probe forks, which is safe only with one thread."""
    for check in (_threads, _pidfd, _cuda, ray_hook_problem):
        reason = check()
        if reason:
            return reason
    return None
