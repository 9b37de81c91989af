"""Device-resident baselines: the diff runs where the shard lives and finds exactly the host diff's changes.

:mod:`dcr_ray.sharding.device` is plain ``torch`` on the tensors' own device, so the CPU tests run the
same code an owner runs on a GPU (the owner is told to keep CPU tensors on their "device"); the
``gpu``-marked test runs an owner with CUDA shards end to end.
"""

from __future__ import annotations

import pytest
import torch

import dcr_ray
from dcr_ray.actors.owner.delta import DeltaOwner
from dcr_ray.codec import BaselineStore, apply_frame
from dcr_ray.sharding.device import DeviceBaseline, delta_from_changes
from test_owner import ListSink


def _int(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8 if t.element_size() == 1 else {2: torch.int16, 4: torch.int32,
                                                                          8: torch.int64}[t.element_size()])


def _state(seed: int, device="cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w.bf16": torch.randn(3000, generator=g).to(torch.bfloat16),
            "w.fp32": torch.randn(37, 41, generator=g),
            "mask": torch.rand(500, generator=g) > 0.5,
            "ids": torch.randint(0, 1000, (257,), generator=g, dtype=torch.int64)}


def _change(state: dict, seed: int, frac: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {n: t.clone() for n, t in state.items()}
    for n, t in out.items():
        flat = _int(t)
        k = max(1, int(flat.numel() * frac))
        idx = torch.randperm(flat.numel(), generator=g)[:k]
        if t.dtype == torch.bool:
            flat[idx] ^= 1
        else:
            flat[idx] = flat[idx] ^ torch.randint(1, 7, (k,), generator=g, dtype=flat.dtype)
    # -0.0 vs +0.0 and a NaN payload: different bits, equal or unordered values
    out["w.fp32"].view(-1)[0], state["w.fp32"].view(-1)[0] = -0.0, 0.0
    _int(out["w.bf16"])[1] = 0x7FC1
    return out


@pytest.mark.parametrize("frac", [0.0005, 0.03, 0.6])
def test_a_device_diff_finds_exactly_the_changes_the_host_diff_finds(frac):
    old = _state(0)
    new = _change(old, 1, frac)
    host, dev = BaselineStore(in_memory=True, chunk_elems=256), DeviceBaseline()
    for n, t in old.items():
        host.add(n, t)
        dev.add(n, t)
    for n in old:
        want = host.diff(n, new[n])
        pos, bits = dev.changes(n, new[n])
        got = delta_from_changes(n, new[n], pos, bits, host.bits(n), chunk_elems=256)
        differ = int((_int(old[n]) != _int(new[n])).sum())
        assert got.changed == differ and sum(len(c.positions()) for c in got.chunks) == differ
        assert all(c.dense is None for c in got.chunks)  # (the host diff may send a chunk DENSE)
        # the same frames' worth of changes: applying either to the old bits gives the new bits
        for td in (want, got):
            target = {n: old[n].clone()}
            from dcr_ray.codec import FrameMeta, encode_frames

            meta = FrameMeta(transfer="t", attempt=0, producer="o", payload=0, base=0, target=1)
            for f in encode_frames([td], meta, bucket_bytes=1 << 14):
                apply_frame(f, target, expect_base=0)
            assert torch.equal(_int(target[n]), _int(new[n])), n


def test_promote_folds_the_pending_changes_in_and_discard_drops_them():
    old = _state(0)
    dev = DeviceBaseline()
    for n, t in old.items():
        dev.add(n, t)
    v1 = _change(old, 1, 0.01)
    first = {n: dev.changes(n, v1[n])[0] for n in old}
    dev.discard()
    assert all((dev.changes(n, v1[n])[0] == first[n]).all() for n in old)  # still against v0
    dev.promote()
    assert all(len(dev.changes(n, v1[n])[0]) == 0 for n in old)  # v1 is now the baseline


def _owner_refits(device) -> None:
    cfg = dcr_ray.RefitConfig(codec=dcr_ray.CodecConfig(chunk_elems=1024, bucket_bytes=1 << 13),
                              owners=dcr_ray.OwnerConfig(promote="inline"))
    owner = DeltaOwner("o", cfg, in_memory=True)
    ts = {n: t.to(device) for n, t in _state(0).items()}
    owner.attach(ts)
    if device == "cpu":  # the device path, driven with CPU tensors
        for n, t in ts.items():
            owner.device.add(n, t)
    assert set(owner.device.names()) == set(ts)
    engine = {n: t.cpu().clone() for n, t in ts.items()}
    for v in range(1, 4):
        ts = {n: t.to(device) for n, t in _change({n: t.cpu() for n, t in ts.items()}, v, 0.02).items()}
        sink = ListSink()
        owner.stream(ts, transfer=f"t{v}", attempt=0, base=v - 1, target=v, sink=sink, base_id=f"t{v - 1}")
        for f in sink.frames:
            apply_frame(f, engine, expect_base=v - 1, expect_base_id=f"t{v - 1}")
        owner.promote(v)
        for n in ts:
            assert torch.equal(_int(engine[n]), _int(ts[n].cpu())), (v, n)


def test_an_owner_streams_exact_refits_through_the_device_path():
    _owner_refits("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_owner_with_cuda_shards_diffs_on_the_gpu_and_streams_exact_refits():
    _owner_refits("cuda")


def test_gpu_baseline_setting_is_checked():
    with pytest.raises(dcr_ray.errors.ConfigError, match="gpu_baseline"):
        dcr_ray.OwnerConfig(gpu_baseline="disk")
