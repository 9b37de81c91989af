"""The worker-side half of the vLLM backend: runs inside every vLLM worker process.

vLLM builds its worker class with :class:`DcrWorkerExtension` mixed in when the engine is created with
``worker_extension_cls="dcr_ray.engines.vllm_worker.DcrWorkerExtension"``; the backend
(:mod:`dcr_ray.engines.vllm`) reaches the methods below with ``llm.collective_rpc("dcr_...")``. All
names start with ``dcr_`` so they cannot collide with the worker's own attributes.

Two ways to place canonical changes into a running vLLM model, both equal to a dense refit bit for bit:

**Fused-group reload (host mirror; any device, the only way on CPU).** vLLM's CPU backend repacks
Linear weights for its GEMM kernels after loading, so its parameters are not bit-addressable. The
backend keeps the canonical tensors in host memory, applies frames there, and pushes the touched
tensors through the worker's ``reload_weights`` — the model's own loader and post-processing.
``reload_weights`` processes a vLLM *module* once all its weights arrived, so a push must carry every
checkpoint tensor that module loads: all of q/k/v (weights and biases) of a fused ``qkv_proj``, gate and
up of a ``gate_up_proj``. A push of only part of a module makes vLLM process it with uninitialized
elements (observed on vLLM 0.32: wrong outputs, which in our experiments stayed wrong even after later
full reloads), so :func:`fused_groups`
derives the groups from the model itself — its ``hf_to_vllm_mapper`` (checkpoint name -> vLLM
parameter name) and ``packed_modules_mapping`` (fused module -> its checkpoint parts) — with no per-model
rules here. Names it cannot resolve join a group with every tensor (a full dense reload: slow but exact).
vLLM's reload does not process a module that only *aliases* a reloaded parameter (tied ``lm_head``), so
:func:`reprocess_aliases` re-runs its post-load processing, as a fresh start does.

**Loader capture (bit-addressable storage: CUDA).** :class:`LoaderCapture` runs the model's native
``load_weights`` once per checkpoint tensor on a scratch tensor of canonical shape, under a
``TorchDispatchMode`` that sees each ``aten.copy_`` the loader makes into parameter storage and records
its geometry (a strided view of the scratch -> a strided view of the parameter) *instead of* performing
it. Checkpoint tensors whose every final copy is such an affine, same-dtype, non-overlapping view copy
(besides constant fills, e.g. zeroed vocabulary padding, which every load rewrites identically) — and
whose live storage holds exactly the checkpoint's bits at the recorded places — are *affine*: a
frame's changed positions are mapped through the recorded geometry (pure index arithmetic) and written
as sparse XOR / OVERWRITE into live storage. Everything else (dtype conversions, temporaries, other
in-place ops, parameters re-bound, post-load transforms, overlapping writes, loader errors) is classified
once at prepare and handled through the host-mirror path instead (whole fused groups), or — with
``VllmBackend(strict_capture=True)`` — fails closed with a :class:`~dcr_ray.errors.LoaderCaptureError`
naming the tensors. The capture core is plain PyTorch and device-agnostic (it is unit-tested on CPU with
stand-in loaders and with real vLLM loaders on a never-repacked CPU model instance); the backend selects
it only when the engine's device is CUDA. On CUDA the sparse writes use ``cuda_ext``'s scatter kernels
when CuPy is importable, else PyTorch indexing.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dcr_ray.errors import BackendError, LoaderCaptureError

#: Signed torch integer dtypes by element size (torch lacks most ops on uint16/32/64).
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

#: vLLM loggers whose per-layer warnings are expected when only some modules are reloaded on purpose.
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")


def int_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the signed integer dtype of its element size (any strides)."""
    return t.view(_INT[t.element_size()])


# ---------------------------------------------------------------------------------------------------
# fused groups (checkpoint names -> the vLLM module that loads them)
# ---------------------------------------------------------------------------------------------------
_IGNORED = object()


