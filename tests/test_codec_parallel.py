"""The codec's fast paths (threaded scan, parallel section (de)compression, blocked apply) give exactly
what the plain paths give: the same changed sets, the same frame bytes, the same bits after apply."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dcr_ray.codec import FrameMeta, apply_frame, bits_view, diff_tensor, encode_frames, read_frame
from dcr_ray.codec import format as wire
from dcr_ray.codec.decoding import apply, decode
from dcr_ray.codec.encoding import diff, encode, scan
from dcr_ray.errors import MalformedHeaderError, SizeLimitError

META = FrameMeta(transfer="t", attempt=0, producer="p", payload=0, base=0, target=1)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@pytest.mark.parametrize("jit", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [scan.PARALLEL_MIN_ELEMS + 3, 3 * scan.SCAN_BLOCK_ELEMS + 5])
def test_the_threaded_scan_finds_exactly_the_changed_elements(itemsize, n, jit, monkeypatch):
    from dcr_ray.codec.compiled import kernels

    if jit and not kernels.ENABLED:
        pytest.skip("numba is not installed (or DCR_RAY_JIT=0): only the numpy scan exists here")
    monkeypatch.setattr(kernels, "ENABLED", jit)
    rng = np.random.default_rng(itemsize * n)
    dt = _UINT[itemsize]
    old = rng.integers(0, np.iinfo(dt).max, n + 1, dtype=dt, endpoint=True)[1:]  # unaligned start
    new = old.copy()
    idx = np.concatenate([rng.choice(n, n // 50, replace=False), [0, n - 1]])
    new[idx] ^= rng.integers(1, np.iinfo(dt).max, len(idx), dtype=dt, endpoint=True)
    want = np.flatnonzero(old != new)
    for threads in (1, 2, 3):
        pos, xor, nv = scan.changes(old, new, threads)
        assert pos.dtype == np.int64 and np.array_equal(pos, want)
        assert np.array_equal(xor, old[want] ^ new[want]) and np.array_equal(nv, new[want])


def _bf16_pair(n, rate, seed):
    g = torch.Generator().manual_seed(seed)
    old = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    new = old.clone()
    nb = bits_view(new)
    idx = np.random.default_rng(seed).choice(n, int(n * rate), replace=False)
    nb[idx] ^= np.uint16(1)
    return old, new


def test_parallel_section_compression_gives_the_same_frame_bytes(monkeypatch):
    old, new = _bf16_pair(3 << 20, 0.05, 1)
    td = diff_tensor("w", bits_view(old).copy(), new)
    parallel = list(encode_frames([td], META))
    assert sum(len(s) for s in parallel) > 0
    monkeypatch.setattr(encode, "PARALLEL_MIN_RAW_BYTES", 1 << 62)
    serial = list(encode_frames([td], META))
    assert parallel == serial
    targets = {"w": old.clone()}
    for f in parallel:
        apply_frame(f, targets)
    assert torch.equal(targets["w"].view(torch.int16), new.view(torch.int16))


@pytest.mark.parametrize("mode", ["mixed", "overwrite"])
def test_items_longer_than_an_apply_block_apply_exactly(mode):
    old, new = _bf16_pair(1 << 21, 0.2, 2)
    td = diff_tensor("w", bits_view(old).copy(), new)
    assert max(c.count for c in td.chunks) > apply.APPLY_BLOCK
    targets = {"w": old.clone()}
    for f in encode_frames([td], META, mode=mode):
        apply_frame(f, targets)
    assert torch.equal(targets["w"].view(torch.int16), new.view(torch.int16))


def test_a_corrupt_section_of_a_large_frame_is_rejected_before_any_write():
    old, new = _bf16_pair(1 << 21, 0.05, 3)
    td = diff_tensor("w", bits_view(old).copy(), new)
    (data,) = encode_frames([td], META)
    decoded = read_frame(data)
    assert decoded.raw_bytes >= decode.PARALLEL_MIN_RAW_BYTES  # the parallel decompression path
    # corrupt the last section's body and re-sign (no key), so only decompression can notice
    buf = bytearray(data)
    body_end = len(buf) - wire.DIGEST_SIZE
    for i in range(body_end - 40, body_end - 8):
        buf[i] ^= 0x5A
    buf[-wire.DIGEST_SIZE:] = wire.digest(bytes(buf[4:body_end]), None)
    targets = {"w": old.clone()}
    with pytest.raises((MalformedHeaderError, SizeLimitError)):
        apply_frame(bytes(buf), targets)
    assert torch.equal(targets["w"].view(torch.int16), old.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.float8_e4m3fn, torch.bfloat16, torch.float16,
                                   torch.int32, torch.float32, torch.int64, torch.float64])
@pytest.mark.parametrize("mode", ["mixed", "overwrite"])
def test_compiled_and_numpy_apply_write_the_same_bits_for_every_width(monkeypatch, dtype, mode):
    from dcr_ray.codec.compiled import kernels

    if not kernels.ENABLED:
        pytest.skip("numba is not installed (or DCR_RAY_JIT=0): only the numpy path exists here")
    n = 3 * 4099 + 1
    w = torch.empty((), dtype=dtype).element_size()
    dt = _UINT[w]
    rng = np.random.default_rng(w)
    old_bits = rng.integers(0, 1 if dtype == torch.bool else np.iinfo(dt).max, n, dtype=dt, endpoint=True)
    new_bits = old_bits.copy()
    idx = rng.choice(n, n // 20, replace=False)
    new_bits[idx] = (new_bits[idx] ^ 1) if dtype == torch.bool else ~new_bits[idx]
    old = torch.from_numpy(old_bits).view(dtype)
    new = torch.from_numpy(new_bits).view(dtype)
    td = diff_tensor("w", old_bits.copy(), new, chunk_elems=4099)
    frames = list(encode_frames([td], META, mode=mode, bucket_bytes=1 << 12))
    results = {}
    for jit in (True, False):
        monkeypatch.setattr(kernels, "ENABLED", jit)
        targets = {"w": old.clone()}
        for f in frames:
            apply_frame(f, targets)
        results[jit] = targets["w"].view(torch.uint8 if w == 1 else getattr(torch, f"int{8 * w}"))
    want = new.view(results[True].dtype)
    assert torch.equal(results[True], want) and torch.equal(results[False], want)


def test_items_of_a_large_frame_decode_and_apply_on_several_threads_exactly(monkeypatch):
    old, new = _bf16_pair(1 << 21, 0.1, 4)
    td = diff_tensor("w", bits_view(old).copy(), new, chunk_elems=1 << 16)
    (data,) = encode_frames([td], META)
    got = {}
    for many in (True, False):
        if not many:
            monkeypatch.setattr(decode, "DECODE_PARALLEL_MIN", 1 << 62)
            monkeypatch.setattr(apply, "APPLY_PARALLEL_MIN", 1 << 62)
        decoded = read_frame(data)
        assert len(decoded.items) == len(td.chunks) > 1
        targets = {"w": old.clone()}
        apply.apply_decoded(decoded, targets)
        got[many] = [(it.lo, it.hi, it.positions.tolist(), it.values.tolist()) for it in decoded.items]
        assert torch.equal(targets["w"].view(torch.int16), new.view(torch.int16))
    assert got[True] == got[False]


def test_a_multi_chunk_tensor_gives_the_same_changed_set_on_one_thread_and_on_several(monkeypatch):
    old, new = _bf16_pair(5 * (1 << 17) + 3, 0.05, 5)
    sets = {}
    for n_threads in (1, 2, 3):
        for module in (diff, scan):  # chunks per thread (diff), blocks of a lone chunk per thread (scan)
            monkeypatch.setattr(module, "codec_threads", lambda n=n_threads: n)
        td = diff_tensor("w", bits_view(old).copy(), new, chunk_elems=1 << 17)
        sets[n_threads] = [(c.lo, c.hi, c.count, c.loc, c.xor.tolist(), c.new.tolist()) for c in td.chunks]
    assert len(sets[1]) >= 5 and sets[1] == sets[2] == sets[3]


def test_dcr_ray_jit_0_selects_the_numpy_path():
    import subprocess
    import sys

    code = "from dcr_ray.codec.compiled import kernels; print(kernels.ENABLED)"
    env = {**__import__("os").environ, "DCR_RAY_JIT": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_warming_up_the_kernels_loads_every_width_and_is_harmless_when_disabled(monkeypatch):
    import numpy as np

    from dcr_ray.codec.compiled import kernels

    if not kernels.ENABLED:
        pytest.skip("numba is not installed (or DCR_RAY_JIT=0): no kernels to warm")
    kernels.warm_up(background=False)
    compiled = kernels.compiled()
    for name in ("xor_into", "put_into", "add_into", "take_into", "class_starts"):
        # each kernel holds a compiled signature for every element width an owner or engine meets
        widths = {str(sig[0].dtype) for sig in compiled[name].signatures}
        assert {np.dtype(t).name for t in (np.uint8, np.uint16, np.uint32, np.uint64)} <= widths, name
    before = {name: len(d.signatures) for name, d in compiled.items()}
    monkeypatch.setattr(kernels, "ENABLED", False)
    kernels.warm_up(background=False)  # a no-op: nothing new is compiled or loaded
    assert {name: len(d.signatures) for name, d in compiled.items()} == before


def test_a_fresh_process_loads_every_warmed_kernel_from_numbas_cache_without_compiling():
    # Every owner and engine warms the kernels at start-up: a kernel that misses the on-disk cache is
    # compiled again in every process (seconds of CPU each; kernels that call kernels held in a closure did).
    import subprocess
    import sys

    from dcr_ray.codec.compiled import kernels

    if not kernels.ENABLED:
        pytest.skip("numba is not installed (or DCR_RAY_JIT=0): no kernels to cache")
    kernels.warm_up(background=False)  # fills the cache (or finds it filled)
    code = ("from dcr_ray.codec.compiled import kernels, ptrkernels\n"
            "kernels.warm_up(background=False)\n"
            "ds = {**kernels.compiled(), **{'ptr.' + k: v for k, v in ptrkernels.compiled().items()}}\n"
            "print({n: sum(d.stats.cache_misses.values()) for n, d in ds.items() if d.stats.cache_misses})\n"
            "print(sum(sum(d.stats.cache_hits.values()) for d in ds.values()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    misses, hits = " ".join(out[:-1]), int(out[-1])
    assert misses == "{}" and hits > 0


_REFITS_AFTER_THE_WARM_UP = """
import numpy as np, torch
from dcr_ray.codec import FrameMeta, apply_decoded, bits_view, diff_tensor, encode_frames, read_frame
from dcr_ray.codec.compiled import kernels, ptrkernels

