"""Helpers for tests that start real Ray (loopback only, sized for a 2-core machine)."""

from __future__ import annotations

import os

# Ray 2.60 binds 127.0.0.1 for ray.init() and ray.cluster_utils.Cluster with this set: keeps all
# test traffic on loopback. Set before Ray is imported anywhere in the test process.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402


def init_local_ray(num_cpus: int = 2, **ray_init) -> None:
    """A fresh single-node Ray (shuts down any other first); ``ray_init``: more ``ray.init`` arguments."""
    if ray.is_initialized():
        ray.shutdown()
    # address="local": always a new instance, never another test's (or session's) cluster on this machine
    ray.init(**{"address": "local", **ray_init}, num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)


def kill_topology() -> None:
    """Shut down a dcr_ray topology left by a test (the coordinator is a named actor)."""
    import dcr_ray

    try:
        dcr_ray.Refit.get().shutdown()
    except (ValueError, ray.exceptions.RayActorError):
        pass  # none running, or it died while we looked it up


def sweep_actors() -> None:
    """Stop what a module left in the shared Ray: every topology (shut down: its placement groups removed,
    its record of a commit directory forgotten), then every actor still alive."""
    import dcr_ray
    from dcr_ray.options import COORDINATOR_NAME, NAMESPACE
    from dcr_ray.refit_call import forget_topology

    named = ray.util.list_named_actors(all_namespaces=True)
    for ns in {NAMESPACE} | {a["namespace"] for a in named if a["name"] == COORDINATOR_NAME}:
        try:
            dcr_ray.Refit.get(namespace=ns).shutdown()
        except (ValueError, ray.exceptions.RayActorError):
            pass  # none running there, or it died while we looked
        forget_topology(ns)
    # Then every actor still alive, named or not. An actor handle that reached a detached actor (the owners
    # given to launch() reach the coordinator) stays pinned while this driver lives, so a module's trainers
    # would otherwise outlive it and crowd the next modules' worker starts. Ray kills by handle only, and
    # the state API needs the dashboard (off in tests): this reads the actor table from GCS and kills by
    # id, as ray.kill does.
    from ray._private import state as gcs_state
    from ray._private.worker import global_worker

    for actor_id, a in gcs_state.actors().items():
        if a["State"] == "DEAD":
            continue
        try:
            global_worker.core_worker.kill_actor(ray.ActorID.from_hex(actor_id), True)
        except ray.exceptions.ActorHandleNotFoundError:
            # an actor this driver never held a handle to (an engine a coordinator re-created just before
            # it was shut down): killed through a handle looked up by its name
            for n in ray.util.list_named_actors(all_namespaces=True):
                if n["name"] == a.get("Name"):
                    try:
                        ray.kill(ray.get_actor(n["name"], namespace=n["namespace"]), no_restart=True)
                    except ValueError:
                        pass  # gone meanwhile


@pytest.fixture(scope="module")
def local_ray():
    """A single-node Ray for the module (import it into the module to use it).

    One Ray serves every module that asks for it in a run: starting and stopping a local Ray costs about
    4 s, paid once instead of once per module. A module that starts a Ray of its own (a multi-node
    ``Cluster``) shuts this one down, and the next module that asks starts a fresh one. After each module
    the topologies and actors it left are stopped, so modules see the same empty Ray they would see if it
    were fresh."""
    if not ray.is_initialized() or sum(n["Alive"] for n in ray.nodes()) != 1:
        init_local_ray()  # none yet, or a multi-node cluster a module left behind
    yield
    if ray.is_initialized():
        sweep_actors()


def kill_and_wait(actor, timeout_s: float = 60.0) -> None:
    """``ray.kill`` the actor and return once a call to it fails: the kill reaches the actor asynchronously,
    so a call made right after ``ray.kill`` may still be answered."""
    import time

    ray.kill(actor)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"actor still answers {timeout_s} s after ray.kill")


@pytest.fixture(scope="module")
def fresh_local_ray():
    """A single-node Ray started for this module, not the one earlier modules used (later modules share
    it as :func:`local_ray` does). For modules that kill and re-create detached actors and bound the wait
    for it: in full runs, a relay re-created in a Ray that many modules had used did not start within the
    refit's 60 s bound, which the same test never showed in a fresh Ray."""
    init_local_ray()
    yield
    if ray.is_initialized():
        sweep_actors()


def check_engines(refit, trainer, engines=None) -> None:
    """The wrong-bits sweep after a committed refit: every engine of ``refit`` (or those in ``engines``)
    holds the committed version, tagged with it, bit for bit equal to ``trainer``'s rollout bits (int16
    views), and the coordinator and the commit record name the same version."""
    st = refit.status()
    assert st["version"] == st["commit_record"]["version"], st
    want = ray.get(trainer.rollout_state.remote())
    for eid, eng in refit.engines().items():
        if engines is not None and eid not in engines:
            continue
        assert ray.get(eng.get_version.remote()) == st["version"], eid
        got = ray.get(eng.tensors.remote())
        for n in want:
            assert torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)), (eid, n)


def assert_no_wrong_bits(refit, committed: dict, version: int) -> None:
    """The wrong-bits sweep that ends every fault test: the commit record and the coordinator say
    ``version``, and every alive engine holds it, tagged ``version``, bit for bit equal to ``committed``
    (int16 views of what the engine serves from, never a tolerance). An engine that holds no version says
    so (it refuses to serve); one that claims a version must hold exactly its bits."""
    st = refit.status()
    assert st["version"] == version and st["commit_record"]["version"] == version, st
    for eid, eng in refit.engines().items():
        try:
            have = ray.get(eng.get_version.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            continue  # dead: it serves nothing
        if have is None:
            assert eid not in st["required"], f"{eid} holds no version but is required"
            continue
        assert have == version, (eid, have, version)
        got = ray.get(eng.tensors.remote())
        assert sorted(got) == sorted(committed), eid
        for n, t in committed.items():
            assert torch.equal(got[n].view(torch.int16), t.view(torch.int16)), (eid, n)


def half_written(refit, trainer, committed, engine_id: str = "a/e0", base: int = 0):
    """Drive one engine's protocol by hand: after a trainer step, prepare transfer ``T`` (base -> base+1), apply
    half of its mixed frames in place, then open attempt 1 and apply one OVERWRITE frame over part of
    what attempt 0 wrote as XOR. Returns the engine handle (its transfer left open)."""
    from dcr_ray.codec import BaselineStore, FrameMeta, encode_frames

    eng = refit.engines()[engine_id]
    ray.get(trainer.step.remote(seed=0))
    new = ray.get(trainer.rollout_state.remote())
    store = BaselineStore(in_memory=True)
    for n, t in committed.items():
        store.add(n, t)
    deltas = [d for d in (store.diff(n, t) for n, t in new.items()) if d.chunks]
    meta = FrameMeta(transfer="T", attempt=0, producer="hand", payload=0, base=base, target=base + 1)
    frames = list(encode_frames(deltas, meta, bucket_bytes=1 << 12))
    ray.get(eng.prepare.remote("T", 0, base, base + 1))
    for f in frames[: max(1, len(frames) // 2)]:
        assert ray.get(eng.deliver.remote(f)) == "applied"
    meta = FrameMeta(transfer="T", attempt=1, producer="hand", payload=0, base=base, target=base + 1)
    ray.get(eng.prepare.remote("T", 1, base, base + 1))
    first = next(iter(encode_frames(deltas, meta, mode="overwrite", bucket_bytes=1 << 12)))
    assert ray.get(eng.deliver.remote(first)) == "applied"
    return eng
