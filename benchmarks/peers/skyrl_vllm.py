"""SkyRL 0.4.0's receiver inside a vLLM worker, run as SkyRL runs it (``llm.collective_rpc(fn, args=...)``).

:func:`worker_start` builds SkyRL's ``DeltaWeightTransferEngine`` (its own code, or the steps written around
the reimplemented store: :func:`benchmarks.peers.skyrl_code.vllm_receiver`) on the worker's model and
initialises it over a base checkpoint and a local checkpoint directory; :func:`worker_fetch` is its
``fetch_weights`` (the version's files into its cache, XORed into the local checkpoint, re-hashed: SkyRL
runs it while the engine serves); :func:`worker_reload` is the weight update SkyRL runs in the pause:
``start_weight_update`` (vLLM's layerwise reload begins), ``receive_weights`` (``validate_ready``, then
every tensor of the local checkpoint through the model's ``load_weights``), ``finish_weight_update``
(vLLM's layerwise reload ends: the CPU kernels' weights repacked). The caller resets the prefix cache.
"""

from __future__ import annotations


def worker_start(worker, base: str, local: str, prefer_own: bool = True) -> str:
    """(Run in a vLLM worker.) SkyRL's receiver on this worker's model; returns ``own`` or ``reimplemented``."""
    from benchmarks.peers import skyrl_code

    code = skyrl_code.load(prefer_own=prefer_own)
    cls = skyrl_code.vllm_receiver(code)
    model = worker.get_model()
    device = next(model.parameters()).device
    r = cls(worker.vllm_config.weight_transfer_config, worker.vllm_config, device, model)
    r.init_transfer_engine(cls.init_info_cls(base_model_path=base, local_checkpoint_dir=local))
    worker._bench_skyrl = r
    return code.peer_code


def worker_fetch(worker, version: int, sync_dir: str) -> None:
    """(Run in a vLLM worker.) SkyRL's ``fetch_weights`` of ``version`` from ``sync_dir``."""
    worker._bench_skyrl.fetch_weights(version, sync_dir=sync_dir)


def worker_reload(worker, version: int) -> None:
    """(Run in a vLLM worker.) SkyRL's weight update of ``version``: the whole model through vLLM's reload."""
    r = worker._bench_skyrl
    r.start_weight_update()
    r.receive_weights(r.update_info_cls(target_version=version))
    r.finish_weight_update()
