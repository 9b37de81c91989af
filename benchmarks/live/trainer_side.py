"""What the peers' ways run inside the trainer's actors (``owner.__ray_call__.remote(fn, ...)``).

- :func:`put_state`: the owner copies its current tensors out of the trainer into the object store
  itself and hands back the reference: the engines pull them from there, as a broadcast from the
  trainer would carry them; nothing passes through the driver.
- :func:`skyrl_start` / :func:`skyrl_publish`: SkyRL 0.4.0's trainer side, in the first owner (its
  rank 0): ``DeltaCheckpointPublisher`` over a base checkpoint of the bits the engines hold, then per
  version ``create_delta_files`` + ``publish`` (XOR against its CPU snapshot, zstd 1 of each changed
  tensor's mask, safetensors and a manifest) into a sync directory. A trainer sharded over several owners
  sends its other shards' tensors to rank 0 through the object store first, as SkyRL gathers to rank 0.
"""

from __future__ import annotations

import os
import time


def put_state(owner) -> tuple[list, int]:
    """(Run in an owner actor.) Its current tensors, copied into the object store by the owner:
    ``([ref], bytes)`` (the reference nested in a list, so nobody resolves it on the way)."""
    import ray

    state = {n: t.contiguous() for n, t in owner.dcr_tensors().items()}
    return [ray.put(state)], sum(t.numel() * t.element_size() for t in state.values())


def _gathered(owner, refs: list) -> dict:
    import ray

    state = dict(owner.dcr_tensors())
    for part in ray.get(list(refs)):
        state.update(part)
    return state


def skyrl_start(owner, refs: list, root: str, prefer_own: bool = True) -> dict:
    """(Run in the first owner.) The base checkpoint (this trainer's current bits, which the engines hold)
    under ``root/base`` and SkyRL's publisher over it; ``refs``: the other owners' :func:`put_state`."""
    from safetensors.torch import save_file

    from benchmarks.peers import skyrl_code

    code = skyrl_code.load(prefer_own=prefer_own)
    base = os.path.join(root, "base")
    os.makedirs(base, exist_ok=True)
    save_file({n: t.contiguous() for n, t in _gathered(owner, refs).items()}, os.path.join(base, "model.safetensors"))
    sync = os.path.join(root, "sync")
    owner._bench_skyrl = (code, code.Publisher(base, sync, os.path.join(root, "staging")), sync)
    return {"peer_code": code.peer_code, "note": code.note, "base": base, "sync": sync}


def skyrl_publish(owner, refs: list) -> dict:
    """(Run in the first owner.) One version: SkyRL's ``create_delta_files`` + ``publish`` of the trainer's
    current tensors. Returns the version, the bytes of the files it wrote for it and the seconds it took."""
    code, pub, sync = owner._bench_skyrl
    t = time.perf_counter()
    state = _gathered(owner, refs)
    pub.publish(pub.create_delta_files(state.items()))
    seconds = time.perf_counter() - t
    d = os.path.join(sync, code.version_name(pub.version))
    nbytes = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if os.path.isfile(os.path.join(d, f)))
    return {"version": pub.version, "bytes": nbytes, "seconds": seconds}
