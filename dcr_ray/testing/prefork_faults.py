"""Preloads that leave a prefork server unsafe to fork from, for the tests of its guards
(:mod:`dcr_ray.prefork.guards`). Each is a ``module:function`` entry of ``dcr_ray.prefork.start(extra=...)``.

:func:`parallel_region` is real: torch runs a parallel region on two OpenMP threads, and the pool's threads
stay. The others stand in for what this project's CPU-only test machines cannot do, and say so: a CUDA
torch that a preload initialised, a driver initialised by an availability check (PyTorch's poisoned fork),
and a ``fork`` that the kernel refuses (the tests run as root, which no process limit stops).
"""

from __future__ import annotations

import errno
import os


def parallel_region() -> None:
    """Run one matrix product on two OpenMP threads: the runtime keeps its pool's threads afterwards."""
    import torch

    torch.set_num_threads(2)
    x = torch.ones(512, 512)
    (x @ x).sum()


def cuda_initialised() -> None:
    """Stand-in (no GPU here): torch reports CUDA initialised, as after a preload ran a CUDA call."""
    import torch

    torch.cuda._initialized = True


def fork_poisoned() -> None:
    """Stand-in (CPU torch here): torch is built with CUDA, and a child of this process is in PyTorch's bad
    fork, as after a preload called ``torch.cuda.is_available()`` without the NVML check."""
    import torch

    torch._C._cuda_getDeviceCount = lambda: 1
    torch.cuda._is_in_bad_fork = lambda: True


def fork_fails() -> None:
    """Stand-in (root is exempt from process limits): every ``os.fork`` in the server fails with EAGAIN."""
    def refuse():
        raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    os.fork = refuse
