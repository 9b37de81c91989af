"""What the scale sweep reads from processes: RSS at a process's start, Ray's object-store counters, the CPU
of Ray's own processes, and the engine factory. The functions here run inside relays and the coordinator too
(through ``__ray_call__``), and the coordinator unpickles the factory, so this module imports nothing heavy: the
owner class that notes its start before it allocates is in :mod:`benchmarks.scale.actors` (it imports torch).

RSS here is ``RssAnon + RssFile`` of ``/proc/<pid>/status`` (heap, tensors, mapped files), as
:class:`benchmarks.refit.memory.MemorySampler` samples it: the pages of Ray's shared-memory object store
that a worker maps are left out and counted once, as the store's own bytes (:func:`store_stats`).

*Start* of each role:

- owner: read in :class:`~benchmarks.scale.actors.ScaleOwner`'s ``__init__`` after ``import torch`` and before
  its tensors exist;
- engine: read by :class:`ScaleEngine` in the engine process before its backend
  allocates the model;
- relay and coordinator (dcr_ray starts them; nothing of theirs runs before they are in service): an idle
  Ray worker that imported the role's module (:func:`idle_rss`), read once per run.
"""

from __future__ import annotations

import os

#: RSS of this process when its owner or engine began building (None until then; read with
#: :func:`start_rss` through ``actor.__ray_call__``).
_START_RSS: int | None = None
#: The module each dcr_ray-started role runs, for :func:`idle_rss`.
ROLE_MODULES = {"relay": "dcr_ray.relay.relay", "coordinator": "dcr_ray.actors.coordinator.actor"}


def rss(pid: int | str = "self") -> int:
    """``RssAnon + RssFile`` of a process in bytes (0 when it is gone)."""
    got = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:")):
                    got += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return got


def hwm(pid: int | str = "self") -> int:
    """``VmHWM`` of a process in bytes: its peak RSS since it started or since ``clear_refs`` reset it (shared
    pages included, the object store's it mapped among them); 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _note_start() -> None:
    """Read this process's RSS once, torch imported first (its import is part of the start, not of what the
    process holds)."""
    import importlib

    global _START_RSS
    importlib.import_module("torch")
    if _START_RSS is None:
        _START_RSS = rss()


def start_rss(_actor=None) -> int | None:
    """(Run in an owner or engine actor.) Its RSS when it began building its tensors."""
    return _START_RSS


def pid_of(_actor=None) -> int:
    """(Run in any actor.) Its process id."""
    return os.getpid()


class ScaleEngine:
    """The sweep's engine factory: the refit benchmark's light receiver (``SyntheticBackend``), noting the
    engine process's RSS before it allocates the model. It lives here, in a module that imports nothing heavy,
    because the coordinator unpickles it: a factory whose module imports torch would put torch in the
    coordinator, which a user's factory (``dcr_ray.HFEngine``, ``dcr_ray.engines.vllm.VllmEngine``) does not."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = dict(shapes)

    def __call__(self):
        _note_start()
        from benchmarks.refit.actors import SyntheticBackend

        return SyntheticBackend(self.shapes)


def idle_rss(module: str) -> dict:
    """``{"rss", "loaded"}`` of a fresh Ray worker that imported ``module`` and nothing else: the start of a
    role whose process dcr_ray creates (relay, coordinator), and which of :data:`HEAVY` that start imported.
    The probe is self-contained (pickled by value): importing this benchmark's modules in it would count their
    imports (torch) as the role's start."""
    import ray

    @ray.remote(num_cpus=0)
    class Idle:
        def __init__(self, mod):
            import gc
            import importlib

            importlib.import_module(mod)
            gc.collect()

        def loaded(self):
            import sys

            return [m for m in ("torch", "transformers", "numba", "vllm") if m in sys.modules]

        def rss(self):
            got = 0
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(("RssAnon:", "RssFile:")):
                        got += int(line.split()[1]) * 1024
            return got

    a = Idle.remote(module)
    try:
        return {"rss": int(ray.get(a.rss.remote())), "loaded": ray.get(a.loaded.remote())}
    finally:
        ray.kill(a)


#: The raylet's gRPC stub, made once per Ray session (a channel per sample would cost more than the sample).
_STORE_STUB: dict = {}


def store_stats() -> dict:
    """Ray's object-store counters of this node (one RPC to the raylet, as ``ray memory --stats-only``
    makes): bytes in use, cumulative bytes created, bytes spilled."""
    import ray
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

    gcs = ray.get_runtime_context().gcs_address
    stub = _STORE_STUB.get(gcs)
    if stub is None:
        node = next(n for n in ray.nodes() if n["Alive"])
        channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
        stub = _STORE_STUB[gcs] = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
    reply = stub.FormatGlobalMemoryInfo(node_manager_pb2.FormatGlobalMemoryInfoRequest(include_memory_info=False),
                                        timeout=30.0)
    s = reply.store_stats
    return {"used": int(s.object_store_bytes_used), "created": int(s.cumulative_created_bytes),
            "spilled": int(s.spilled_bytes_total)}


def ray_system_pids() -> list[int]:
    """The raylet (it holds the object store) and the GCS server this driver started."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name() in ("raylet", "gcs_server"):
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each process so far (missing when it is gone)."""
    import psutil

    out = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def mem_available() -> int:
    """``MemAvailable`` of this machine in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def relay_children(actor_self) -> int:
    """(Run in a relay.) How many children (engines or sub-relays) it forwards to."""
    return len(actor_self.children)


def engine_digests(actor_self) -> dict[str, str]:
    """(Run in an engine.) SHA-256 of each tensor's integer view, one tensor copied at a time (the refit
    benchmark's probe copies the whole model at once: a second 2.4 GB at 1.2 B elements)."""
    import hashlib

    from dcr_ray.codec.bits import bits_view

    out = {}
    for name in actor_self.tensor_specs():
        t = actor_self.tensors([name])[name]
        out[name] = hashlib.sha256(memoryview(bits_view(t))).hexdigest()
    return out


#: Modules whose presence in a process says what its memory paid for (as ``dcr-ray bench startup`` reports).
HEAVY = ("torch", "transformers", "numba", "vllm")


def loaded(_actor=None) -> list[str]:
    """(Run in any actor.) Which of :data:`HEAVY` its process has imported."""
    import sys

    return [m for m in HEAVY if m in sys.modules]


def load_kernels(_actor=None) -> None:
    """(Run in an owner or engine.) Load the codec's compiled kernels now, on the calling thread: they load on
    a background thread at start-up, and a refit measured while that thread still runs pays for it."""
    from dcr_ray.codec.compiled.kernels import warm_up

    warm_up(background=False)


def prefork_workers() -> bool:
    """Whether this driver's Ray workers are forked from a :mod:`dcr_ray.prefork` server (the test suite's):
    their processes then start with torch and the kernels imported, which moves every role's start."""
    import dcr_ray.prefork

    return os.environ.get("RAY_RUNTIME_ENV_HOOK") == dcr_ray.prefork.HOOK
