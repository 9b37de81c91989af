"""The owner logic without Ray: streaming against the baseline, and promote off the refit's path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dcr_ray
from dcr_ray import failpoints
from dcr_ray.actors.owner.delta import DeltaOwner
from dcr_ray.codec import apply_frame
from dcr_ray.errors import BaselineError
from dcr_ray.failpoints.plan import Fault


class ListSink:
    """Keeps every frame (the transport is not under test here)."""

    def __init__(self):
        self.frames = []

    def send(self, frame, key):
        self.frames.append(frame)

    def drain(self):
        pass


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(4096, generator=g).to(torch.bfloat16),
            "b": torch.randn(64, 33, generator=g).to(torch.bfloat16)}


def _bump(ts, seed):
    out = {n: t.clone() for n, t in ts.items()}
    g = torch.Generator().manual_seed(seed)
    for t in out.values():
        flat = t.view(-1).view(torch.int16)
        idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 20]
        flat[idx] ^= 1
    return out


def _owner(background: bool):
    cfg = dcr_ray.RefitConfig(owners=dcr_ray.OwnerConfig(promote="background" if background else "inline"),
                              codec=dcr_ray.CodecConfig(chunk_elems=1024, bucket_bytes=1 << 13))
    return DeltaOwner("o", cfg, in_memory=True)


@pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])
def test_successive_refits_stream_exactly_the_changes_whether_promote_runs_in_background_or_not(background):
    owner = _owner(background)
    ts = _tensors(0)
    owner.attach(ts)
    engine = {n: t.clone() for n, t in ts.items()}
    for v in range(1, 4):
        ts = _bump(ts, v)
        sink = ListSink()
        owner.stream(ts, transfer=f"t{v}", attempt=0, base=v - 1, target=v, sink=sink)
        for f in sink.frames:
            apply_frame(f, engine, expect_base=v - 1)
        owner.promote(v)
        assert owner.version == v  # waits for a background promote
        for n in ts:
            assert torch.equal(engine[n].view(torch.int16), ts[n].view(torch.int16))
            assert torch.equal(owner.store.tensor(n).view(torch.int16), ts[n].view(torch.int16))


def test_a_repeated_promote_is_a_no_op_and_a_background_promote_that_fails_twice_fails_the_next_stream(monkeypatch):
    owner = _owner(True)
    ts = _tensors(1)
    owner.attach(ts)
    ts = _bump(ts, 1)
    owner.stream(ts, transfer="t1", attempt=0, base=0, target=1, sink=ListSink())
    owner.promote(1)
    owner.promote(1)  # Ray may deliver a call twice
    assert owner.version == 1
    ts = _bump(ts, 2)
    owner.stream(ts, transfer="t2", attempt=0, base=1, target=2, sink=ListSink())

    def broken(version):
        raise OSError("disk full")

    monkeypatch.setattr(owner.store, "promote", broken)
    owner.promote(2)  # returns at once; the failure lands in the background thread
    with pytest.raises(BaselineError, match="promoting the committed changed set failed.*disk full"):
        owner.stream(_bump(ts, 3), transfer="t3", attempt=0, base=2, target=3, sink=ListSink())
    with pytest.raises(BaselineError):  # sticky: the baseline does not match the record any more
        owner.version


@pytest.mark.parametrize("where", ["before it wrote", "after it wrote"])
def test_a_background_promote_that_failed_once_runs_again_before_the_next_stream_which_diffs_from_it(
        monkeypatch, where):
    owner = _owner(True)
    ts = _tensors(1)
    owner.attach(ts)
    ts = _bump(ts, 1)
    owner.stream(ts, transfer="t1", attempt=0, base=0, target=1, sink=ListSink())
    real, calls = owner.store.promote, []

    def fails_once(version):
        calls.append(version)
        if len(calls) == 1 and where == "after it wrote":
            real(version)
            raise OSError("disk full")
        return real(version)

    monkeypatch.setattr(owner.store, "promote", fails_once)
    if where == "before it wrote":  # the failpoint just before the baseline's writes, armed in this process
        failpoints.arm([Fault(point="owner.promote.write", action="raise", at=1)])
    try:
        owner.promote(1)
        ts2 = _bump(ts, 2)
        sink = ListSink()
        owner.stream(ts2, transfer="t2", attempt=0, base=1, target=2, sink=sink)
    finally:
        failpoints.disarm()
    assert owner.store.version == 1 and calls == ([1, 1] if where == "after it wrote" else [1])
    for n, t in ts.items():  # the baseline is exactly version 1: the trainer's tensors then
        assert np.array_equal(owner.store.tensor(n).view(torch.int16).numpy(), t.view(torch.int16).numpy())
    owner.promote(2)
    assert owner.version == 2


def test_promoting_a_version_that_is_not_pending_is_refused_at_once_and_breaks_nothing():
    owner = _owner(True)
    ts = _tensors(2)
    owner.attach(ts)
    owner.stream(_bump(ts, 1), transfer="t1", attempt=0, base=0, target=1, sink=ListSink())
    with pytest.raises(BaselineError, match="pending set is for 1"):
        owner.promote(7)
    owner.promote(1)
    assert owner.version == 1


def test_a_tensor_that_appears_after_attach_fails_the_stream_instead_of_being_ignored():
    owner = _owner(False)
    ts = _tensors(0)
    owner.attach(ts)
    grown = dict(_bump(ts, 1), c=torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(BaselineError, match="gained.*'c'"):
        owner.stream(grown, transfer="t1", attempt=0, base=0, target=1, sink=ListSink())


def test_a_column_sharded_owner_sends_frames_that_rebuild_its_part_of_the_canonical_tensor():
    from dcr_ray.sharding import Shard, ShardSpec

    full = torch.randn(16, 32).to(torch.bfloat16)
    owners = [_owner(False) for _ in range(2)]
    specs = [ShardSpec.box("w", (16, 32), (0, 16 * r), (16, 16)) for r in range(2)]
    declared = [o.attach({"w": Shard(full[:, 16 * r:16 * (r + 1)].contiguous(), s)})
                for r, (o, s) in enumerate(zip(owners, specs))]
    assert declared[1] == {"w": ("bfloat16", (16, 32), [((0, 16), (16, 32))])}
    new = _bump({"w": full}, 3)["w"]
    engine = {"w": full.clone()}
    for r, (o, s) in enumerate(zip(owners, specs)):
        sink = ListSink()
        o.stream({"w": Shard(new[:, 16 * r:16 * (r + 1)].contiguous(), s)}, transfer="t1", attempt=0, base=0,
                 target=1, sink=sink)
        for f in sink.frames:
            apply_frame(f, engine, expect_base=0)
    assert torch.equal(engine["w"].view(torch.int16), new.view(torch.int16))


def test_a_standalone_owners_set_tensors_replaces_the_whole_dict_so_a_stray_name_does_not_stick():
    owner = dcr_ray.StandaloneOwner(_tensors(0))
    owner.set_tensors({**_tensors(1), "stray": torch.zeros(3, dtype=torch.bfloat16)})
    owner.set_tensors(_tensors(2))
    got = owner.dcr_tensors()
    assert sorted(got) == ["a", "b"]
    assert all(torch.equal(got[n].view(torch.int16), t.view(torch.int16)) for n, t in _tensors(2).items())


def test_an_owner_keeps_its_baseline_in_memory_unless_owner_config_names_a_directory(tmp_path):
    assert DeltaOwner("o", dcr_ray.RefitConfig()).store.in_memory  # nothing written back to a disk per commit
    cfg = dcr_ray.RefitConfig(owners=dcr_ray.OwnerConfig(baseline_dir=str(tmp_path / "nvme")),
                              codec=dcr_ray.CodecConfig(chunk_elems=1024, bucket_bytes=1 << 13))
    owners = [DeltaOwner(o, cfg) for o in ("o0", "o1")]  # owners of one node share the setting
    dirs = [o.store.directory for o in owners]
    assert len(set(dirs)) == 2 and all(d.startswith(str(tmp_path / "nvme")) for d in dirs)
    ts = _tensors(0)
    owners[0].attach(ts)
    assert not owners[0].store.in_memory and sorted(p.name for p in (tmp_path / "nvme").iterdir())
    engine = {n: t.clone() for n, t in ts.items()}
    for v in (1, 2):  # refits from a memory-mapped baseline are exact too
        ts = _bump(ts, v)
        sink = ListSink()
        owners[0].stream(ts, transfer=f"t{v}", attempt=0, base=v - 1, target=v, sink=sink)
        for f in sink.frames:
            apply_frame(f, engine, expect_base=v - 1)
        owners[0].promote(v)
        owners[0].settle()  # the promote runs in the background; the store is read directly below
        for n in ts:
            assert torch.equal(engine[n].view(torch.int16), ts[n].view(torch.int16))
            assert torch.equal(owners[0].store.tensor(n).view(torch.int16), ts[n].view(torch.int16))
    for o in owners:
        o.store.close()
    assert list((tmp_path / "nvme").iterdir()) == []  # each owner removes its own directory


@pytest.mark.parametrize("bad", ["", "  ", 5, b"/tmp"])
def test_a_baseline_dir_that_is_not_a_path_is_refused_with_the_fix(bad):
    with pytest.raises(dcr_ray.errors.ConfigError, match="OwnerConfig.baseline_dir must be a directory path"):
        dcr_ray.OwnerConfig(baseline_dir=bad)


def test_a_baseline_dir_the_owner_cannot_write_fails_its_attach_with_the_fix(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    cfg = dcr_ray.RefitConfig(owners=dcr_ray.OwnerConfig(baseline_dir=str(tmp_path / "file" / "sub")))
    with pytest.raises(BaselineError, match="give OwnerConfig.baseline_dir a writable directory"):
        DeltaOwner("o", cfg)


class FailingSink(ListSink):
    """A sink whose ``at``-th send raises, as a relay that died mid-stream makes the owner's send raise."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def send(self, frame, key):
        if len(self.frames) + 1 == self.at:
            raise RuntimeError("the head relay died mid-stream")
        super().send(frame, key)


