"""Healing an engine from a peer of its own cluster: the committed bits move inside the cluster only.

A re-created, evicted or otherwise lagging engine does not need the owners (on the trainer's side of
the cluster link) to get the committed version: any engine of its cluster that holds it settled can
hand over its canonical tensors. Protocol (driven by the coordinator's healing part,
:mod:`~dcr_ray.actors.healing`)::

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
the record names. A mixin of :class:`~dcr_ray.actors.engine.EngineActor` (its lock, its backend and
its :class:`~dcr_ray.actors.engine_state.EngineState` transitions).
"""

from __future__ import annotations

import hashlib
import time

import ray

from dcr_ray import metrics
from dcr_ray.codec.bits import bits_view, wire_name
from dcr_ray.errors import EngineStateError


#: Bytes of one object of a peer's snapshot: the healing engine pulls and loads one group at a time,
#: so it never holds a second copy of the model.
SNAPSHOT_GROUP_BYTES = 256 << 20


def tensor_digests(tensors) -> dict[str, str]:
    """BLAKE2b-128 of each tensor's bits (canonical element order)."""
    return {n: hashlib.blake2b(bits_view(t.contiguous()).tobytes(), digest_size=16).hexdigest()
            for n, t in tensors.items()}


class PeerCopy:
    """``snapshot`` (the peer's side) and ``heal_from`` (the healing engine's side) of an engine actor."""

    def snapshot(self, version: int, version_id: str | None) -> dict:
        """This engine's committed bits for a healing peer: ``{"version", "version_id", "specs",
        "digests", "ref": [ObjectRef of {name: tensor}, ...], "bytes"}`` (groups of at most
        :data:`SNAPSHOT_GROUP_BYTES`, in name order); refused unless it holds ``version`` of
        ``version_id`` settled."""
        with self._cv:
            if not self._st.settled or self.version != version or self.version_id != version_id:
                raise EngineStateError(
                    f"engine {self.engine_id} cannot hand over version {version} ({version_id}): it holds "
                    f"v{self.version} ({self.version_id}), {self.state()['phase']}")
            tensors = dict(self.backend.tensors())
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
        t0 = time.perf_counter()
        version, version_id, specs = snap["version"], snap["version_id"], snap["specs"]
        mine = {n: (dt, tuple(shape)) for n, (dt, shape) in self.specs.items()}
        bad = sorted(set(specs) ^ set(mine))[:3] or [n for n in specs if tuple(specs[n]) != mine[n]][:3]
        if bad or set(snap["digests"]) != set(specs):  # checked before any write
            raise EngineStateError(f"engine {self.engine_id}: the peer's tensors do not match this engine's "
                                   f"(names, dtypes or shapes differ, e.g. {bad})")
        with self._cv:
            if self._st.attempt is not None:
                raise EngineStateError(f"engine {self.engine_id} is inside transfer {self._st.attempt.transfer}; "
                                       f"it heals between transfers")
            self._mark_dirty(f"healing from a peer to version {version}")
            seen = set()
            for ref in snap["ref"]:  # one group in memory at a time
                group = ray.get(ref, timeout=timeout_s)
                if any(n not in specs or n in seen or (wire_name(t.dtype), tuple(t.shape)) != tuple(specs[n])
                       for n, t in group.items()):
                    self._st.dirty("a peer's copy held tensors its manifest did not name")
                    raise EngineStateError(f"engine {self.engine_id}: {self._st.why}")
                self.backend.load_dense(group.items())
                seen |= set(group)
                del group
            self.backend.flush()
            got = tensor_digests(self.backend.tensors())
            differ = sorted(n for n in snap["digests"] if got.get(n) != snap["digests"][n])
            if differ or seen != set(specs):
                self._st.dirty(f"a copy from a peer did not land exactly ({len(differ)} tensors differ from the "
                               f"peer's digests, e.g. {differ[:3]}; {len(set(specs) - seen)} never arrived)")
                raise EngineStateError(f"engine {self.engine_id}: {self._st.why}")
            self._st.activate(version, version_id)
            self._applied.clear()
            self.backend.activate(version)
            self._stats["healed_from_peer"] = self._stats.get("healed_from_peer", 0) + 1
            metrics.record("engine_version", version, tags=self._tags)
            self._cv.notify_all()
        return {"engine": self.engine_id, "version": version, "bytes": snap["bytes"],
                "seconds": time.perf_counter() - t0}
