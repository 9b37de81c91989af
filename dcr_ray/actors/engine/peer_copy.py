"""Healing an engine from a peer of its own cluster: the committed bits move inside the cluster only.

A re-created, evicted or otherwise lagging engine does not need the owners (on the trainer's side of
the cluster link) to get the committed version: any engine of its cluster that holds it settled can
hand over its canonical tensors. Protocol (driven by the coordinator's healing part,
:mod:`~dcr_ray.actors.recovery.healing`)::

    peer.snapshot(v, id)      under the peer's lock, and only while it holds committed version v of
                              content id settled (no transfer open, nothing written in place): its
                              canonical tensors go into the Ray object store of the peer's node in
                              groups of bounded bytes, with a manifest (name, dtype, shape) and a
                              digest of every tensor (the coordinator asks under its own lock, between
                              refits)
    engine.heal_from(snapshot)
                              checks the manifest against its own specs before any write, then pulls
                              and loads one group at a time (a copy between two nodes of one cluster)
                              densely through its backend (and its loader), digests what the backend
                              now holds and compares every tensor with the peer's digests; only then
                              does it hold v (else it holds no version and says why)

The engine is outside the required set throughout; the coordinator adds it once it holds the version
the record names. A part of :class:`~dcr_ray.actors.engine.actor.EngineActor`, handed the engine's shared state
(:class:`~dcr_ray.actors.engine.context.EngineContext`: its lock, backend and state transitions).
"""

from __future__ import annotations

import hashlib
import time

import ray

from dcr_ray.actors.engine.context import EngineContext
from dcr_ray.codec.bits import bits_view, wire_name
from dcr_ray.engines.base import WireBackend, readable_tensors
from dcr_ray.errors import EngineStateError
from dcr_ray.failpoints import failpoint


#: Bytes of one object of a peer's snapshot: the healing engine pulls and loads one group at a time,
#: so it never holds a second copy of the model.
SNAPSHOT_GROUP_BYTES = 256 << 20


def tensor_digests(tensors) -> dict[str, str]:
    """BLAKE2b-128 of each tensor's bits (canonical element order)."""
    return {n: hashlib.blake2b(bits_view(t.contiguous()).tobytes(), digest_size=16).hexdigest()
            for n, t in tensors.items()}


class PeerCopy:
    """``snapshot`` (the peer's side) and ``heal_from`` (the healing engine's side) of one engine."""

    def __init__(self, ctx: EngineContext):
        self._engine = ctx

    def snapshot(self, version: int, version_id: str | None) -> dict:
        """This engine's committed bits for a healing peer: ``{"version", "version_id", "specs",
        "digests", "ref": [ObjectRef of {name: tensor}, ...], "bytes"}`` (groups of at most
        :data:`SNAPSHOT_GROUP_BYTES`, in name order); refused unless it holds ``version`` of
        ``version_id`` settled."""
        failpoint("engine.snapshot")
        c = self._engine
        with c.lock:
            st = c.state
            if not st.settled or st.version != version or st.version_id != version_id:
                raise EngineStateError(
                    f"engine {c.engine_id} cannot hand over version {version} ({version_id}): it holds "
                    f"v{st.version} ({st.version_id}), {st.phase.value}")
            tensors = dict(readable_tensors(c.backend))
            refs, group, size = [], {}, 0
            for n in sorted(tensors):  # each group is copied into this node's object store under the lock
                t = tensors[n]
                if group and size + t.numel() * t.element_size() > SNAPSHOT_GROUP_BYTES:
                    refs.append(ray.put(group))
                    group, size = {}, 0
                group[n] = t
                size += t.numel() * t.element_size()
            if group:
                refs.append(ray.put(group))
            digests = tensor_digests(tensors)
        return {"version": version, "version_id": version_id, "digests": digests, "ref": refs,
                "specs": {n: (wire_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()},
                "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}

    def heal_from(self, snap: dict, timeout_s: float) -> dict:
        """Take the committed version a peer's :meth:`snapshot` handed over (see the module doc); returns
        ``{"engine", "version", "bytes", "seconds"}``. Raises :class:`EngineStateError` (holding no
        version when bits were written) if the copy does not match the peer's digests."""
        failpoint("engine.heal_from")
        c = self._engine
        t0 = time.perf_counter()
        version, version_id, specs = snap["version"], snap["version_id"], snap["specs"]
        mine = {n: (dt, tuple(shape)) for n, (dt, shape) in c.specs.items()}
        bad = sorted(set(specs) ^ set(mine))[:3] or [n for n in specs if tuple(specs[n]) != mine[n]][:3]
        if bad or set(snap["digests"]) != set(specs):  # checked before any write
            raise EngineStateError(f"engine {c.engine_id}: the peer's tensors do not match this engine's "
                                   f"(names, dtypes or shapes differ, e.g. {bad})")
        with c.lock:
            st = c.state
            if st.attempt is not None:
                raise EngineStateError(f"engine {c.engine_id} is inside transfer {st.attempt.transfer}; "
                                       f"it heals between transfers")
            if isinstance(c.backend, WireBackend) and c.backend.read_back() is None:
                raise EngineStateError(f"engine {c.engine_id} cannot take a peer's copy ({type(c.backend).__name__} "
                                       f"takes dense bits only as frames of a refit): bootstrap it densely")
            c.mark_dirty(f"healing from a peer to version {version}")
            c.quiesce()
            seen = set()
            for ref in snap["ref"]:  # one group in memory at a time
                group = ray.get(ref, timeout=timeout_s)
                if any(n not in specs or n in seen or (wire_name(t.dtype), tuple(t.shape)) != tuple(specs[n])
                       for n, t in group.items()):
                    c.mark_dirty("a peer's copy held tensors its manifest did not name")
                    raise EngineStateError(f"engine {c.engine_id}: {st.why}")
                c.backend.load_dense(group.items())
                seen |= set(group)
                del group
            c.backend.flush()
            got = tensor_digests(readable_tensors(c.backend))
            differ = sorted(n for n in snap["digests"] if got.get(n) != snap["digests"][n])
            if differ or seen != set(specs):
                c.mark_dirty(f"a copy from a peer did not land exactly ({len(differ)} tensors differ from the "
                             f"peer's digests, e.g. {differ[:3]}; {len(set(specs) - seen)} never arrived)")
                raise EngineStateError(f"engine {c.engine_id}: {st.why}")
            c.become_ready(version, version_id, counter="healed_from_peer", verified=True)
        return {"engine": c.engine_id, "version": version, "bytes": snap["bytes"],
                "seconds": time.perf_counter() - t0}
