"""The data model of a loader capture: strided geometries, recorded copies, and each tensor's plan.

A :class:`TensorPlan` says how one checkpoint tensor reaches parameter storage, decided once at start-up
by :class:`~dcr_ray.engines.vllm.worker.capture.LoaderCapture`: ``affine`` tensors are written sparsely
through their recorded :class:`CopyOp` geometries (:func:`map_positions`), the rest go through the
native loader. :func:`merge_summaries` joins the per-rank verdicts; :func:`strict_check` fails closed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from dcr_ray.errors import LoaderCaptureError


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

    def row_major(self) -> bool:
        """True when the view's elements, in row-major order, are consecutive storage elements from
        ``offset`` (a contiguous block: a whole tensor, or a slice of it along its first dimension)."""
        expect = 1
        for sz, st in zip(reversed(self.shape), reversed(self.stride)):
            if sz > 1 and st != expect:
                return False
            expect *= sz
        return True

    def view(self, storage_flat: torch.Tensor) -> torch.Tensor:
        """This geometry as a view of a flat (1-D, offset 0) tensor over the same storage."""
        return torch.as_strided(storage_flat, self.shape, self.stride, self.offset)


def map_positions(pos: torch.Tensor, src: Geometry, dst: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    """Map canonical flat positions through one recorded copy ``dst <- src``.

    ``pos`` (int64) are element positions in the canonical tensor (the scratch the loader read). Returns
    ``(valid, dst_pos)``: which positions the copy read, and for those, the storage element it wrote.
    Requires a non-overlapping ``src`` (checked at prepare), so the decomposition is unique. A copy between
    two contiguous blocks of one shape (most copies: a whole tensor, or a part of a fused one) is a shift of
    the positions, done in a few passes; any other decomposes each position dimension by dimension.
    """
    if src.shape == dst.shape and src.row_major() and dst.row_major():
        lo, hi = src.offset, src.offset + src.numel
        if pos.numel() == 0:
            return torch.ones(0, dtype=torch.bool, device=pos.device), pos.clone()
        least, most = torch.aminmax(pos)
        if int(least) >= lo and int(most) < hi:
            valid = torch.ones(pos.shape, dtype=torch.bool, device=pos.device)
        else:
            valid = (pos >= lo) & (pos < hi)
        return valid, pos + (dst.offset - src.offset)
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


def merge_summaries(per_rank: Iterable[Mapping[str, tuple[str, str]]]) -> dict[str, tuple[str, str]]:
    """One ``name -> (kind, reason)`` for the engine from every rank's :meth:`LoaderCapture.summary`:
    a tensor is affine only when it is affine on every rank (else the last non-affine rank's verdict)."""
    summary: dict[str, tuple[str, str]] = {}
    for rank_summary in per_rank:
        for n, (kind, reason) in rank_summary.items():
            if n not in summary or kind != "affine":
                summary[n] = (kind, reason)
    return summary


def strict_check(summary: Mapping[str, tuple[str, str]]) -> None:
    """Raise :class:`LoaderCaptureError` naming every tensor the capture path cannot follow."""
    bad = {n: r for n, (k, r) in summary.items() if k == "fallback"}
    if bad:
        lines = "; ".join(f"{n}: {r}" for n, r in sorted(bad.items())[:8])
        raise LoaderCaptureError(
            f"{len(bad)} tensor(s) cannot be written through captured loader copies ({lines}"
            f"{' ...' if len(bad) > 8 else ''}); use VllmBackend(mode='mirror') or strict_capture=False")