def test_a_retry_after_a_stream_that_failed_mid_diff_carries_the_whole_changed_set():
    # 8 tensors of 64 Ki BF16 elements, every element changed, small buckets: the first attempt's sink
    # raises at its third frame, while the lazy diff has read only part of the tensors
    cfg = dcr_ray.RefitConfig(codec=dcr_ray.CodecConfig(chunk_elems=1 << 12, bucket_bytes=1 << 15))
    owner = DeltaOwner("o", cfg, in_memory=True)
    g = torch.Generator().manual_seed(3)
    committed = {f"t{i}": torch.randn(1 << 16, generator=g).to(torch.bfloat16) for i in range(8)}
    owner.attach(committed)
    trainer = {n: (t.float() + 1.0).to(torch.bfloat16) for n, t in committed.items()}
    assert all(bool((trainer[n].view(torch.int16) != committed[n].view(torch.int16)).all()) for n in committed)
    with pytest.raises(RuntimeError, match="mid-stream"):
        owner.stream(trainer, transfer="T", attempt=0, base=0, target=1, sink=FailingSink(at=3))
    sink = ListSink()
    summary = owner.stream(trainer, transfer="T", attempt=1, base=0, target=1, sink=sink)
    assert summary["changed"] == 8 << 16
    engine = {n: t.clone() for n, t in committed.items()}
    for f in sink.frames:
        apply_frame(f, engine, expect_base=0)
    for n in trainer:  # the oracle is the trainer's tensors, not the owner's pending set
        assert torch.equal(engine[n].view(torch.int16), trainer[n].view(torch.int16)), n
    owner.promote(1)
    assert owner.version == 1  # waits for a background promote
    for n in trainer:
        assert torch.equal(owner.store.tensor(n).view(torch.int16), trainer[n].view(torch.int16)), n