kernels.warm_up(background=False)
ds = {**kernels.compiled(), **{"ptr." + k: v for k, v in ptrkernels.compiled().items()}}
before = {n: len(d.signatures) for n, d in ds.items()}
meta = FrameMeta(transfer="t", attempt=0, producer="p", payload=0, base=0, target=1)
g = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    old = torch.randn(60_000, generator=g).to(dtype)
    # an Adam-like step (the same magnitude everywhere: the small weights' bits move), a sparse one, and
    # one whose positions need an escape (many one-element gaps, then one too long for their width)
    steps = {"adam": torch.sign(torch.randn(60_000, generator=g)) * 1e-3, "sparse": torch.zeros(60_000),
             "escape": torch.zeros(60_000)}
    steps["sparse"][::97] = 1e-1
    steps["escape"][0:3000:2] = 1e-1
    steps["escape"][15_000] = 1e-1  # in the same chunk
    for step in steps.values():
        new = (old.float() + step).to(dtype)
        for coding in ("plain", "context"):
            td = diff_tensor("w", bits_view(old).copy(), new, chunk_elems=1 << 14)
            target = old.clone()
            for frame in encode_frames([td], meta, coding=coding):
                apply_decoded(read_frame(frame, {"w": target}), {"w": target})
            assert np.array_equal(bits_view(target), bits_view(new))
