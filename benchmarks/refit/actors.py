"""What runs inside the benchmark's Ray actors: owners, trainer, engine backend, and the probes they answer.

:class:`BenchOwner` holds synthetic BF16 tensors with a model's canonical names and shapes and perturbs
them; :class:`BenchTrainer` is a real AdamW trainer. Both mix in the probes (fingerprints, peer
measurements). :class:`SyntheticEngine` builds the light receiver of the stress cases.
"""

from __future__ import annotations

import hashlib
import math
import os
import time

import numpy as np

from dcr_ray.actors.owner.delta import stable_hash
from dcr_ray.actors.owner.held import OwnerMixin
from benchmarks.refit.settings import PEERS
from dcr_ray.engines.base import TensorBackend
from dcr_ray.testing.trainer import TinyTrainer


def canonical_shapes(size: str, arch: str = "qwen2") -> dict[str, tuple[int, ...]]:
    """Canonical (Hugging Face) names and shapes of ``ModelSpec(size=size)``, without allocating it."""
    import torch
    from transformers import AutoModelForCausalLM

    from dcr_ray.testing.models import ModelSpec, hf_config

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(hf_config(ModelSpec(size=size, arch=arch)))
    return {n: tuple(t.shape) for n, t in m.state_dict().items()}


def _digests(tensors) -> dict[str, str]:
    """SHA-256 of each tensor's integer view (bit-exact fingerprints)."""
    from dcr_ray.codec.bits import bits_view

    return {n: hashlib.sha256(memoryview(bits_view(t))).hexdigest() for n, t in tensors.items()}


def actor_pid(_self) -> int:
    """The process id of an actor (run in it with ``__ray_call__``)."""
    return os.getpid()


def engine_digests(self) -> dict[str, str]:
    """An engine actor's fingerprints of its tensors (run in it with ``__ray_call__``)."""
    return _digests(self.tensors())


def engine_apply_stats(self) -> dict:
    """An engine actor's apply seconds of its last refit (validate + apply + flush, what its ACK reported;
    kept until the next ``prepare``), the backend flush's share of them (after :func:`time_backend_flush`)
    and, for vLLM, its last flush's counts (run in it with ``__ray_call__``)."""
    stats = self.stats()
    return {"apply_s": stats["apply_s"], "flush_s": getattr(self.backend, "bench_flush_s", None),
            "flush": stats["backend_flush"]}


def time_backend_flush(self) -> None:
    """Time the backend's ``flush`` (vLLM: reload of the touched fused groups into the runtime) in an engine
    actor from now on (run in it with ``__ray_call__``); the time lands in ``backend.bench_flush_s``."""
    backend = self.backend
    inner = backend.flush

    def flush():
        t = time.perf_counter()
        try:
            inner()
        finally:
            backend.bench_flush_s = time.perf_counter() - t

    backend.flush = flush


