"""The ``dcr`` checkpoint engine against veRL's own ``CheckpointEngine`` interface (veRL 0.9.1).

Real: ``verl`` (installed ``--no-deps`` by ``scripts/setup.sh``), Ray, veRL's ``CheckpointEngineWorker``
started as veRL's manager starts it (a Ray actor of ``ray.remote(CheckpointEngineWorker)`` with its
distributed environment variables), veRL's ``RolloutConfig`` / ``CheckpointEngineConfig``, its
``RolloutMode``, and :class:`DcrCheckpointEngineManager` built from veRL's config.

Stand-ins: the rollout server adapter the worker hands the received weights to is veRL's vLLM
``ServerAdapter`` in a real run, which needs a GPU vLLM server; here a small adapter consumes them exactly
as veRL's adapters do (``async for`` over ``ensure_async_iterator``). The manager's replicas are objects
carrying what it reads (rank, server address, mode, ``free_cache_engine``); no server is contacted. The
full sync, with sleep and wake in HYBRID mode, is ``test_verl_refit.py``.
"""

from __future__ import annotations

import raytools  # noqa: F401  (loopback environment before ray is imported)
from raytools import local_ray  # noqa: F401  (module-scoped Ray fixture)

import asyncio
import inspect
import socket
import sys
from types import SimpleNamespace

import pytest
import ray

pytest.importorskip("verl", reason="veRL is not installed: bash scripts/setup.sh (installs it --no-deps)")

from dcr_ray.errors import ConfigError  # noqa: E402
from dcr_ray.integrations.verl import DcrCheckpointEngine, DcrCheckpointEngineManager  # noqa: E402
from dcr_ray.integrations.verl.engine import SITS_OUT, NotDrivenHereError  # noqa: E402

# the adapter below runs in the worker actor, where this test module is not importable: ship it by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class _Adapter:
    """Consumes ``receive_weights`` as veRL's rollout server adapters do."""

    async def update_weights(self, weights, global_steps=None, wire_format=None, **kwargs):
        from verl.workers.rollout.utils import ensure_async_iterator

        async for _name, _tensor in ensure_async_iterator(weights):
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_receive_weights_through_verls_checkpoint_engine_worker_shows_dcrs_advice_not_a_type_error(local_ray):
    from verl.checkpoint_engine.base import CheckpointEngineWorker
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    config = RolloutConfig(name="vllm", checkpoint_engine=CheckpointEngineConfig(
        backend="dcr", custom_backend_module="dcr_ray.integrations.verl"))
    env = {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    worker = ray.remote(CheckpointEngineWorker).options(num_cpus=0, runtime_env={"env_vars": env}).remote(
        config, None, _Adapter())
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as err:
            ray.get(worker.update_weights.remote(global_steps=1))  # veRL's rollout-side receive path
        cause = err.value.as_instanceof_cause()
        assert isinstance(cause, NotDrivenHereError) and isinstance(cause, NotImplementedError)
        assert "checkpoint_manager_class=dcr_ray.integrations.verl.DcrCheckpointEngineManager" in str(cause)
        # veRL's topology keys reach the engine through the worker's own dispatch: accepted, and a rank
        # veRL leaves out of the group gets no owner
        assert ray.get(worker.execute_checkpoint_engine.remote(
            "init_process_group", rank=SITS_OUT, world_size=2, master_metadata={"ip": "127.0.0.1"})) is None
    finally:
        ray.kill(worker)


def test_receive_weights_is_an_async_generator_as_verls_interface_says():
    engine = DcrCheckpointEngine(bucket_size=1 << 20)
    gen = engine.receive_weights(global_steps=3)
    assert inspect.isasyncgen(gen)
    with pytest.raises(NotDrivenHereError, match="checkpoint_manager_class"):
        asyncio.run(gen.__anext__())


def test_init_process_group_takes_verls_master_metadata_and_a_rank_0_gets_its_owner(local_ray):
    engine = DcrCheckpointEngine(bucket_size=1 << 20, is_master=True)
    owner = engine.init_process_group(rank=0, world_size=1, names=["w"], master_metadata={"ip": "127.0.0.1"},
                                      num_senders=1)
    try:
        assert owner is not None and engine.rank == 0 and engine.names == {"w"}
        assert ray.get(owner.dcr_tensors.remote()) == {}
    finally:
        ray.kill(owner)


def test_a_rank_that_sits_out_sends_nothing_and_needs_no_owner():
    engine = DcrCheckpointEngine(bucket_size=1 << 20)
    assert engine.init_process_group(rank=SITS_OUT, world_size=3, master_metadata=None) is None
    assert asyncio.run(engine.send_weights([("w", None)], global_steps=1)) == {}


def test_a_rank_outside_the_world_or_not_an_integer_is_refused_with_what_to_give():
    engine = DcrCheckpointEngine(bucket_size=1 << 20)
    with pytest.raises(ConfigError, match="rank 5 outside a world of 2"):
        engine.init_process_group(rank=5, world_size=2)
    with pytest.raises(ConfigError, match="integer rank"):
        engine.init_process_group(rank="0", world_size=2)
    with pytest.raises(TypeError):
        engine.init_process_group(rank=0, world_size=1, no_such_key=1)  # not a key of veRL's topologies


def test_build_topology_refuses_with_the_interfaces_not_implemented_error_naming_the_manager():
    with pytest.raises(NotImplementedError, match="DcrCheckpointEngineManager"):
        DcrCheckpointEngine.build_topology(2, 2, [{}] * 4)


def _manager(replicas):
    from verl.workers.config import CheckpointEngineConfig

    config = CheckpointEngineConfig(backend="dcr", custom_backend_module="dcr_ray.integrations.verl",
                                    engine_kwargs={"dcr": {"checkpoint": "/ckpt"}})
    manager = DcrCheckpointEngineManager(config, SimpleNamespace(world_size=1), replicas)
    manager.clusters("/ckpt")  # names each replica's adopted engine
    return manager


def test_the_manager_checks_exactly_the_replicas_whose_sleep_or_kv_release_may_drop_the_weights():
    from verl.workers.rollout.replica import RolloutMode

    def replica(rank, mode, free=True):
        return SimpleNamespace(replica_rank=rank, server_address=f"127.0.0.1:{8000 + rank}", rollout_mode=mode,
                               config=SimpleNamespace(free_cache_engine=free))

    m = _manager([replica(0, RolloutMode.HYBRID), replica(1, RolloutMode.COLOCATED),
                  replica(2, RolloutMode.STANDALONE), replica(3, RolloutMode.HYBRID, free=False)])
    # HYBRID sleeps at level 2 and releases with a level-2 sleep; COLOCATED sleeps at level 1 (weights kept)
    # and skips the release; STANDALONE skips the sleep; without free_cache_engine nothing sleeps
    assert m.dropped_engines(slept=True, released=False) == ["rollout/a0"]
    assert m.dropped_engines(slept=False, released=True) == ["rollout/a0", "rollout/a2"]
    assert m.dropped_engines(slept=False, released=False) == []


def test_the_kv_cache_release_setting_must_be_a_boolean():
    from dcr_ray.integrations.verl import VerlDcrSettings

    assert VerlDcrSettings.from_kwargs({"release_kv_cache": False}).release_kv_cache is False
    with pytest.raises(ConfigError, match="release_kv_cache must be true or false"):
        VerlDcrSettings.from_kwargs({"release_kv_cache": "no"})