print({n: len(d.signatures) - before[n] for n, d in ds.items() if len(d.signatures) != before[n]})
"""


def test_after_the_warm_up_refits_of_either_coding_compile_no_kernel():
    # A signature the warm-up misses is compiled in the middle of a refit, on every receiver: the first
    # context-coded refit of a fresh clone's quickstart took 5.4 s (class_positions' dense walk, never
    # warmed), and on a warm cache each process still pays for loading it then.
    import subprocess
    import sys

    from dcr_ray.codec.compiled import kernels

    if not kernels.ENABLED:
        pytest.skip("numba is not installed (or DCR_RAY_JIT=0): no kernels to warm")
    out = subprocess.run([sys.executable, "-c", _REFITS_AFTER_THE_WARM_UP], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "{}", f"compiled during the refits, by kernel: {out.stdout}"


@pytest.mark.parametrize("jit", [True, False], ids=["compiled", "numpy"])
def test_an_undo_log_of_a_frame_large_enough_for_the_codec_threads_restores_the_committed_bits(jit, monkeypatch):
    from dcr_ray.codec.decoding.undo import UndoLog
    from dcr_ray.codec.compiled import kernels
    from dcr_ray.engines.hf import TransformersBackend

    if jit and not kernels.ENABLED:
        pytest.skip("numba is not installed (or DCR_RAY_JIT=0): only the numpy path exists here")
    monkeypatch.setattr(kernels, "ENABLED", jit)
    pairs = {f"w{i}": _bf16_pair(200_000 + i, 0.2, 10 + i) for i in range(3)}
    deltas = [diff_tensor(n, bits_view(o).copy(), w) for n, (o, w) in pairs.items()]
    assert sum(d.changed for d in deltas) >= apply.APPLY_PARALLEL_MIN
    backend = TransformersBackend.from_tensors({n: o.clone() for n, (o, _) in pairs.items()})
    log = UndoLog()
    for f in encode_frames(deltas, META, coding="plain"):
        d = read_frame(f, backend.tensors())
        log.record("t", d, backend.tensors())
        backend.apply(d)
    assert all(torch.equal(backend.tensors()[n].view(torch.int16), w.view(torch.int16)) for n, (_, w) in pairs.items())
    assert log.rollback(backend) >= 1
    assert all(torch.equal(backend.tensors()[n].view(torch.int16), o.view(torch.int16)) for n, (o, _) in pairs.items())