def _map_hf_name(model: torch.nn.Module, name: str):
    """The vLLM parameter name ``name`` loads into (``_IGNORED`` when the model's mapper drops it)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        fn = getattr(mapper, "map_name", None) or getattr(mapper, "_map_name", None)
        if fn is not None:
            mapped = fn(name)
            if mapped is None:
                return _IGNORED
            name = mapped
    packed = getattr(model, "packed_modules_mapping", None) or {}
    part_to_fused = {part: fused for fused, parts in packed.items() for part in parts}
    mod, _, leaf = name.rpartition(".")
    pieces = mod.split(".")
    if pieces and pieces[-1] in part_to_fused:
        pieces[-1] = part_to_fused[pieces[-1]]
    return ".".join(pieces) + "." + leaf if mod else name


def fused_groups(model: torch.nn.Module, names: Iterable[str]) -> dict[str, Any]:
    """Group checkpoint ``names`` by the vLLM module that loads them.

    Returns ``{"groups": [[name, ...], ...], "ignored": [...], "unresolved": [...]}``: each group holds
    every given checkpoint tensor of one vLLM module (a reload must carry whole groups); ``ignored``
    names are dropped by the model's own name mapper (its loader never reads them); ``unresolved``
    names map to no module of the model and were put into one group with *all* names.
    """
    names = list(names)
    by_module: dict[str, list[str]] = {}
    ignored, unresolved = [], []
    for n in names:
        mapped = _map_hf_name(model, n)
        if mapped is _IGNORED:
            ignored.append(n)
            continue
        mod = loading_module(model, mapped)
        if mod is None:
            unresolved.append(n)
            continue
        by_module.setdefault(mod, []).append(n)
    groups = list(by_module.values())
    if unresolved:
        groups = [[n for n in names if n not in set(ignored)]]
    return {"groups": groups, "ignored": ignored, "unresolved": unresolved}


def _is_moe_layer(module: torch.nn.Module) -> bool:
    """A vLLM fused-experts layer: it holds the expert weights itself and its quant method is a
    ``FusedMoEMethodBase`` (the one with a ``moe_kernel``)."""
    qm = module.__dict__.get("quant_method") or module._modules.get("quant_method")
    return qm is not None and hasattr(qm, "moe_kernel") and next(module.parameters(recurse=False), None) is not None


def loading_module(model: torch.nn.Module, vllm_name: str) -> str | None:
    """The path of the module that loads the vLLM parameter ``vllm_name`` (None: no such module).

    Usually the name's parent. Expert weights are the exception: a checkpoint's
    ``mlp.experts.3.gate_proj.weight`` loads into slices of the one fused-experts layer below
    ``mlp.experts`` (its ``w13_weight``), so a path that resolves no module is walked up to the
    nearest ancestor that holds exactly one fused-experts layer, and resolves to that layer.
    """
    pieces = vllm_name.split(".")[:-1]
    for end in range(len(pieces), -1, -1):
        path = ".".join(pieces[:end])
        try:
            module = model.get_submodule(path) if path else model
        except AttributeError:
            continue
        if end == len(pieces):
            return path
        moe = [sub for sub, m in module.named_modules() if _is_moe_layer(m)]
        if len(moe) != 1:
            return None
        return ".".join(p for p in (path, moe[0]) if p)
    return None


def reprocess_moe_experts(model: torch.nn.Module, loaded_modules: set[str]) -> list[str]:
    """Finish the post-load processing vLLM skips for fused-experts layers on a weight *update*.

    vLLM's unquantized fused-MoE method runs its experts' ``process_weights_after_loading`` (on CPU:
    the prepack into the grouped-GEMM layout) on the first load only; on a reload it copies the
    freshly loaded, unprocessed bits into the processed storage. Running that step now, on each
    reloaded fused-experts layer, gives exactly what a fresh load gives. The start-up self-check of
    :class:`~dcr_ray.engines.vllm.VllmBackend` proves it per model, so a vLLM that stops skipping it
    (and would then be processed twice) is refused before it serves.
    """
    done = []
    for path in sorted(loaded_modules):
        try:
            layer = model.get_submodule(path) if path else model
        except AttributeError:
            continue
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and callable(getattr(experts, "process_weights_after_loading", None)):
            experts.process_weights_after_loading(layer)
            done.append(path)
    return done


def storage_digests(model: torch.nn.Module) -> dict[str, str]:
    """name -> BLAKE2b digest of the bits of every parameter and buffer the model serves with."""
    import hashlib

    out = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        if t is None or t.numel() == 0:
            continue
        data = t.detach().contiguous().cpu()
        view = int_view(data) if data.element_size() in _INT else data
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{data.dtype}{tuple(data.shape)}".encode())
        h.update(view.numpy().tobytes() if view.dtype != torch.bool else view.to(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()
    return out


@contextlib.contextmanager
def quiet_partial_reload():
    """Silence vLLM's per-layer "Failed to load weights" warnings while reloading chosen modules only."""
    saved = []
    for name in _RELOAD_LOGGERS:
        lg = logging.getLogger(name)
        saved.append((lg, lg.level))
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in saved:
            lg.setLevel(level)


