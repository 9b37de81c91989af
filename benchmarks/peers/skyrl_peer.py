"""SkyRL's delta sync run as its trainer and its inference worker run it, on the bench's steps.

Per case, the committed bits of the first step are written as the base checkpoint (one safetensors file)
that both sides start from. Each sample is one version:

- **sender** (timed): ``DeltaCheckpointPublisher.create_delta_files`` over every tensor of the new version,
  then ``publish`` (the manifest): XOR against its CPU snapshot, xxh3-128 of the new bytes, zstd level 1
  of each changed tensor's dense mask, files written to the sync directory. Its wire bytes are the files
  it wrote for that version (payload safetensors and ``manifest.json``), read from the directory.
- the download: SkyRL's own ``fetch_delta_directory`` into the store's cache (untimed: the transport);
- **receiver** (timed, until the engine holds the version): ``LocalCheckpointStore.fetch`` (XOR into its
  local checkpoint file through ``mmap``, then re-hash each tensor), ``validate_ready``, and the full
  reload SkyRL does in the pause: every tensor of the local checkpoint from ``store.iter_tensors()`` (its
  default load format, vLLM's multi-thread safetensors iterator) into the engine's ``load_state_dict``.

Samples alternate between the new and the committed bits (the XOR mask is the same both ways, so every
sample does the same work), an odd number so that each step ends at its new version; the first sample of a
case also reads the snapshot and copies the base checkpoint once (the tables take the best sample). The
engine is checked against the version of every sample, on integer views.

Corruption trials (:meth:`SkyrlPeer.corruption`): a clean publish, the download, then the cached payload
file corrupted in place (what a bad transfer leaves), and the worker's ``fetch`` run on it; whether it
wrote its checkpoint is read from the checkpoint file, whether the engine reloads from ``validate_ready``
and its bits. Then SkyRL's recovery as it stands: the next ``fetch`` of that version (which resets from
the base and replays every delta when a write was in progress), with the bytes it downloads again. When
that does not bring the version, the bench deletes the cached delta and fetches again so the run can go
on, and says so (``operator_repair``).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from benchmarks.codec.timing import Timed
from benchmarks.peers.corrupt import KINDS, corrupt, describe, verdict

RECOVERY = ("its next fetch: reset from the base checkpoint and replay every delta when a write was in progress "
            "(a checksum mismatch deletes the cached delta first)")


def _as_tensor(bits, like):
    """The committed bits of one tensor as a tensor of ``like``'s dtype and shape (no copy)."""
    import torch

    return torch.from_numpy(bits.view(f"i{bits.dtype.itemsize}")).view(like.dtype).reshape(like.shape)


def _files(root: Path) -> dict:
    """Every file under ``root``: relative path -> (inode, mtime, size)."""
    out = {}
    for p in root.rglob("*"):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


