"""Loading the compiled kernels: whether they are used, and building each set once per process.

The codec's hot loops have numba definitions (:mod:`~dcr_ray.codec.compiled.kernels_numba`,
:mod:`~dcr_ray.codec.compiled.ptrkernels_numba`) behind thin wrappers (:mod:`~dcr_ray.codec.compiled.kernels` for one
tensor's flat bit view, :mod:`~dcr_ray.codec.compiled.ptrkernels` for many tensors addressed by data pointer).
Importing numba is slow and most processes never need a kernel, so each wrapper builds its set on first
use through :func:`once`. This module imports neither wrapper: both depend on it, not on each other.

Each wrapper binds :data:`ENABLED` in its own namespace and its callers read it there
(``kernels.ENABLED``, ``ptrkernels.ENABLED``), so one set can be turned off without the other (the
tests compare every compiled path with its numpy twin that way).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

#: Whether the compiled kernels are used: numba installed and ``DCR_RAY_JIT`` not ``0``. numba ships
#: with vLLM and dcr_ray lists it as a dependency; a missing one only costs speed (every caller has a
#: numpy path that computes the same bits).
ENABLED = importlib.util.find_spec("numba") is not None and os.environ.get("DCR_RAY_JIT", "1") != "0"


def once(build: Callable[[], T]) -> Callable[[], T]:
    """A function that runs ``build()`` on its first call, under a lock, and returns that result from then
    on (each kernel set is compiled, or loaded from numba's cache, once per process)."""
    lock: threading.Lock = threading.Lock()
    done: list = []

    def get() -> T:
        if not done:
            with lock:
                if not done:
                    done.append(build())
        return done[0]

    return get