class _Probe:
    """Benchmark methods mixed into the owner actors (they run in the owner's process)."""

    bench_baseline = "memory"
    _bench_saved_level: int | None = None

    def bench_set_baseline(self, kind: str) -> None:
        """``"memory"``: the baseline in memory (the library's default); ``"mmap"``: memory-mapped files in
        the temporary directory (what ``OwnerConfig.baseline_dir`` gives)."""
        self.bench_baseline = kind

    def dcr_attach(self, owner_id, config, baseline_dir=None, in_memory=False, version=0):
        import tempfile

        if self.bench_baseline == "mmap" and baseline_dir is None:
            baseline_dir = tempfile.gettempdir()
        return super().dcr_attach(owner_id, config, baseline_dir, in_memory, version)

    def bench_digests(self) -> dict[str, str]:
        return _digests(self.dcr_tensors())

    def bench_uncompressed_frames(self, on: bool) -> None:
        """Frames built in this owner carry raw (uncompressed) sections while ``on``: the measured
        full-checkpoint reference sends the canonical bytes themselves (see :mod:`.reference`)."""
        import dataclasses

        owner = self.dcr_delta_owner()
        codec = owner.config.codec
        if on and self._bench_saved_level is None:
            self._bench_saved_level = codec.zstd_level
            level = 0  # CodecConfig(zstd_level=0): sections stored raw
        elif not on and self._bench_saved_level is not None:
            level, self._bench_saved_level = self._bench_saved_level, None
        else:
            return
        owner.config = dataclasses.replace(owner.config, codec=dataclasses.replace(codec, zstd_level=level))

    def bench_before_refit(self) -> None:
        """Write the memory-mapped baseline back (every page clean, as after the kernel's writeback) and
        record what this refit's promote writes (:mod:`.pages`)."""
        from benchmarks.refit.pages import write_back

        owner = self.dcr_delta_owner()
        owner.settle()
        store = owner.store
        if getattr(store, "bench_inner_promote", None) is None:
            store.bench_inner_promote = store.promote
            store.promote = lambda version: _timed_promote(store, version)
        write_back({id(a): a for a in (_mapping_of(store.bits(n)) for n in store.names())}.values())
        store.bench_promote_s = None
        store.bench_changes = []

    def bench_after_refit(self) -> dict:
        """What the last promote did: its seconds, the pages that held a change, the pages it dirtied
        (None for in-memory baselines) and the tensors it touched."""
        from benchmarks.refit.pages import count_pages, dirty_pages

        owner = self.dcr_delta_owner()
        owner.settle()
        store = owner.store
        changes = getattr(store, "bench_changes", None) or []
        return {"promote_s": getattr(store, "bench_promote_s", None),
                "changed_pages": count_pages(changes),
                "dirty_pages": None if store.in_memory else dirty_pages(store.directory),
                "tensors": len({name for name, _, _ in changes if name is not None}),
                "baseline_pages": sum(-(-store.bits(n).nbytes // 4096) for n in store.names())}

    def bench_tensors(self, names: list[str]) -> dict:
        ts = self.dcr_tensors()
        return {n: ts[n] for n in names}

    def bench_names(self) -> list[str]:
        return list(self.dcr_tensors())

    def bench_peers(self) -> dict:
        """Measure the peers' construction and apply on this owner's change (current vs committed bits).

        Construction = bitwise diff (flatnonzero of ``old != new``, timed once, shared by both sparse
        peers) + the peer's encode; apply = the peer's decoder into a copy of the committed bits (copy
        not timed); every result is checked bit for bit. ``dense`` streams the raw bits (no
        construction); its apply is a copy.
        """
        import numpy as np

        from benchmarks import peers
        from dcr_ray.codec.bits import bits_view

        store = self.dcr_delta_owner().store
        cur = self.dcr_tensors()
        out = {p: {"construct_s": 0.0, "apply_s": 0.0, "bytes": 0, "exact": True} for p in PEERS}
        for name in store.names():
            old, new = store.bits(name), bits_view(cur[name])
            hdr = peers.TENSOR_HEADER_BYTES + len(name.encode())
            tgt = np.array(old)
            t = time.perf_counter()
            np.copyto(tgt, new)
            out["dense"]["apply_s"] += time.perf_counter() - t
            out["dense"]["bytes"] += new.nbytes + hdr
            t = time.perf_counter()
            pos = np.flatnonzero(old != new)
            t_diff = time.perf_counter() - t
            if not len(pos):
                continue
            for p in ("areal", "slime"):
                enc, app = peers.PEERS[p]
                t = time.perf_counter()
                payload = enc(pos, new, len(new))
                out[p]["construct_s"] += t_diff + time.perf_counter() - t
                out[p]["bytes"] += len(payload) + hdr
                np.copyto(tgt, old)
                t = time.perf_counter()
                app(payload, tgt)
                out[p]["apply_s"] += time.perf_counter() - t
                out[p]["exact"] &= bool(np.array_equal(tgt, new))
        return out


def _mapping_of(arr):
    """The memory map an array lives in (an arena slice's block), so each map is written back once."""
    while getattr(arr, "base", None) is not None and isinstance(arr.base, np.ndarray):
        arr = arr.base
    return arr


def _timed_promote(store, version: int) -> int:
    """``store.promote`` timed, keeping for :meth:`_Probe.bench_after_refit` where its changes were: the
    sparse chunks themselves (positions decoded later, off the refit's path) and, for the rare DENSE
    chunk, the positions that differ from the committed bits (compared before they are overwritten)."""
    from dcr_ray.codec.encoding.baseline import chunk_changes
    from dcr_ray.codec.encoding.packdiff import PackDelta

    changes = []
    pack_pages = []  # arena tensors share pages: count them by address
    for td in store.pending():
        if isinstance(td, PackDelta):
            pack_pages.append(store.pack_change_addresses(td))
            changes.extend((n, 1, lambda: np.empty(0, np.int64)) for n in td.names)
            continue
        arr = store.bits(td.name)
        for ch in td.chunks:
            if ch.is_dense:
                pos = chunk_changes(arr, ch)
                changes.append((td.name, arr.dtype.itemsize, lambda pos=pos: pos))
            else:
                changes.append((td.name, arr.dtype.itemsize, ch.positions))
    if pack_pages:
        every = np.concatenate(pack_pages)
        changes.append((None, 1, lambda: np.unique(every)))  # pages of every pack; no tensor of its own
    t = time.perf_counter()
    n = store.bench_inner_promote(version)
    store.bench_promote_s = time.perf_counter() - t
    store.bench_changes = changes
    return n


class BenchOwner(_Probe, OwnerMixin):
    """An owner actor that makes its own synthetic BF16 tensors and perturbs them in place."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int = 0):
        import torch

        torch.set_num_threads(1)
        self.held: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            g = torch.Generator().manual_seed((seed * 1_000_003 + stable_hash(name)) % (1 << 62))
            self.held[name] = torch.randn(shape, generator=g).mul_(0.02).to(torch.bfloat16)

    def dcr_tensors(self):
        return self.held

    def perturb(self, rate: float, seed: int) -> dict:
        """Change a uniform ``rate`` of every tensor's elements by a relative ``1e-2 * randn``.

        Positions are Bernoulli(``rate``) (geometric gaps); an element whose value rounds back to
        its old bits is moved by one ulp, so every chosen element changes its bits.
        """
        import numpy as np
        import torch

        from dcr_ray.codec.bits import bits_view

        t0 = time.perf_counter()
        changed = numel = 0
        for name, t in self.held.items():
            n = t.numel()
            rng = np.random.default_rng([seed, stable_hash(name) % (1 << 32)])
            gaps = rng.geometric(rate, size=int(n * rate + 6 * math.sqrt(n * rate) + 16))
            pos = np.cumsum(gaps) - 1
            pos = pos[pos < n]
            bits = bits_view(t)
            if len(pos):
                ti = torch.from_numpy(pos)
                old = t.reshape(-1)[ti].float()
                noise = torch.from_numpy(rng.standard_normal(len(pos), dtype=np.float32))
                nb = bits_view((old * (1 + 1e-2 * noise)).to(torch.bfloat16)).copy()
                same = nb == bits[pos]
                nb[same] ^= 1
                bits[pos] = nb
            changed += len(pos)
            numel += n
        return {"changed": changed, "numel": numel, "seconds": time.perf_counter() - t0}


class BenchTrainer(_Probe, TinyTrainer):
    """The real-update owner: :class:`~dcr_ray.testing.trainer.TinyTrainer` plus the benchmark probes."""


class SyntheticBackend(TensorBackend):
    """A light receiver: canonical BF16 tensors applied in place exactly like the transformers backend,
    undo record included (the engine's default in-place rollback keeps the bits each write replaces, in
    the pass that writes them), so the benchmark pays what a ``transformers`` engine pays."""

    applies_packs = True

    def __init__(self, shapes: dict[str, tuple[int, ...]], tensors: dict | None = None):
        """BF16 zeros of ``shapes``, or ``tensors`` themselves (held, not copied) where given."""
        import torch

        self._tensors = tensors if tensors is not None else {
            n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}

    def tensors(self):
        return self._tensors

    def apply(self, frame) -> None:
        from dcr_ray.codec import apply_decoded

        apply_decoded(frame, self._tensors)

    def apply_with_undo(self, frame, undo) -> None:
        from dcr_ray.codec import apply_decoded

        apply_decoded(frame, self._tensors, undo=undo)

    def undo_tensors(self):
        return self._tensors

    def load_dense(self, tensors) -> None:
        from dcr_ray.codec.bits import bits_view

        for name, t in tensors:
            bits_view(self._tensors[name])[:] = bits_view(t.contiguous())


class SyntheticEngine:
    """Engine factory for :class:`SyntheticBackend` (picklable; builds in the engine process)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = dict(shapes)

    def __call__(self) -> SyntheticBackend:
        return SyntheticBackend(self.shapes)