class SkyrlPeer:
    """SkyRL's publisher and store for one case at a time, with the engine that reloads from the store."""

    name = "skyrl"

    def __init__(self, code, workdir: str):
        self.code = code
        self.peer_code, self.note = code.peer_code, code.note
        self.workdir = Path(workdir)

    def start(self, case: str, step, engine) -> None:
        """A base checkpoint of ``step``'s committed bits, a publisher and a store starting from it."""
        from safetensors.torch import save_file

        self.root = self.workdir / case
        shutil.rmtree(self.root, ignore_errors=True)
        self.base = self.root / "base"
        self.base.mkdir(parents=True)
        save_file({n: _as_tensor(step.old[n], t).contiguous() for n, t in step.new.items()},
                  str(self.base / "model.safetensors"))
        self.sync = str(self.root / "sync")
        self.pub = self.code.Publisher(str(self.base), self.sync, str(self.root / "staging"))
        self.store = self.code.Store(str(self.base), str(self.root / "local"))
        self.engine = engine

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # --- one version, both sides ---------------------------------------------------------------------
    def _uri(self, version: int) -> str:
        return f"{self.sync.rstrip('/')}/{self.code.version_name(version)}"

    def publish(self, tensors: dict) -> tuple[int, float, float]:
        """The trainer's side of one version: (version, CPU seconds, wall seconds)."""
        c, t = time.process_time(), time.perf_counter()
        self.pub.publish(self.pub.create_delta_files(tensors.items()))
        return self.pub.version, time.process_time() - c, time.perf_counter() - t

    def download(self, version: int) -> Path:
        """The transport: SkyRL's own download of the version into the store's cache; the cache directory."""
        uri = self._uri(version)
        cache = Path(self.store.deltas_dir) / self.code.cache_name(uri)
        self.code.fetch_delta_directory(uri, cache)
        return cache

    def reload(self, version: int) -> None:
        """The worker's pause: ``validate_ready`` then every tensor of the local checkpoint into the engine."""
        self.store.validate_ready(version)
        self.engine.load_state_dict(dict(self.store.iter_tensors()))

    def receive(self, version: int) -> tuple[float, float, float]:
        """The worker's side of one version until the engine holds it: (CPU seconds, wall seconds, CPU seconds of
        the reload alone: what SkyRL spends in the pause; its fetch overlaps serving)."""
        c, t = time.process_time(), time.perf_counter()
        self.store.fetch(version, sync_dir=self.sync)
        r = time.process_time()
        self.reload(version)
        return time.process_time() - c, time.perf_counter() - t, time.process_time() - r

    def wire_files(self, version: int) -> dict:
        """The files SkyRL published for ``version`` and their sizes: what crosses the wire."""
        d = Path(self._uri(version))
        return {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file()}

    # --- a step --------------------------------------------------------------------------------------
    def measure(self, step, repeats: int) -> dict:
        """Samples of one step (see the module docstring); the engine and the store end at its new version."""
        from dcr_ray.codec import bits_view

        versions = {"new": (step.new, {n: bits_view(t) for n, t in step.new.items()}),
                    "old": ({n: _as_tensor(step.old[n], t) for n, t in step.new.items()}, step.old)}
        sender, receiver, exact, files, reload_cpu = Timed(), Timed(), True, None, []
        for r in range(repeats | 1):
            tensors, bits = versions["new" if r % 2 == 0 else "old"]
            version, cpu, wall = self.publish(tensors)
            sender.cpu.append(cpu)
            sender.wall.append(wall)
            files = files or self.wire_files(version)
            self.download(version)
            cpu, wall, reload_s = self.receive(version)
            reload_cpu.append(round(reload_s, 6))
            receiver.cpu.append(cpu)
            receiver.wall.append(wall)
            exact &= self.engine.holds(bits)
        return {"wire_bytes": sum(files.values()), "files": files, "sender": sender, "receiver": receiver,
                "bit_exact": exact, "reload_cpu_s": reload_cpu}

    def _checkpoint_holds(self, bits: dict) -> bool:
        """Whether the store's local checkpoint file holds exactly ``bits`` (integer views)."""
        import numpy as np
        from safetensors import safe_open

        from dcr_ray.codec import bits_view

        d = Path(self.store.weights_dir)
        seen = {}
        for path in sorted((d if d.exists() else self.base).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for k in f.keys():
                    seen[k] = np.array_equal(bits_view(f.get_tensor(k)), bits[k]) if k in bits else True
        return set(seen) >= set(bits) and all(seen.values())

    def corruption(self, step) -> dict:
        """Each corruption, from the step's new version back to its committed bits and then forward again."""
        from dcr_ray.codec import bits_view

        new_bits = {n: bits_view(t) for n, t in step.new.items()}
        old_tensors = {n: _as_tensor(step.old[n], t) for n, t in step.new.items()}
        trials = {"flip": (new_bits, old_tensors, step.old), "truncate": (step.old, step.new, new_bits)}
        out = {}
        for kind in KINDS:
            held, tensors, target = trials[kind]
            version, _, _ = self.publish(tensors)
            cache = self.download(version)
            victim = max((p for p in cache.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
            data = victim.read_bytes()
            bad, offset = corrupt(kind, data)
            victim.write_bytes(bad)
            error = reload_error = None
            try:
                self.store.fetch(version, sync_dir=self.sync)
            except Exception as e:  # noqa: BLE001 - whatever the store raises is what it does
                error = e
            wrote = not self._checkpoint_holds(held)
            try:
                self.reload(version)
            except Exception as e:  # noqa: BLE001
                reload_error = e
            served_old, served_new = self.engine.holds(held), self.engine.holds(target)
            # SkyRL's recovery: the next fetch of the version
            with open(self.store.state_path) as f:
                in_progress = bool(json.load(f).get("write_in_progress"))
            before, t, retry_error = _files(Path(self.store.deltas_dir)), time.perf_counter(), None
            try:
                self.store.fetch(version, sync_dir=self.sync)
                self.reload(version)
            except Exception as e:  # noqa: BLE001
                retry_error = e
            retry_s = time.perf_counter() - t
            after = _files(Path(self.store.deltas_dir))
            refetched = sum(v[2] for k, v in after.items() if before.get(k) != v)
            recovered = retry_error is None and self.engine.holds(target)
            repair = None
            if not recovered:  # so the run can go on: what an operator would do
                shutil.rmtree(cache, ignore_errors=True)
                self.store.fetch(version, sync_dir=self.sync)
                self.reload(version)
                if not self.engine.holds(target):
                    raise RuntimeError(f"SkyRL's store did not reach version {version} after the repair")
                repair = "deleted the cached delta and fetched again"
            out[kind] = verdict(payload=victim.name, payload_bytes=len(data), offset=offset, error=error, wrote=wrote,
                                served_old=served_old, served_new=served_new, recovery=RECOVERY, recovered=recovered,
                                refetched_bytes=refetched, reset_and_replay=in_progress,
                                replayed_versions=version if in_progress else 0, retry_seconds=retry_s,
                                retry_error=describe(retry_error), reload_refused=describe(reload_error),
                                operator_repair=repair)
        return out
