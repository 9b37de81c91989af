""":class:`VllmBackend`: a vLLM engine dcr_ray starts, refit through the ``dcr`` weight-transfer backend.

The engine is a ``vllm.LLM(weight_transfer_config={"backend": BACKEND_NAME})`` in the engine actor's process,
driven exactly as an adopted engine is (:class:`~dcr_ray.engines.vllm.adopted.WeightSyncBackend`, over
:class:`~dcr_ray.engines.vllm.sync.LocalWeightSync`): every validated frame goes to the workers as its
wire bytes in ``update_weights``, ``flush`` is ``finish_weight_update``, and every call is followed by a
read of every worker's status. The refit itself happens in each worker, in its
:class:`~dcr_ray.engines.vllm.worker.receiver.MirrorReceiver` (host mirror, fused-group reload, loader capture,
the start-up reload self-check). What only an engine dcr_ray started has on top:

- ``keep_undo``: the workers keep a finished update's undo record until :meth:`VllmBackend.activate`
  commits it, so :meth:`VllmBackend.rollback` returns an abandoned transfer in place (the engine actor
  asks it when a transfer is abandoned), even after its flush;
- read-back: :meth:`VllmBackend.read_back` reads the canonical tensors the workers serve (peer healing,
  digests, checks) through ``collective_rpc`` (:func:`~dcr_ray.engines.vllm.worker.transfer.worker_query`);
- :meth:`VllmBackend.load_dense` loads named tensors densely, as dense frames of the bootstrap base;
- :meth:`VllmBackend.generate`: one continuous batch that concurrent calls join, stepped by one thread
  under the lock :meth:`VllmBackend.flush` takes and through the engine's step gate
  (:mod:`~dcr_ray.engines.vllm.batch`): a version switch falls between two steps of the running requests
  (no step sees a half-switched model), requests are salted by version in the prefix cache, and every
  continuation names the versions its tokens came from.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from typing import Any, Iterable, Mapping, Sequence

from dcr_ray.codec import BOOTSTRAP_BASE, DecodedFrame, FrameMeta, encode_frames, full_delta, read_frame
from dcr_ray.codec.bits import wire_name
from dcr_ray.engines.sampling import Sampling
from dcr_ray.engines.vllm.adopted import WeightSyncBackend
from dcr_ray.engines.vllm.batch import ContinuousBatch
from dcr_ray.engines.vllm.checkpoint import checkpoint_files
from dcr_ray.engines.vllm.compat import shutdown_llm, start_llm, will_use_cuda
from dcr_ray.engines.vllm.plugin import BACKEND_NAME, UNPACKED_LOAD_FORMAT
from dcr_ray.engines.vllm.serving import greedy_params, sampling_params
from dcr_ray.engines.vllm.sync import LocalWeightSync
from dcr_ray.engines.vllm.worker.plan import merge_summaries, strict_check
from dcr_ray.errors import BackendError, ConfigError, TargetMismatchError

log = logging.getLogger(__name__)

MODES = ("auto", "mirror", "capture")
CPU_WEIGHTS = ("packed", "unpacked")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: Bytes of one dense frame :meth:`VllmBackend.load_dense` sends (a worker holds one decoded at a time).
_DENSE_FRAME_BYTES = 16 << 20


def _llm_kwargs(model: str, *, seed: int, cuda: bool, unpacked: bool,
                extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM``: the ``dcr`` weight-transfer backend, no tokenizer when the
    checkpoint has none, eager single-process execution on CPU, and (``unpacked``) the load format that
    keeps CPU weights unpacked; ``extra`` overrides them."""
    kw: dict[str, Any] = dict(model=model, seed=seed, weight_transfer_config={"backend": BACKEND_NAME})
    if not any(os.path.exists(os.path.join(model, f)) for f in _TOKENIZER_FILES):
        kw["skip_tokenizer_init"] = True
    if not cuda:
        kw.update(enforce_eager=True, distributed_executor_backend="uni")
        if unpacked:
            kw["load_format"] = UNPACKED_LOAD_FORMAT
    kw.update(extra or {})
    return kw


def _placement(mode: str, cpu_weights: str | None, cuda: bool) -> tuple[str, str]:
    """``(path, weights)`` the engine will run: the receiver's path (``capture`` / ``mirror``) and how its
    weights are held (``cuda``, or on CPU ``packed`` / ``unpacked``); :class:`ConfigError` for a pair that
    cannot run, saying which to pick."""
    if mode not in MODES:
        raise ConfigError(f"VllmBackend.mode must be one of {MODES}, got {mode!r}")
    if cpu_weights is not None and cpu_weights not in CPU_WEIGHTS:
        raise ConfigError(f"VllmBackend.cpu_weights must be one of {CPU_WEIGHTS} (or None), got {cpu_weights!r}")
    if cuda:
        return ("mirror" if mode == "mirror" else "capture"), "cuda"
    weights = cpu_weights or ("unpacked" if mode == "capture" else "packed")
    if mode == "capture" and weights == "packed":
        raise ConfigError("VllmBackend(mode='capture') on CPU needs cpu_weights='unpacked' (vLLM-CPU packs its "
                          "weights after loading, so writes into them would reach nothing); or use mode='mirror'")
    if mode == "auto":
        mode = "capture" if weights == "unpacked" else "mirror"
    return mode, weights


