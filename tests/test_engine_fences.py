"""An engine activates only what it flushed, and never bits in doubt: a failed staged write leaves it
dirty, and a repeated activation (Ray may deliver a call twice; a resumed coordinator or a readmission
asks again) is refused instead of tagging half-written weights with the committed version. The oracle
is the trainer's tensors of the version the engine says it serves (integer views). In process, no Ray:
the engine actor's class is driven directly."""

from __future__ import annotations

import pytest
import torch

import dcr_ray
from dcr_ray.actors.engine.actor import EngineActor
from dcr_ray.codec import BaselineStore, FrameMeta, encode_frames
from dcr_ray.errors import EngineStateError
from dcr_ray.testing.faults import FlakyEngine
from dcr_ray.testing.models import ModelSpec

SPEC = ModelSpec(size="tiny", seed=0)


class _Direct:
    """The transport's engine side for frames handed over as bytes."""

    def read(self, payload):
        return payload


def _trainer_step(state: dict, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: (t + 1e-2 * torch.randn(t.shape, generator=g).to(t.dtype)) if t.is_floating_point() else t
            for n, t in state.items()}


def _frames(old: dict, new: dict, transfer: str = "T") -> list[bytes]:
    store = BaselineStore(in_memory=True)
    for n, t in old.items():
        store.add(n, t)
    meta = FrameMeta(transfer=transfer, attempt=0, producer="owner0", payload=0, base=0, target=1, base_id="attach")
    return list(encode_frames([d for d in (store.diff(n, new[n]) for n in old) if d.chunks], meta,
                              bucket_bytes=1 << 14))


def _serves_the_trainers_bits_or_nothing(engine: EngineActor, trainer: dict[int, dict]) -> None:
    """The oracle: the version the engine says it holds, and the trainer's tensors of that version."""
    v = engine.get_version()
    if v is None:
        with pytest.raises(Exception):
            engine.generate([[1, 2, 3]], 1)
        return
    got = engine.tensors()
    for n, t in trainer[v].items():
        assert torch.equal(got[n].view(torch.int16), t.view(torch.int16)), (v, n)


def _engine(apply: str, backend) -> EngineActor:
    config = dcr_ray.RefitConfig(engines=dcr_ray.EngineConfig(apply=apply))
    engine = EngineActor("a/e0", "a", backend, config, _Direct())
    engine.activate(0, version_id="attach")  # as after the launch's dense bootstrap
    return engine


def test_an_engine_whose_staged_write_failed_refuses_every_later_activation_of_that_transfer():
    engine = _engine("staged", FlakyEngine(dcr_ray.HFEngine(SPEC), fail_after=1))
    v0 = {n: t.clone() for n, t in engine.tensors().items()}
    trainer = {0: v0, 1: _trainer_step(v0)}
    frames = _frames(v0, trainer[1])
    assert len(frames) >= 2
    engine.prepare("T", 0, 0, 1, "attach")
    assert all(engine.deliver(f) == "applied" for f in frames)
    engine.flush("T", 0, [("T", 0, "owner0", i) for i in range(len(frames))], 5.0)
    with pytest.raises(EngineStateError, match="writing the staged frames"):
        engine.activate(1, "T")  # the second frame's write fails: half of v1 is in the weights
    assert engine.state()["phase"] == "dirty"
    for _ in range(2):  # the coordinator's call delivered again, a resume, a readmission
        with pytest.raises(EngineStateError, match="refused"):
            engine.activate(1, "T")
    assert engine.state()["phase"] == "dirty" and engine.get_version() is None
    _serves_the_trainers_bits_or_nothing(engine, trainer)


def test_an_engine_activates_only_the_attempt_it_flushed():
    engine = _engine("in_place", dcr_ray.HFEngine(SPEC))
    v0 = {n: t.clone() for n, t in engine.tensors().items()}
    trainer = {0: v0, 1: _trainer_step(v0)}
    frames = _frames(v0, trainer[1])
    engine.prepare("T", 0, 0, 1, "attach")
    assert engine.deliver(frames[0]) == "applied"  # it left the stream after one frame (evicted, hung)
    with pytest.raises(EngineStateError, match="never flushed"):
        engine.activate(1, "T")
    assert engine.get_version() == 0 and engine.state()["transfer"] == "T"
    engine.abort("T", final=True)  # rolled back in place: it serves v0 exactly
    _serves_the_trainers_bits_or_nothing(engine, trainer)


def test_a_call_addressed_to_another_incarnation_is_refused_and_changes_nothing():
    # the coordinator re-created this engine elsewhere (its node was unreachable, not gone): the old actor
    # still runs, and every call that opens, flushes, activates or hands bits over names the new epoch
    config = dcr_ray.RefitConfig()
    old = EngineActor("a/e0", "a", dcr_ray.HFEngine(SPEC), config, _Direct(), epoch=1)
    old.activate(0, version_id="attach", epoch=1)
    v0 = {n: t.clone() for n, t in old.tensors().items()}
    trainer = {0: v0, 1: _trainer_step(v0)}
    frames = _frames(v0, trainer[1])
    with pytest.raises(EngineStateError, match="incarnation 2 refused by incarnation 1"):
        old.prepare("T", 0, 0, 1, "attach", epoch=2)
    assert old.deliver(frames[0]) == "rejected"  # no attempt of its own: a frame has nothing to land in
    for call in (lambda: old.flush("T", 0, [], 1.0, epoch=2), lambda: old.activate(1, "T", epoch=2),
                 lambda: old.snapshot(0, "attach", epoch=2), lambda: old.catch_up([], 1.0, epoch=2)):
        with pytest.raises(EngineStateError, match="refused by incarnation 1"):
            call()
    assert old.state()["epoch"] == 1 and old.get_version() == 0
    _serves_the_trainers_bits_or_nothing(old, trainer)
    old.prepare("T", 0, 0, 1, "attach", epoch=1)  # the incarnation the coordinator holds is served
    assert all(old.deliver(f) == "applied" for f in frames)
    old.flush("T", 0, [("T", 0, "owner0", i) for i in range(len(frames))], 5.0, epoch=1)
    assert old.activate(1, "T", epoch=1) == 1
    _serves_the_trainers_bits_or_nothing(old, trainer)