# ---------------------------------------------------------------------------------------------------
# loader capture (bit-addressable storage)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Geometry:
    """A strided view: ``shape`` and ``stride`` in elements, ``offset`` from its storage's first element."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, t: torch.Tensor) -> "Geometry":
        return cls(tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def non_overlapping(self) -> bool:
        """True when no two elements of the view share a storage element (so positions invert uniquely)."""
        dims = sorted(((st, sz) for sz, st in zip(self.shape, self.stride) if sz > 1), reverse=True)
        span = 0  # storage span of the inner dims seen so far
        for st, sz in reversed(dims):
            if st <= 0 or st < span + 1:
                return False
            span += st * (sz - 1)
        return True

    def view(self, storage_flat: torch.Tensor) -> torch.Tensor:
        """This geometry as a view of a flat (1-D, offset 0) tensor over the same storage."""
        return torch.as_strided(storage_flat, self.shape, self.stride, self.offset)


def map_positions(pos: torch.Tensor, src: Geometry, dst: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    """Map canonical flat positions through one recorded copy ``dst <- src``.

    ``pos`` (int64) are element positions in the canonical tensor (the scratch the loader read). Returns
    ``(valid, dst_pos)``: which positions the copy read, and for those, the storage element it wrote.
    Requires a non-overlapping ``src`` (checked at prepare), so the decomposition is unique.
    """
    dims = sorted((d for d in range(len(src.shape)) if src.shape[d] > 1), key=lambda d: -src.stride[d])
    rel = pos - src.offset
    valid = rel >= 0
    out = torch.full_like(pos, dst.offset)
    for d in dims:
        c = torch.div(rel, src.stride[d], rounding_mode="floor")
        valid &= (c >= 0) & (c < src.shape[d])
        rel = rel - c * src.stride[d]
        out += c * dst.stride[d]
    valid &= rel == 0
    return valid, out


@dataclass(slots=True)
class CopyOp:
    """One final copy the loader made into parameter storage: ``param``'s storage view ``dst`` <- ``src``."""

    param: str
    src: Geometry
    dst: Geometry


