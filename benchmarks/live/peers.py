"""The peers' ways of putting a new policy into the same engines, over the same emulated link, each shaped like
the system that ships it. The trainer's full state never passes through the driver: the owner actors put
their tensors into the object store themselves (:func:`~benchmarks.live.trainer_side.put_state`) and the
engines pull them from there, as a broadcast from the trainer would carry them.

Each pauses its engines the way the system that ships it does, through the engine's own hold
(:meth:`~dcr_ray.actors.engine.actor.EngineActor.hold`): ``switch="drain"`` waits for the running requests to
finish first; ``switch="in_flight"`` holds them at their next decoding step, KV kept, and resumes the same
requests afterwards (vLLM's ``pause_generation(mode="keep")``; on ``transformers`` engines the same step gate
dcr_ray's in-flight switch uses).

``dense_sync`` (OpenRLHF's and veRL's weight broadcast): every engine drains, the whole model crosses the
cluster link once (as a broadcast tree carries it), every tensor goes through the engine's own loader, and
generation resumes. The pause spans the transfer and the load. ``pipelinerl_dense`` is the same transfer
and load as PipelineRL runs it: in flight, the running requests held with their KV
(``pause_generation(mode="keep", clear_cache=False)``), not drained.

``full_fetch_reload`` (a full checkpoint fetched, then reloaded): while the engines serve, the whole model
crosses the link once and is written to a local safetensors checkpoint beside each engine; then each
engine drains, reloads that checkpoint through its own loader and resumes. The pause spans the reload only.

``skyrl_delta`` (SkyRL 0.4.0's checkpoint-delta sync, its own code where installed): the first owner runs
SkyRL's publisher (XOR against its snapshot, zstd 1 of each changed tensor's mask, safetensors and a
manifest); each engine's receiver downloads the version's files across the link (every engine fetches
its own copy, as SkyRL's workers do from the sync directory), XORs them into its local checkpoint and
re-hashes it while it serves; then the engine holds its running requests in keep mode (in flight, as SkyRL
0.4.0 pauses vLLM: no drain), reloads every tensor of the local checkpoint through its own loader (vLLM:
SkyRL's ``DeltaWeightTransferEngine`` inside vLLM's layerwise reload) and resumes them.

Each returns the refit's sample: ``t_call`` / ``t_done`` (driver clock), ``trainer_stall_s`` (until the
trainer's tensors were copied out: the object-store put, or SkyRL's publish) and ``construct_s`` (the same).
The engines' own pause clock gives the pauses (``EngineActor.hold`` / ``release``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from benchmarks.live import engine_side, trainer_side


def _link_cross(relay, nbytes: int) -> None:
    """(Run in a relay head.) ``nbytes`` cross its emulated link (its link model sleeps them out)."""
    from dcr_ray.testing.links import link_of

    link_of(relay).cross(nbytes)


def _put(topo) -> tuple[list, int]:
    """Every owner's current tensors into the object store, by the owners: (refs, bytes)."""
    import ray

    outs = ray.get([h.__ray_call__.remote(trainer_side.put_state) for h in topo.owners.values()])
    return [r for refs, _ in outs for r in refs], sum(n for _, n in outs)


def dense_sync(topo, switch: str = "drain", label: str = "dense_sync") -> dict:
    import ray

    engines, head = list(topo.engines.values()), topo.heads[0]
    t_call = time.time()
    refs, nbytes = _put(topo)
    t_copied = time.time()
    ray.get([e.__ray_call__.remote(engine_side.hold, label, switch) for e in engines])
    try:
        ray.get(head.__ray_call__.remote(_link_cross, nbytes))
        ray.get([e.__ray_call__.remote(engine_side.pull_and_load, refs) for e in engines])
    finally:
        ray.get([e.__ray_call__.remote(engine_side.release, label) for e in engines])
    return {"t_call": t_call, "t_done": time.time(), "trainer_stall_s": t_copied - t_call,
            "construct_s": t_copied - t_call}


def full_fetch_reload(topo) -> dict:
    import ray

    engines, head = list(topo.engines.values()), topo.heads[0]
    t_call = time.time()
    refs, nbytes = _put(topo)
    t_copied = time.time()
    crossed = head.__ray_call__.remote(_link_cross, nbytes)  # once, while the engines serve
    dirs = [tempfile.mkdtemp(prefix="dcr_bench_full_") for _ in engines]
    try:
        written = [e.__ray_call__.remote(_after, crossed, engine_side.write_checkpoint, refs, d)
                   for e, d in zip(engines, dirs)]
        # each engine pauses for its own reload, as soon as its checkpoint is written
        ray.get([e.__ray_call__.remote(_after, w, engine_side.reload_checkpoint, d, "full_fetch_reload")
                 for e, w, d in zip(engines, written, dirs)])
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    return {"t_call": t_call, "t_done": time.time(), "trainer_stall_s": t_copied - t_call,
            "construct_s": t_copied - t_call}


def _after(actor, _done, fn, *args):
    """(Run in an actor.) ``fn(actor, *args)`` once ``_done`` (an ObjectRef argument Ray resolves first) is."""
    return fn(actor, *args)


class SkyrlDelta:
    """SkyRL's delta sync on one topology: its publisher in the first owner, a receiver per engine."""

    def __init__(self, prefer_own: bool = True):
        self.prefer_own = prefer_own
        self.root: str | None = None
        self.peer_code: str | None = None
        self.note: str | None = None

    def start(self, topo) -> None:
        """(Untimed, before the first step.) A base checkpoint of the bits the engines hold, the publisher
        over it, and every engine's receiver over the same base."""
        import ray

        self.root = tempfile.mkdtemp(prefix="dcr_bench_skyrl_")
        topo.cleanup.append(self.root)
        owners = list(topo.owners.values())
        got = ray.get(owners[0].__ray_call__.remote(trainer_side.skyrl_start, self._others(topo), self.root,
                                                    self.prefer_own))
        self.peer_code, self.note, self.sync = got["peer_code"], got["note"], got["sync"]
        ray.get([e.__ray_call__.remote(engine_side.skyrl_start, got["base"], os.path.join(self.root, f"engine{i}"),
                                       self.prefer_own) for i, e in enumerate(topo.engines.values())])

    @staticmethod
    def _others(topo) -> list:
        """The other owners' tensors, put into the object store by them (SkyRL gathers to rank 0)."""
        import ray

        owners = list(topo.owners.values())[1:]
        return [r for refs, _ in ray.get([h.__ray_call__.remote(trainer_side.put_state) for h in owners])
                for r in refs]

    def refit(self, topo) -> dict:
        import ray

        engines, head = list(topo.engines.values()), topo.heads[0]
        owner0 = next(iter(topo.owners.values()))
        t_call = time.time()
        pub = ray.get(owner0.__ray_call__.remote(trainer_side.skyrl_publish, self._others(topo)))
        t_published = time.time()
        v = pub["version"]
        # every engine downloads its own copy across the link (the link serialises them), then fetches,
        # then pauses for its own reload
        fetched = [e.__ray_call__.remote(_after, head.__ray_call__.remote(_link_cross, pub["bytes"]),
                                         engine_side.skyrl_fetch, v, self.sync) for e in engines]
        ray.get([e.__ray_call__.remote(_after, f, engine_side.skyrl_reload, v) for e, f in zip(engines, fetched)])
        fetch_s = ray.get(fetched)
        return {"t_call": t_call, "t_done": time.time(), "trainer_stall_s": t_published - t_call,
                "construct_s": pub["seconds"], "published_bytes": pub["bytes"], "fetch_s": max(fetch_s)}
