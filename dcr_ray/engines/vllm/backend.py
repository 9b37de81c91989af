""":class:`VllmBackend`: a vLLM engine refit in canonical coordinates (see :mod:`dcr_ray.engines.vllm`)."""

from __future__ import annotations

import gc
import os
import threading
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from dcr_ray.codec import DecodedFrame, DecodedItem, Encoding, apply_decoded, read_frame
from dcr_ray.codec.bits import bits_view, dtype_of, itemsize, wire_name
from dcr_ray.engines.base import EngineBackend
from dcr_ray.engines.vllm.checkpoint import checkpoint_files, checkpoint_specs, iter_checkpoint
from dcr_ray.engines.vllm.compat import shutdown_llm, start_llm, will_use_cuda
from dcr_ray.engines.vllm.groups import whole_groups
from dcr_ray.engines.vllm.plan import merge_summaries, strict_check
from dcr_ray.engines.vllm.serving import greedy
from dcr_ray.engines.vllm.worker import WORKER_EXTENSION
from dcr_ray.errors import BackendError, ConfigError, IndexOutOfRangeError, TargetMismatchError

MODES = ("auto", "mirror", "capture")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _llm_kwargs(model: str, *, seed: int, cuda: bool, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM``: this package's worker extension, no tokenizer when the
    checkpoint has none, eager single-process execution on CPU; ``extra`` overrides them."""
    kw: dict[str, Any] = dict(model=model, seed=seed, worker_extension_cls=WORKER_EXTENSION)
    if not any(os.path.exists(os.path.join(model, f)) for f in _TOKENIZER_FILES):
        kw["skip_tokenizer_init"] = True
    if not cuda:
        kw.update(enforce_eager=True, distributed_executor_backend="uni")
    kw.update(extra or {})
    return kw


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
                :func:`dcr_ray.testing.models.save_checkpoint`. Its tensors are the canonical names.
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
        cuda = will_use_cuda()
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
        self.llm, self._inproc = start_llm(_llm_kwargs(model, seed=seed, cuda=cuda, extra=llm_kwargs),
                                           cuda=cuda, kv_cache_gib=kv_cache_gib)

        names = list(self._specs)
        info = self.llm.collective_rpc("dcr_fused_groups", args=(names,))[0]
        self._groups: list[list[str]] = info["groups"]
        self.ignored: list[str] = info["ignored"]
        self.unresolved: list[str] = info["unresolved"]
        self._group_of = {n: i for i, g in enumerate(self._groups) for n in g}

        if mode == "capture":
            summary = merge_summaries(self.llm.collective_rpc("dcr_capture_prepare", args=(self._files,)))
            if strict_capture:
                strict_check(summary)
            self.capture_summary = summary
            mirror = {n for n, (kind, _) in summary.items() if kind != "affine"}
            # whole fused groups go through the loader together
            self._mirror_names = set(whole_groups(mirror, self._groups, self._group_of, self._specs))
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
        skips the CPU prepack, which would leave unpacked bits in packed storage while the host mirror
        looks right). So at start-up, while storage holds what a fresh load gave, push every mirror
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

    def undo_tensors(self) -> Mapping[str, torch.Tensor] | None:
        """The host mirror (``mirror`` mode): frames write it and :meth:`flush` reloads what they touched,
        so undoing in the mirror and flushing again restores the served weights. None in ``capture`` mode."""
        return self._mirror if self.mode == "mirror" else None

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
                items = list(self._staged)
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
                    self._staged.append(DecodedItem(name, Encoding.DENSE, 0, len(src), None, src.copy()))
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
        shutdown_llm(llm, self._inproc)
        del llm
        gc.collect()

    # -- serving -----------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], max_tokens: int = 16) -> list[dict]:
        """Greedy continuations (temperature 0, EOS ignored, so exactly ``max_tokens`` tokens).

        Returns one ``{"token_ids": [...], "logprobs": [...], "version": v}`` per prompt: the
        log-probability of each chosen token, and the policy version that produced it.
        """
        with self._lock:
            outs = greedy(self.llm, prompt_token_ids, max_tokens)
            version = self.version
        return [{**o, "version": version} for o in outs]

    # -- helpers -----------------------------------------------------------------------------------
    def _expand(self, names: Iterable[str]) -> list[str]:
        """``names`` grown to whole fused groups, in checkpoint order (ignored names are dropped)."""
        return whole_groups(names, self._groups, self._group_of, self._specs)

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