def _describe(path: str, weights: str, specs: Mapping[str, Any], mirrored: Sequence[str],
              summary: Mapping[str, tuple[str, str]]) -> dict[str, Any]:
    """What :attr:`VllmBackend.placement` says: the path, the weights, how many checkpoint tensors take each
    path, and (a few) why some are mirrored on the capture path."""
    out: dict[str, Any] = {"path": path, "weights": weights, "captured": len(specs) - len(mirrored),
                           "mirrored": len(mirrored)}
    if path == "capture" and mirrored:
        why = [f"{n}: {summary[n][1]}" if n in summary and summary[n][1] else f"{n}: in a fused group with one"
               for n in mirrored[:3]]
        out["mirrored_because"] = why
    return out


class VllmBackend(WeightSyncBackend):
    """A vLLM engine built from a Hugging Face checkpoint directory, refit in canonical coordinates.

    Construct it inside the engine actor's process (``backend_factory=functools.partial(VllmBackend,
    "/path/to/checkpoint", ...)``); the checkpoint holds the engine's starting weights (``version``).
    """

    engine_kind = "vLLM engine"
    switches_in_flight = True  # every step of its continuous batch goes through the step gate

    def __init__(
        self,
        model: str,
        *,
        mode: str = "auto",
        cpu_weights: str | None = None,
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
            mode: the receiver's path. ``capture``: frames are written in place into the parameters the
                engine computes from, through the loader copies captured at start-up (O(changes), no
                host mirror, no reload; tensors a layer repacks, e.g. fused-MoE experts on CPU, stay on
                the mirror path). ``mirror``: a host mirror takes the frames and vLLM reloads the touched
                fused groups. ``auto``: ``capture`` on CUDA and with ``cpu_weights="unpacked"``, else
                ``mirror``. :attr:`placement` says what the engine runs.
            cpu_weights: vLLM on CPU only (its CUDA weights are never packed). ``packed``: vLLM-CPU's
                default, linear weights packed for oneDNN and the parameters emptied (the mirror path).
                ``unpacked``: vLLM's own per-layer switch (``_cpu_skip_gemm_dispatch``) set on every
                layer when the engine loads (load format ``dcr_unpacked``), so each layer computes with
                ``F.linear`` on its parameter (the capture path; slower to serve: ``dcr-ray bench live
                --receivers vllm,vllm_capture`` measures both).
                None: ``unpacked`` for ``mode="capture"``, else ``packed``.
            version: the policy version the checkpoint holds (reported by :meth:`generate`).
            seed: vLLM's seed (greedy decoding does not use it).
            kv_cache_gib: KV cache size on CPU (``VLLM_CPU_KVCACHE_SPACE``), in GiB.
            strict_capture: in ``capture`` mode, raise :class:`~dcr_ray.errors.LoaderCaptureError`
                naming every tensor whose loader path cannot be captured, instead of keeping those
                on the host-mirror path.
            llm_kwargs: extra keyword arguments for ``vllm.LLM`` (they override the defaults here).
        """
        cuda = will_use_cuda()
        mode, self.weights = _placement(mode, cpu_weights, cuda)
        if not os.path.isdir(model):
            raise ConfigError(f"VllmBackend.model must be a checkpoint directory, got {model!r}")
        self.model_dir = model
        self.mode = mode
        self._lock = threading.RLock()
        self._files = checkpoint_files(model)
        self._update: tuple[int, int] | None = None  # the update written since the last activate
        self._kept = False  # an update finished since the last activate: the workers keep its undo record
        self.last_flush: dict[str, int] = {}
        kwargs = _llm_kwargs(model, seed=seed, cuda=cuda, unpacked=self.weights == "unpacked", extra=llm_kwargs)
        self.llm, self._inproc = start_llm(kwargs, cuda=cuda, kv_cache_gib=kv_cache_gib)
        try:
            # the workers' receivers start from the checkpoint and run the start-up reload self-check
            super().__init__(LocalWeightSync(self.llm, f"{model} (in this process)"), model, version=version,
                             capture=mode == "capture", init_extra={"keep_undo": True, "own_checkpoint": True})
            layouts = self._query("layout")
            self.capture_summary = merge_summaries(lay["capture"] for lay in layouts)  # affine on every rank
            if strict_capture:
                strict_check(self.capture_summary)
        except BaseException:
            self.close()
            raise
        self._batch = ContinuousBatch(self.llm, self._lock, lambda: self.step_gate, lambda: self.version)
        self.groups: list[list[str]] = layouts[0]["groups"]
        self.ignored: list[str] = layouts[0]["ignored"]
        self.unresolved: list[str] = layouts[0]["unresolved"]
        self.mirrored: list[str] = sorted({n for lay in layouts for n in lay["mirrored"]})
        self.placement = _describe(self.mode, self.weights, self.tensor_specs(), self.mirrored, self.capture_summary)

    def describe(self) -> dict[str, Any]:
        """How this engine receives (shown in ``status()``): :attr:`placement`."""
        return {"receiver": "vLLM", **self.placement}

    @property
    def step_lock(self) -> threading.RLock:
        """The lock each generation step, frame write, flush and reload of this engine holds: code that drives
        the ``LLM`` itself beside dcr_ray (a peer's reload in a benchmark, a user's own ``collective_rpc``)
        takes it so that it never interleaves with them (it must not run ``LLM.generate`` while
        :meth:`generate` calls are in flight: :mod:`~dcr_ray.engines.vllm.batch`)."""
        return self._lock

    def _query(self, what: str, names: list[str] | None = None) -> list:
        """Every worker's answer to :func:`~dcr_ray.engines.vllm.worker.transfer.worker_query`, rank by rank."""
        from dcr_ray.engines.vllm.worker.transfer import worker_query

        replies = self.llm.collective_rpc(worker_query, args=(what, names))
        bad = [f"rank {i}: {r['error']}" for i, r in enumerate(replies) if not r["ok"]]
        if bad:
            raise BackendError(f"{self._engine}: {what} failed: {'; '.join(bad)}")
        return [r["result"] for r in replies]

    def _session(self, update_info: dict) -> None:
        """One ``update_weights`` call that carries no frames, in a session of its own."""
        self._checked("start", self.calls.start_weight_update)
        self._checked("update", self.calls.update_weights, update_info)
        self._checked("finish", self.calls.finish_weight_update)

    # -- contract ----------------------------------------------------------------------------------
    def read_back(self) -> Mapping[str, Any]:
        """The canonical tensors the engine serves, read back from rank 0's receiver: its host mirror
        (the start-up self-check proved it is what the worker serves; in this process, the mirror's
        own tensors), and on the capture path copies read from live storage (costly; for checks)."""
        with self._lock:
            return self._query("tensors")[0]

    def tensors(self) -> Mapping[str, Any]:
        """:meth:`read_back` (for code that holds a :class:`VllmBackend` itself)."""
        return self.read_back()

    def apply_wire(self, data: bytes, frame: DecodedFrame) -> None:
        """Forward one validated frame to the workers (the first frame of an update opens it)."""
        with self._lock:
            self._update = (frame.meta.base, frame.meta.target)
            self.send_frames([data], frame.meta.base, frame.meta.target)

    def apply_bytes(self, data: bytes, *, key: bytes | None = None, expect_base: int | None | str = "current",
                    max_raw_bytes: int | None = None) -> DecodedFrame:
        """Validate a wire frame against this engine (tensors, and base == :attr:`version` unless
        ``expect_base`` says otherwise) and forward it. Nothing is written when validation fails."""
        base = self.version if expect_base == "current" else expect_base
        kw = {} if max_raw_bytes is None else {"max_raw_bytes": max_raw_bytes}
        frame = read_frame(data, shapes=self._specs, key=key, expect_base=base, **kw)
        self.apply_wire(data, frame)
        return frame

    def flush(self) -> None:
        """Make every frame since the last flush visible to vLLM (the workers reload the touched fused
        groups and write captured changes into live storage), tag outputs with the update's target and
        reset the prefix cache. ``last_flush``: the workers' statistics (zeros when nothing was open)."""
        with self._lock:
            stats = {"reloaded_tensors": 0, "reprocessed_modules": 0, "captured_elements": 0}
            if self._open is not None:
                super().flush()
                stats = self._query("last_finish")[0]
                self._kept = self._update is not None and self._update[0] != BOOTSTRAP_BASE
            self.last_flush = stats

    def _reset_prefix_cache(self) -> None:
        """Drop the prefix cache of the old weights when vLLM allows it (no request holds blocks); while
        requests are in flight it refuses, and the version salt of every request (:mod:`.batch`) already
        keeps new requests off the old version's blocks."""
        if not self.calls.reset_prefix_cache():
            log.debug("%s: prefix cache kept while requests run (salted by version)", self._engine)

    def load_dense(self, tensors: Iterable[tuple[str, Any]]) -> None:
        """Replace the named tensors completely and make them visible now (bootstrap, peer healing): dense
        frames of the bootstrap base, checked against the checkpoint's tensors before any is sent."""
        with self._lock:
            deltas = []
            for name, t in tensors:
                if name not in self._specs:
                    raise TargetMismatchError(f"load_dense: the engine has no tensor named {name!r}")
                dt, shape = self._specs[name]
                if wire_name(t.dtype) != dt or tuple(t.shape) != tuple(shape):
                    raise TargetMismatchError(f"load_dense: {name} is {t.dtype}{list(t.shape)}, the engine "
                                              f"holds {dt}{list(shape)}")
                deltas.append(full_delta(name, t.detach().cpu().contiguous()))
            if not deltas:
                return
            meta = FrameMeta(transfer="load_dense", attempt=0, producer="VllmBackend", payload=0,
                             base=BOOTSTRAP_BASE, target=self.version)
            self._update, self._kept = None, False  # a bootstrap has no undo: the workers drop the kept one
            for data in encode_frames(deltas, meta, bucket_bytes=_DENSE_FRAME_BYTES):
                self.send_frames([data], BOOTSTRAP_BASE, self.version)
            self.flush()

    def activate(self, version: int) -> None:
        """The engine now holds committed ``version`` (after its commit record): the workers drop the
        finished update's undo record and take ``version`` as the next update's base."""
        with self._lock:
            if self._open is None and (self._kept or version != self.version):
                self._session({"base": version, "target": version, "commit": True})
                self.calls.update_weight_version(str(version))
                self._update, self._kept = None, False
            self.version = version

    def rollback(self) -> bool:
        """Undo the update written since the last :meth:`activate` in place, flushed or not (the workers'
        undo records; see :meth:`~dcr_ray.engines.vllm.worker.receiver.MirrorReceiver.rollback`): True when the
        engine serves the update's base again; False when it cannot (no update, a bootstrap, captured
        writes in live storage, a worker's refusal), and the engine must be bootstrapped densely."""
        with self._lock:
            update, self._update, self._kept = self._update, None, False
            if update is None or update[0] == BOOTSTRAP_BASE:
                return False
            try:
                if self._open is None:
                    self._checked("start", self.calls.start_weight_update)
                self._open = None
                self._checked("update", self.calls.update_weights,
                              {"base": update[0], "target": update[1], "rollback": True})
                self._checked("finish", self.calls.finish_weight_update)
            except BackendError as e:
                log.warning("%s: in-place rollback of %s->%s refused: %s", self._engine, *update, e)
                return False
            self.version = update[0]
            self.calls.update_weight_version(str(update[0]))
            self._reset_prefix_cache()
            self.last_flush = self._query("last_finish")[0]
            return True

    def abandon(self) -> None:
        """Close the open update unapplied (the workers' mirrors get back what they serve)."""
        with self._lock:
            super().abandon()

    def matches_digests(self, version: int, digests: Mapping[tuple, str]) -> bool | None:
        """None: an engine dcr_ray starts is bootstrapped densely when it joins."""
        return None

    def close(self) -> None:
        """Shut the engine down and release its memory.

        Several in-process engines in one process (tests) share vLLM's global distributed state: their
        shutdowns are deferred until the last of them closes. Close every backend you create (a backend
        dropped without ``close()`` lets vLLM's finalizer tear that state down under the others).
        """
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        batch = getattr(self, "_batch", None)
        if batch is not None:
            batch.close()
        self.llm = None
        shutdown_llm(llm, self._inproc)
        del llm
        gc.collect()

    # -- serving -----------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], max_tokens: int = 16,
                 sampling=None) -> list[dict]:
        """Continuations (EOS ignored, so exactly ``max_tokens`` tokens): greedy by default, else as
        ``sampling`` (:class:`~dcr_ray.engines.sampling.Sampling`) says, through vLLM's own sampler, in
        the engine's continuous batch (:mod:`~dcr_ray.engines.vllm.batch`).

        Returns ``{"token_ids": [...], "logprobs": [...], "versions": [(v, first token index), ...],
        "version": v}`` per continuation (prompt-major): the log-probability of each chosen token, the
        spans of the policy versions that produced them, and the oldest of those versions.
        """
        sampling = Sampling.of(sampling)
        plain = sampling.greedy and sampling.n == 1 and sampling.allowed_token_ids is None
        params = greedy_params(max_tokens) if plain else sampling_params(max_tokens, sampling)
        if self.llm is None:
            raise BackendError(f"{self._engine} is closed")
        outs = [o for per_prompt in self._batch.generate(prompt_token_ids, params, sampling.n) for o in per_prompt]
        for o in outs:
            o["version"] = min((v for v, _ in o["versions"]), default=self.version)
        return outs
