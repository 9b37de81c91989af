"""Loader capture: where a model's own loader puts each checkpoint tensor, recorded once, replayed sparsely.

For parameters the engine computes from (CUDA; vLLM-CPU with its weights unpacked,
:mod:`~dcr_ray.engines.vllm.worker.unpacked`). :class:`LoaderCapture` runs the model's native ``load_weights``
once per checkpoint tensor on a scratch tensor of canonical shape, under a ``TorchDispatchMode`` that
sees each ``aten.copy_`` the loader makes into parameter storage and records its geometry (a strided
view of the scratch -> a strided view of the parameter) *instead of* performing it. Checkpoint tensors
whose every final copy is such an affine, same-dtype, non-overlapping view copy (besides constant
fills, e.g. zeroed vocabulary padding, which every load rewrites identically) — and whose live storage
holds exactly the checkpoint's bits at the recorded places — are *affine*: a frame's changed positions
are mapped through the recorded geometry (pure index arithmetic) and written as sparse XOR / OVERWRITE
into live storage. Everything else (dtype conversions, temporaries, other in-place ops, parameters
re-bound, post-load transforms, overlapping writes, loader errors) is classified once at prepare and
handled through the host-mirror path instead (whole fused groups, :mod:`~dcr_ray.engines.vllm.worker.groups`),
or — with ``VllmBackend(strict_capture=True)`` — fails closed with a
:class:`~dcr_ray.errors.LoaderCaptureError` naming the tensors
(:func:`~dcr_ray.engines.vllm.worker.plan.strict_check`).

The capture core is plain PyTorch and device-agnostic: it is unit-tested on CPU with stand-in loaders, and
runs end to end on vLLM-CPU engines with unpacked weights. Being probed is not proof that a write reaches
what the engine computes with (a layer may compute from a copy made at load): the receiver's start-up check
(:func:`~dcr_ray.engines.vllm.worker.startup.stale_captures`) proves that, and :meth:`LoaderCapture.demote`
sends the tensors it refutes through the native loader. ``ADD`` items read the old bits only at their
positions; class-order items read the whole tensor back (their walk needs its range), which a rank holding
only a shard of it cannot (:meth:`LoaderCapture.readback` says so; the refit then retries). Each write can
keep the bits it replaces (``apply(undo=...)``, :meth:`LoaderCapture.undo`). On CUDA the sparse writes use
``cuda_ext``'s scatter kernels when CuPy is importable, else PyTorch indexing
(:func:`~dcr_ray.engines.vllm.worker.storage.scatter`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dcr_ray.codec import DecodedItem, Encoding
from dcr_ray.codec.bits import bits_view, np_int, np_uint, torch_int
from dcr_ray.codec.decoding import context
from dcr_ray.engines.vllm.worker.plan import CopyOp, Geometry, TensorPlan, map_positions
from dcr_ray.engines.vllm.worker.storage import int_view, scatter, storage_flat, storage_key
from dcr_ray.errors import BackendError


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


_FILLS = (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default)


class _CaptureMode(TorchDispatchMode):
    """Records (and skips) a loader's writes into parameter storage; lets every other op run."""

    def __init__(self, storages: Mapping[tuple, str], scratch: torch.Tensor):
        super().__init__()
        self.storages = storages
        self.scratch = scratch
        self.scratch_key = storage_key(scratch)
        self.copies: list[tuple[str, Geometry | None, Geometry, str]] = []
        self.fills: list[tuple[str, Geometry, Any]] = []
        self.other: list[str] = []

    def _param_of(self, t) -> str | None:
        if not isinstance(t, torch.Tensor):
            return None
        k = storage_key(t)
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
        if storage_key(src) != self.scratch_key:
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
        k = storage_key(t)
        if k is None or k in storages:
            continue
        storages[k] = name
        tensors[name] = t.detach()  # a view that keeps pointing at this storage
    return storages, tensors


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
            flat_dst = storage_flat(self._tensors[op.param])
            if not torch.equal(int_view(op.src.view(flat_src)), int_view(op.dst.view(flat_dst))):
                return op.param
        for pname, geom, value in plan.fills:
            region = geom.view(storage_flat(self._tensors[pname]))
            if not torch.equal(int_view(region), int_view(torch.full_like(region, value))):
                return pname
        return None

    def summary(self) -> dict[str, tuple[str, str]]:
        """name -> (kind, reason)."""
        return {n: (p.kind, p.reason) for n, p in self.plans.items()}

    # -- apply -------------------------------------------------------------------------------------
    @torch.no_grad()
    def apply(self, items: Iterable[DecodedItem], undo: list | None = None) -> int:
        """Write decoded frame items into live storage: :meth:`write` of :meth:`prepare`. Returns elements
        written."""
        return self.write(self.prepare(items), undo)

    @torch.no_grad()
    def prepare(self, items: Iterable[DecodedItem]) -> list[tuple[str, torch.Tensor, torch.Tensor, bool]]:
        """Decoded frame items (:class:`~dcr_ray.codec.DecodedItem`) as the writes into live storage they
        make, every one checked and mapped through the recorded copies; nothing is written. A receiver that
        stages frames prepares them while the engine serves, so its pause holds only :meth:`write`.

        ``encoding`` is ``XOR`` / ``OVERWRITE`` (sparse, ``positions`` absolute flat indices), ``DENSE``
        (``values`` for ``[lo, hi)``) or ``ADD`` (made an ``OVERWRITE`` against the bits live storage holds
        now: prepare before any other write to the same tensor); ``values`` are unsigned integers of the
        tensor's element size. Returns ``(parameter, storage positions, values, xor)`` per write; a
        ``DENSE`` item stays ``(name, (lo, hi), values, None)`` until :meth:`write` maps it (its positions
        would take four times its values' memory, and only a bootstrap sends whole tensors).
        """
        device = self._device()
        writes = []
        items = self._absolute(items)
        for it in items:
            name, enc, lo, hi, positions, values = it.name, it.encoding, it.lo, it.hi, it.positions, it.values
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
            if enc == Encoding.DENSE:
                if not (0 <= lo <= hi <= numel) or len(vals) != hi - lo:
                    raise BackendError(f"{name}: dense range [{lo}, {hi}) with {len(vals)} values is invalid")
                writes.append((name, (lo, hi), torch.from_numpy(vals.view(np_int(w))), None))
                continue
            elif enc in (Encoding.XOR, Encoding.OVERWRITE):
                p = np.asarray(positions, dtype=np.int64)
                if len(p) != len(vals) or (len(p) and (int(p.min()) < 0 or int(p.max()) >= numel)):
                    raise BackendError(f"{name}: {len(p)} positions for {len(vals)} values, or out of range")
                pos = torch.from_numpy(p).to(device)
            else:
                raise BackendError(f"{name}: unknown encoding {enc!r}")
            writes += self._mapped(plan, pos, torch.from_numpy(vals.view(np_int(w))).to(device), enc == Encoding.XOR)
        return writes

    @staticmethod
    def _mapped(plan: TensorPlan, pos: torch.Tensor, vt: torch.Tensor, xor: bool) -> list:
        """Canonical positions ``pos`` and their values, as writes through each of ``plan``'s copies."""
        out = []
        for op in plan.ops:
            valid, dpos = map_positions(pos, op.src, op.dst)
            v = vt
            if not bool(valid.all()):
                dpos, v = dpos[valid], vt[valid]
            if dpos.numel():
                out.append((op.param, dpos, v, xor))
        return out

    @torch.no_grad()
    def write(self, writes: list[tuple[str, torch.Tensor, torch.Tensor, bool]], undo: list | None = None) -> int:
        """Make the writes of :meth:`prepare` in live storage, in order. With ``undo`` (a list), the bits each
        write replaces are appended to it first, so :meth:`undo` can put them back. Returns elements written."""
        n = 0
        for pname, dpos, v, xor in self._expanded(writes):
            flat = int_view(storage_flat(self._tensors[pname]))
            if undo is not None:  # the bits this write replaces, kept before it lands
                undo.append((pname, dpos, flat.index_select(0, dpos)))
            scatter(flat, dpos, v, xor=xor)
            n += dpos.numel()
        return n

    def _expanded(self, writes: list):
        """The writes, each ``DENSE`` item mapped now (one at a time)."""
        for w in writes:
            if w[3] is not None:
                yield w
                continue
            name, (lo, hi), vt, _ = w
            pos = torch.arange(lo, hi, dtype=torch.int64, device=self._device())
            yield from self._mapped(self.plans[name], pos, vt.to(pos.device), False)

    def _absolute(self, items: Iterable[DecodedItem]) -> list[DecodedItem]:
        """``items`` as absolute writes: class-order positions resolved against the canonical bits read back
        (the whole tensor: the walk reads its range), every ``ADD`` item turned into the ``OVERWRITE`` of the
        bits it gives, reading the old bits only at its positions (O(changes); a rank that holds a shard of
        the tensor reads what it holds, and writes only that)."""
        items = list(items)
        full = {n: self.readback(n) for n in {it.name for it in items if it.positions is None and it.ranks is not None}}
        context.resolve([it for it in items if it.name in full], full)
        out = []
        for it in items:
            if it.encoding == Encoding.ADD:
                old = bits_view(full[it.name])[it.positions] if it.name in full else self._gather(it.name, it.positions)
                it = DecodedItem(it.name, Encoding.OVERWRITE, it.lo, it.hi, it.positions, old + it.values)
            out.append(it)
        return out

    def _gather(self, name: str, positions) -> np.ndarray:
        """The canonical bits at flat ``positions`` of ``name`` as live storage holds them (unsigned; 0 where
        this rank holds none of them)."""
        plan = self.plans.get(name)
        if plan is None or plan.kind != "affine":
            raise BackendError(f"{name} is not stored through captured copies")
        w = torch.empty((), dtype=plan.dtype).element_size()
        pos = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(self._device())
        out = torch.zeros(len(pos), dtype=torch_int(w), device=pos.device)
        for op in plan.ops:
            valid, dpos = map_positions(pos, op.src, op.dst)
            out[valid] = int_view(storage_flat(self._tensors[op.param]))[dpos[valid]]
        return out.cpu().numpy().view(np_uint(w))

    @torch.no_grad()
    def undo(self, log: list) -> None:
        """Put back, newest first, the bits an :meth:`apply` recorded in ``log`` (O(changes))."""
        for pname, dpos, old in reversed(log):
            scatter(int_view(storage_flat(self._tensors[pname])), dpos, old, xor=False)

    def demote(self, names: Iterable[str], reason: str) -> None:
        """Send ``names`` through the native loader from now on (a start-up check found their captured
        writes do not reach what the engine computes with)."""
        for n in names:
            plan = self.plans.get(n)
            if plan is not None and plan.kind == "affine":
                plan.kind, plan.ops, plan.fills, plan.reason = "fallback", [], [], reason

    def writers_of(self, tensors: Iterable[torch.Tensor]) -> set[str]:
        """The affine checkpoint tensors whose captured copies write into the storage of any of ``tensors``."""
        keys = {storage_key(t) for t in tensors} - {None}
        names = {self._storages.get(k) for k in keys} - {None}
        return {n for n, p in self.plans.items() if p.kind == "affine" and any(op.param in names for op in p.ops)}

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
            src_flat = storage_flat(self._tensors[op.param])
            op.src.view(out).copy_(op.dst.view(src_flat))
            op.src.view(covered).fill_(True)
        if not bool(covered.all()):
            raise BackendError(f"{name}: this worker holds only part of the tensor (sharded); read it "
                               f"back from the host mirror or a dense reference instead")
        return out.reshape(plan.shape).cpu()
