"""Where SkyRL's delta-sync code comes from: its released package when installed, else a reimplementation.

SkyRL 0.4.0 (PyPI ``skyrl``) is an optional extra of the benchmark, never a dependency of the library.
Its wheel declares Python >= 3.12; its CPU delta path (``skyrl/backends/skyrl_train/weight_sync/delta/
checkpoint.py``: numpy, safetensors, zstandard, xxhash) imports on 3.11, but the packages above it do not
(``skyrl.backends`` builds pydantic models that need 3.12's ``TypedDict``). So when the normal import
fails, the delta package is imported by file path under empty parent packages: the same modules, none of
the parents' code. :func:`load` says which it did, or why it fell back to :mod:`.skyrl_reimpl`.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from dataclasses import dataclass
from typing import Callable

#: The release the bench was written against, and how to install it beside the library.
VERSION = "0.4.0"
INSTALL = f".venv/bin/pip install --no-deps --ignore-requires-python skyrl=={VERSION} cloudpathlib"
_DELTA = "skyrl.backends.skyrl_train.weight_sync.delta"
_PARENTS = ("skyrl.backends", "skyrl.backends.skyrl_train", "skyrl.backends.skyrl_train.weight_sync")


@dataclass
class SkyrlCode:
    """SkyRL's publisher and store, and the helpers that name its files."""

    peer_code: str  # "own" (the released code ran) or "reimplemented"
    note: str
    Publisher: type
    Store: type
    fetch_delta_directory: Callable  # (uri, cache_dir) -> (manifest, dir): the store's download step
    cache_name: Callable  # delta uri -> the store's cache directory name
    version_name: Callable  # version -> the published directory's name


def _import_checkpoint():
    """SkyRL's ``delta/checkpoint.py``, and how it was imported."""
    try:
        return importlib.import_module(f"{_DELTA}.checkpoint"), "imported normally"
    except Exception as e:  # noqa: BLE001 - a parent package that fails on this Python; the delta code may not
        why = f"the normal import raised {type(e).__name__}"
    import skyrl

    root = os.path.dirname(skyrl.__file__)
    for name in _PARENTS:
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.__path__ = [os.path.join(root, *name.split(".")[1:])]
            sys.modules[name] = stub
    return importlib.import_module(f"{_DELTA}.checkpoint"), f"delta package imported by file path ({why})"


def load(prefer_own: bool = True) -> SkyrlCode:
    """SkyRL's own code when it imports (``peer_code="own"``), else the reimplementation, with the reason."""
    reason = "not asked for"
    if prefer_own:
        try:
            from importlib.metadata import version

            got = version("skyrl")
            c, how = _import_checkpoint()
            return SkyrlCode("own", f"SkyRL {got}'s own DeltaCheckpointPublisher and LocalCheckpointStore "
                                    f"({how}, Python {sys.version_info.major}.{sys.version_info.minor})",
                             c.DeltaCheckpointPublisher, c.LocalCheckpointStore, c.fetch_delta_directory,
                             c._safe_path_name, c._version_name)
        except Exception as e:  # noqa: BLE001 - any failure means the released code cannot run here
            reason = f"{type(e).__name__}: {e}"[:200]
    from benchmarks.peers import skyrl_reimpl as r

    return SkyrlCode("reimplemented", f"SkyRL's code could not run here ({reason}); reimplemented from its "
                                      f"{VERSION} source (install: {INSTALL})",
                     r.Publisher, r.Store, r.fetch_delta_directory, r.cache_name, r.version_name)


def vllm_receiver(code: SkyrlCode) -> type:
    """SkyRL's vLLM receiver: with its own code, ``delta/engine.py``'s ``DeltaWeightTransferEngine`` (vLLM's
    weight-transfer API: ``init_transfer_engine``, ``fetch_weights`` while serving, then
    ``start_weight_update`` / ``receive_weights`` / ``finish_weight_update``, a reload of every tensor of
    the local checkpoint through the model's ``load_weights`` inside vLLM's layerwise reload); else the same
    steps written here around the reimplemented store (:class:`ReimplementedVllmReceiver`)."""
    if code.peer_code == "own":
        _import_checkpoint()  # the delta package (by file path when its parents do not import here)
        return importlib.import_module(f"{_DELTA}.engine").DeltaWeightTransferEngine
    return ReimplementedVllmReceiver


class ReimplementedVllmReceiver:
    """What SkyRL 0.4.0's ``DeltaWeightTransferEngine`` does on a vLLM worker, around :mod:`.skyrl_reimpl`'s store."""

    init_info_cls = update_info_cls = types.SimpleNamespace  # (base_model_path, local_checkpoint_dir), (target_version)

    def __init__(self, config, vllm_config, device, model):
        self.model, self.vllm_config, self._store = model, vllm_config, None

    def init_transfer_engine(self, info) -> None:
        from benchmarks.peers.skyrl_reimpl import Store

        self._store = Store(info.base_model_path, info.local_checkpoint_dir)

    def fetch_weights(self, target_version: int, sync_dir: str | None = None, uri: str | None = None) -> dict:
        return {"status": "ok", "stats": self._store.fetch(target_version, sync_dir=sync_dir)}

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, info) -> None:
        self._store.validate_ready(info.target_version)
        self.model.load_weights(self._store.iter_tensors())

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.vllm_config.model_config)