@dataclass(slots=True)
class TensorPlan:
    """How one checkpoint tensor reaches parameter storage (decided once, at prepare)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    kind: str = "affine"
    """``affine`` (sparse writes through ``ops``), ``ignored`` (the loader does not store it) or
    ``fallback`` (must go through the native loader: see ``reason``)."""
    ops: list[CopyOp] = field(default_factory=list)
    reason: str = ""
    fills: list[tuple[str, Geometry, Any]] = field(default_factory=list)
    """Constant fills the loader makes besides its copies: ``(param, geometry, value)``."""


class _AbortProbe(Exception):
    """Raised inside the dispatch mode to stop a loader before a write dcr_ray cannot skip."""


def _written_tensors(func, args, kwargs) -> list[torch.Tensor]:
    """Tensors an op writes in place (from its schema's alias annotations)."""
    out = []
    try:
        schema_args = func._schema.arguments
    except AttributeError:
        return out
    for i, a in enumerate(schema_args):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def _storage_key(t: torch.Tensor):
    try:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr == 0 or st.nbytes() == 0:
            return None
        return (t.device.type, t.device.index, ptr)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


_FILLS = (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default)


class _CaptureMode(TorchDispatchMode):
    """Records (and skips) a loader's writes into parameter storage; lets every other op run."""

    def __init__(self, storages: Mapping[tuple, str], scratch: torch.Tensor):
        super().__init__()
        self.storages = storages
        self.scratch = scratch
        self.scratch_key = _storage_key(scratch)
        self.copies: list[tuple[str, Geometry | None, Geometry, str]] = []
        self.fills: list[tuple[str, Geometry, Any]] = []
        self.other: list[str] = []

    def _param_of(self, t) -> str | None:
        if not isinstance(t, torch.Tensor):
            return None
        k = _storage_key(t)
        return None if k is None else self.storages.get(k)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            pname = self._param_of(dst)
            if pname is not None:
                self.copies.append(self._classify(pname, dst, src))
                return dst  # skipped: nothing reaches live storage while probing
        elif func in _FILLS:
            # a constant written regardless of the checkpoint's values (e.g. zeroed vocabulary padding):
            # every dense load rewrites the same constant, so a sparse replay may leave it in place
            dst = args[0]
            pname = self._param_of(dst)
            if pname is not None:
                dg = Geometry.of(dst)
                if not dg.non_overlapping():
                    raise _AbortProbe(f"{func} fills an overlapping view of parameter {pname}")
                self.fills.append((pname, dg, 0 if func is torch.ops.aten.zero_.default else args[1]))
                return dst
        else:
            for t in _written_tensors(func, args, kwargs):
                pname = self._param_of(t)
                if pname is not None:
                    self.other.append(f"{func} writes parameter {pname}")
                    raise _AbortProbe(self.other[-1])
        return func(*args, **kwargs)

    def _classify(self, pname: str, dst: torch.Tensor, src) -> tuple[str, Geometry | None, Geometry, str]:
        dg = Geometry.of(dst)
        if not isinstance(src, torch.Tensor):
            return (pname, None, dg, "copies a non-tensor value")
        if _storage_key(src) != self.scratch_key:
            return (pname, None, dg, "copies a computed temporary, not a view of the checkpoint tensor")
        if src.dtype != dst.dtype or src.dtype != self.scratch.dtype:
            return (pname, None, dg, f"converts {src.dtype} -> {dst.dtype}")
        if tuple(src.shape) != tuple(dst.shape):
            return (pname, None, dg, f"broadcasts {tuple(src.shape)} -> {tuple(dst.shape)}")
        sg = Geometry.of(src)
        if not sg.non_overlapping() or not dg.non_overlapping():
            return (pname, None, dg, "copies through an overlapping (broadcast) view")
        return (pname, sg, dg, "")


def _param_registry(model: torch.nn.Module) -> tuple[dict[tuple, str], dict[str, torch.Tensor]]:
    """Storage key -> parameter/buffer name, and name -> tensor, for every tensor with storage."""
    storages: dict[tuple, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        k = _storage_key(t)
        if k is None or k in storages:
            continue
        storages[k] = name
        tensors[name] = t.detach()  # a view that keeps pointing at this storage
    return storages, tensors


def _storage_flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view over all of ``t``'s storage (offset 0), in ``t``'s dtype."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.as_strided(t.detach(), (n,), (1,), 0)


def scatter(flat: torch.Tensor, pos: torch.Tensor, values: torch.Tensor, *, xor: bool) -> None:
    """``flat[pos] ^= values`` (``xor``) or ``flat[pos] = values``, in place; ``pos`` unique.

    On CUDA the CuPy kernels of ``cuda_ext`` are used when that package and CuPy are importable;
    otherwise (and on CPU) PyTorch indexing does the same writes.
    """
    if flat.is_cuda:
        try:
            import cuda_ext
        except ImportError:
            cuda_ext = None
        if cuda_ext is not None and cuda_ext.cupy_available():
            (cuda_ext.scatter_xor if xor else cuda_ext.scatter_overwrite)(flat, pos, values)
            return
    if xor:
        flat.index_put_((pos,), flat.index_select(0, pos) ^ values)
    else:
        flat.index_put_((pos,), values)


def _snapshot(model: torch.nn.Module) -> dict[str, tuple[int, tuple, torch.dtype, torch.Tensor]]:
    """name -> (data pointer, shape, dtype, the data tensor itself) of every parameter."""
    return {n: (p.data_ptr(), tuple(p.shape), p.dtype, p.data)
            for n, p in model.named_parameters(remove_duplicate=False)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k][:3] == b[k][:3] for k in a)


class LoaderCapture:
    """Classifies a model's loader paths once, then writes sparse changes through the recorded copies.

    ``load_weights(iterable of (name, tensor))`` is the model's native loader (``model.load_weights``);
    ``context`` (optional) is entered around every loader call (vLLM needs its current config set).
    """

    def __init__(self, model: torch.nn.Module, load_weights: Callable | None = None,
                 context: Callable[[], Any] | None = None):
        self.model = model
        self.load_weights = load_weights or model.load_weights
        self.context = context or contextlib.nullcontext
        self.plans: dict[str, TensorPlan] = {}
        self._storages, self._tensors = _param_registry(model)

    # -- prepare -----------------------------------------------------------------------------------
    @torch.no_grad()
    def probe(self, name: str, value: torch.Tensor) -> TensorPlan:
        """Run the native loader on ``value`` (the tensor's current canonical bits) and classify it."""
        device = self._device()
        scratch = value.detach().to(device=device, copy=True).contiguous()
        plan = TensorPlan(name, scratch.dtype, tuple(scratch.shape))
        before = _snapshot(self.model)
        mode = _CaptureMode(self._storages, scratch)
        loaded: Any = None
        try:
            with self.context(), mode:
                loaded = self.load_weights([(name, scratch)])
        except _AbortProbe as e:
            plan.kind, plan.reason = "fallback", str(e)
        except Exception as e:  # the loader failed on a lone tensor: let the native loader handle it
            plan.kind, plan.reason = "fallback", f"loader raised {type(e).__name__}: {e}"
        after = _snapshot(self.model)
        if not _same(before, after):
            self._restore(before)
            plan.kind, plan.reason = "fallback", "the loader re-bound parameter storage instead of copying"
        if plan.kind == "affine":
            bad = [r for (_, sg, _, r) in mode.copies if sg is None]
            if bad:
                plan.kind, plan.reason = "fallback", bad[0]
            elif not mode.copies:
                if loaded:  # reported loaded, but no write into parameter storage was seen
                    plan.kind = "fallback"
                    plan.reason = f"loader reports {sorted(loaded)[:3]} loaded without a copy into storage"
                else:
                    plan.kind, plan.reason = "ignored", "the loader does not store this tensor"
            else:
                plan.ops = [CopyOp(p, sg, dg) for (p, sg, dg, _) in mode.copies]
                plan.fills = list(mode.fills)
                mism = self._verify(plan, scratch)
                if mism:
                    plan.kind, plan.ops = "fallback", []
                    plan.reason = f"stored bits of {mism} differ from the checkpoint (post-load transform)"
        self.plans[name] = plan
        return plan

    def finish(self) -> None:
        """After all probes: tensors whose writes overlap (the same storage element written twice —
        a replayed XOR would cancel, a constant fill would be overwritten) fall back to the native
        loader."""
        by_param: dict[str, list[TensorPlan]] = {}
        for plan in self.plans.values():
            for pname in {op.param for op in plan.ops} | {f[0] for f in plan.fills}:
                by_param.setdefault(pname, []).append(plan)
        for pname, plans in by_param.items():
            t = self._tensors[pname]
            cnt = torch.zeros(t.untyped_storage().nbytes() // t.element_size(), dtype=torch.uint8,
                              device=t.device)
            for plan in {id(p): p for p in plans}.values():
                geoms = [op.dst for op in plan.ops if op.param == pname]
                geoms += [g for (p, g, _) in plan.fills if p == pname]
                for g in geoms:
                    v = g.view(cnt)
                    v += 1
            if int(cnt.max()) > 1:
                for plan in plans:
                    if plan.kind == "affine":
                        plan.kind, plan.ops = "fallback", []
                        plan.reason = f"the loader writes some elements of {pname} more than once"

    def _device(self) -> torch.device:
        for t in self._tensors.values():
            return t.device
        return torch.device("cpu")

    def _restore(self, before) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for n, (ptr, _, _, data) in before.items():
            p = params.get(n)
            if p is not None and p.data_ptr() != ptr:
                p.data = data

    def _verify(self, plan: TensorPlan, scratch: torch.Tensor) -> str | None:
        """The parameter that does not hold the checkpoint bits where the loader would copy them."""
        flat_src = scratch.reshape(-1)
        for op in plan.ops:
            flat_dst = _storage_flat(self._tensors[op.param])
            if not torch.equal(int_view(op.src.view(flat_src)), int_view(op.dst.view(flat_dst))):
                return op.param
        for pname, geom, value in plan.fills:
            region = geom.view(_storage_flat(self._tensors[pname]))
            if not torch.equal(int_view(region), int_view(torch.full_like(region, value))):
                return pname
        return None

    def summary(self) -> dict[str, tuple[str, str]]:
        """name -> (kind, reason)."""
        return {n: (p.kind, p.reason) for n, p in self.plans.items()}

    # -- apply -------------------------------------------------------------------------------------
    @torch.no_grad()
    def apply(self, items: Sequence[tuple]) -> int:
        """Write items ``(name, encoding, lo, hi, positions | None, values)`` into live storage.

        ``encoding`` is ``xor`` / ``ow`` (sparse, ``positions`` absolute flat indices) or ``dense``
        (``values`` for ``[lo, hi)``); ``values`` are unsigned integers of the tensor's element size.
        Every write is computed and checked before the first one lands. Returns elements written.
        """
        device = self._device()
        writes = []
        for name, enc, lo, hi, positions, values in items:
            plan = self.plans.get(name)
            if plan is None or plan.kind != "affine":
                why = "never probed" if plan is None else f"{plan.kind}: {plan.reason}"
                raise BackendError(f"{name} has no captured copy plan ({why}); it must go through the "
                                   f"native loader (host mirror)")
            w = torch.empty((), dtype=plan.dtype).element_size()
            vals = np.ascontiguousarray(values)
            if vals.dtype.itemsize != w:
                raise BackendError(f"{name}: values of {vals.dtype.itemsize} bytes for a {plan.dtype} tensor")
            numel = 1
            for s in plan.shape:
                numel *= s
            if enc == "dense":
                if not (0 <= lo <= hi <= numel) or len(vals) != hi - lo:
                    raise BackendError(f"{name}: dense range [{lo}, {hi}) with {len(vals)} values is invalid")
                pos = torch.arange(lo, hi, dtype=torch.int64, device=device)
            elif enc in ("xor", "ow"):
                p = np.asarray(positions, dtype=np.int64)
                if len(p) != len(vals) or (len(p) and (int(p.min()) < 0 or int(p.max()) >= numel)):
                    raise BackendError(f"{name}: {len(p)} positions for {len(vals)} values, or out of range")
                pos = torch.from_numpy(p).to(device)
            else:
                raise BackendError(f"{name}: unknown encoding {enc!r}")
            vt = torch.from_numpy(vals.view(_NP_SIGNED[w])).to(device)
            for op in plan.ops:
                valid, dpos = map_positions(pos, op.src, op.dst)
                if not bool(valid.all()):
                    dpos, v = dpos[valid], vt[valid]
                else:
                    v = vt
                if dpos.numel():
                    writes.append((op.param, dpos, v, enc == "xor"))
        n = 0
        for pname, dpos, v, xor in writes:
            scatter(int_view(_storage_flat(self._tensors[pname])), dpos, v, xor=xor)
            n += dpos.numel()
        return n

    @torch.no_grad()
    def readback(self, name: str) -> torch.Tensor:
        """The canonical tensor ``name`` as live storage holds it (CPU), for checks.

        Raises :class:`BackendError` unless the recorded copies cover every element (e.g. with tensor
        parallelism a rank holds only its shard).
        """
        plan = self.plans[name]
        if plan.kind != "affine":
            raise BackendError(f"{name} is not stored through captured copies ({plan.kind}: {plan.reason})")
        device = self._device()
        numel = 1
        for s in plan.shape:
            numel *= s
        out = torch.empty(numel, dtype=plan.dtype, device=device)
        covered = torch.zeros(numel, dtype=torch.bool, device=device)
        for op in plan.ops:
            src_flat = _storage_flat(self._tensors[op.param])
            op.src.view(out).copy_(op.dst.view(src_flat))
            op.src.view(covered).fill_(True)
        if not bool(covered.all()):
            raise BackendError(f"{name}: this worker holds only part of the tensor (sharded); read it "
                               f"back from the host mirror or a dense reference instead")
        return out.reshape(plan.shape).cpu()


def reprocess_aliases(model: torch.nn.Module, loaded_modules: set[str]) -> list[str]:
    """Re-run the post-load processing of modules that share a parameter with a reloaded module.

    Only modules whose own parameter still aliases freshly loaded (model-format) storage qualify, so
    the processing sees exactly what it saw at start-up. Returns the modules processed.
    """
    fresh = set()
    for path in loaded_modules:
        try:
            mod = model.get_submodule(path) if path else model
        except AttributeError:
            continue
        for p in mod.parameters(recurse=False):
            k = _storage_key(p)
            if k is not None:
                fresh.add(k)
    done = []
    for path, mod in model.named_modules():
        if path in loaded_modules:
            continue
        qm = getattr(mod, "quant_method", None)
        if qm is None or not callable(getattr(qm, "process_weights_after_loading", None)):
            continue
        if any(_storage_key(p) in fresh for p in mod.parameters(recurse=False)):
            qm.process_weights_after_loading(mod)
            if hasattr(mod, "update_param_tp_status"):
                mod.update_param_tp_status()
            done.append(path)
    return done


# ---------------------------------------------------------------------------------------------------
# checkpoint reading (shared with the backend)
# ---------------------------------------------------------------------------------------------------
def checkpoint_files(directory: str) -> list[str]:
    """The ``*.safetensors`` files of a Hugging Face checkpoint directory, sorted."""
    import glob
    import os

    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise BackendError(f"no *.safetensors files in {directory!r}: the vLLM backend needs a Hugging Face "
                           f"checkpoint directory (dcr_ray.models.save_checkpoint writes one)")
    return files


def iter_checkpoint(files: Sequence[str], names: Iterable[str] | None = None):
    """Yield ``(name, CPU tensor)`` from safetensors ``files`` one tensor at a time (``names``: a subset)."""
    from safetensors import safe_open

    want = None if names is None else set(names)
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as fh:
            for k in fh.keys():
                if want is None or k in want:
                    yield k, fh.get_tensor(k)


# ---------------------------------------------------------------------------------------------------
# the worker extension
# ---------------------------------------------------------------------------------------------------
class DcrWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); called through ``collective_rpc``.

    Every method runs in each worker process (one per tensor-parallel rank) and returns plain data.
    """

    def dcr_fused_groups(self, names: list[str]) -> dict[str, Any]:
        """See :func:`fused_groups` (computed on this worker's model)."""
        return fused_groups(self.get_model(), names)

    def dcr_reload(self, items: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """Push whole fused groups of canonical tensors through vLLM's ``reload_weights``.

        A module that only *aliases* a reloaded parameter (tied embeddings: ``lm_head`` shares
        ``embed_tokens.weight`` and no checkpoint name loads it) is not processed by vLLM's reload,
        so its kernel-format state (on CPU the packed GEMM weight) would keep the old values. A fresh
        start processes it after loading; so do we: :func:`reprocess_aliases`.
        """
        model = self.get_model()
        modules = set()
        for name, _ in items:
            mapped = _map_hf_name(model, name)
            if mapped is not _IGNORED:
                mod = loading_module(model, mapped)
                modules.add(mapped.rpartition(".")[0] if mod is None else mod)
        with quiet_partial_reload():
            self.reload_weights(weights_iterator=list(items))
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            experts = reprocess_moe_experts(model, modules)
            again = reprocess_aliases(model, modules)
        return {"tensors": len(items), "reprocessed": again + experts}

    def dcr_storage_digests(self) -> dict[str, str]:
        """See :func:`storage_digests` (this worker's model)."""
        return storage_digests(self.get_model())

    def dcr_device(self) -> str:
        """The device the model's parameters live on (``cpu``, ``cuda:0``, ...)."""
        for p in self.get_model().parameters():
            return str(p.device)
        return "cpu"

    def dcr_capture_prepare(self, files: list[str], names: list[str] | None = None) -> dict:
        """Classify the loader path of every checkpoint tensor (see :class:`LoaderCapture`).

        Must run while live storage holds the checkpoint's bits (right after start-up). Returns
        ``name -> (kind, reason)``.
        """
        from vllm.config import set_current_vllm_config

        cap = LoaderCapture(self.get_model(), context=lambda: set_current_vllm_config(self.vllm_config))
        for name, t in iter_checkpoint(files, names):
            cap.probe(name, t)
        cap.finish()
        self._dcr_capture = cap
        return cap.summary()

    def dcr_capture_apply(self, items: list[tuple]) -> int:
        """Sparse XOR / OVERWRITE writes into live storage through the captured copies."""
        cap = getattr(self, "_dcr_capture", None)
        if cap is None:
            raise BackendError("dcr_capture_apply before dcr_capture_prepare")
        n = cap.apply(items)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return n

    def dcr_capture_readback(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Canonical tensors as live storage holds them (CPU copies; for checks)."""
        cap = getattr(self, "_dcr_capture", None)
        if cap is None:
            raise BackendError("dcr_capture_readback before dcr_capture_prepare")
        return {n: cap.readback(n) for n in names}


def strict_check(summary: Mapping[str, tuple[str, str]]) -> None:
    """Raise :class:`LoaderCaptureError` naming every tensor the capture path cannot follow."""
    bad = {n: r for n, (k, r) in summary.items() if k == "fallback"}
    if bad:
        lines = "; ".join(f"{n}: {r}" for n, r in sorted(bad.items())[:8])
        raise LoaderCaptureError(
            f"{len(bad)} tensor(s) cannot be written through captured loader copies ({lines}"
            f"{' ...' if len(bad) > 8 else ''}); use VllmBackend(mode='mirror') or strict_capture=False")
