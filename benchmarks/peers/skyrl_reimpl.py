"""SkyRL 0.4.0's checkpoint-delta sync, reimplemented from its source for when its package is not installed
(``peer_code="reimplemented"``; :mod:`.skyrl_code` says why it was used).

What ``skyrl/backends/skyrl_train/weight_sync/delta/checkpoint.py`` does, kept to the parts the bench
runs, local directories only, one thread: the publisher keeps a CPU snapshot of the base checkpoint's
bytes; per version it takes the xxh3-128 of each tensor's new bytes, XORs them with the snapshot and,
when any byte changed, compresses the dense mask with zstd level 1 into one safetensors file of uint8
tensors, then writes ``manifest.json`` (version, base version, a record per tensor with its checksum).
The store keeps a local copy of the base checkpoint; ``fetch`` downloads each missing version into its
cache, reads every payload, XORs each mask into the checkpoint file through ``mmap`` and re-hashes the
tensor; a mismatch deletes the cached delta and raises. A state file marks the write in progress, and the
next ``fetch`` after a failure resets from the base and replays every version.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
from pathlib import Path

import numpy as np
import zstandard

_FILE = "delta-rank00000-file000000.safetensors"


class ChecksumMismatchError(Exception):
    pass


def version_name(version: int) -> str:
    return f"delta-{version:08d}"


def cache_name(uri: str) -> str:
    base = "".join(c if c.isalnum() or c in "-_." else "_" for c in os.path.basename(uri))
    return f"{base[:143]}_{hashlib.sha256(uri.encode()).hexdigest()[:16]}"


def _checksum(data) -> str:
    import xxhash

    return xxhash.xxh3_128(data).hexdigest()


def _locations(directory: Path) -> dict:
    """Every tensor of a checkpoint directory: name -> (file, byte offset, bytes)."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                out[name] = (path, 8 + n + begin, end - begin)
    return out


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def fetch_delta_directory(uri: str, cache_dir: Path) -> tuple[dict, Path]:
    """Copy a published version's manifest and missing payload files into ``cache_dir``."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    if not (cache_dir / "manifest.json").exists():
        _copy(Path(uri) / "manifest.json", cache_dir / "manifest.json")
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    for name in manifest["payload_files"]:
        if not (cache_dir / name).exists():
            _copy(Path(uri) / name, cache_dir / name)
    return manifest, cache_dir


class Publisher:
    """The trainer's side: XOR against a CPU snapshot, zstd 1, safetensors + manifest."""

    def __init__(self, base_model_path: str, sync_dir: str, publish_staging_dir: str):
        self.base, self.sync_dir, self.version, self.snapshot = Path(base_model_path), sync_dir, 0, {}

    def create_delta_files(self, source) -> dict:
        import torch
        from safetensors.torch import save_file

        locs, target = _locations(self.base), self.version + 1
        out_dir = Path(self.sync_dir) / version_name(target)
        out_dir.mkdir(parents=True, exist_ok=True)
        records, payload = [], {}
        for name, tensor in source:
            path, offset, nbytes = locs[name]
            if name not in self.snapshot:
                with path.open("rb") as f:
                    f.seek(offset)
                    self.snapshot[name] = np.frombuffer(f.read(nbytes), np.uint8).copy()
            base = self.snapshot[name]
            cur = tensor.detach().contiguous().view(torch.uint8).reshape(-1).numpy().copy()
            checksum = _checksum(cur)
            np.bitwise_xor(cur, base, out=cur)
            if np.count_nonzero(cur):
                comp = zstandard.ZstdCompressor(level=1).compress(cur)
                payload[name] = torch.frombuffer(bytearray(comp), dtype=torch.uint8)
                records.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                                "shape": list(tensor.shape), "uncompressed_num_bytes": int(base.nbytes),
                                "compressed_num_bytes": len(comp), "payload_file": _FILE, "payload_key": name,
                                "checksum": checksum, "checksum_algorithm": "xxh3-128"})
            np.bitwise_xor(base, cur, out=base)
        if payload:
            save_file(payload, str(out_dir / _FILE))
        self.version = target
        return {"version": target, "base_version": target - 1, "tensors": records,
                "payload_files": [_FILE] if payload else []}

    def publish(self, result: dict) -> dict:
        records = result["tensors"]
        manifest = {**result, "total_uncompressed_num_bytes": sum(r["uncompressed_num_bytes"] for r in records),
                    "total_compressed_num_bytes": sum(r["compressed_num_bytes"] for r in records)}
        uri = Path(self.sync_dir) / version_name(result["version"])
        (uri / "manifest.json").write_text(json.dumps(manifest))
        return {"version": result["version"], "uri": str(uri)}


class Store:
    """The inference worker's side: a local checkpoint patched in place, re-hashed, reset and replayed."""

    def __init__(self, base_model_path: str, local_checkpoint_dir: str):
        self.base, root = Path(base_model_path), Path(local_checkpoint_dir)
        self.weights_dir, self.deltas_dir = root / "weights", root / "deltas"
        self.state_path = root / ".skyrl_weight_sync" / "state.json"
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        self.deltas_dir.mkdir(parents=True, exist_ok=True)
        if not self.state_path.exists():
            self._reset()

    def _state(self) -> dict:
        return json.loads(self.state_path.read_text())

    def _write(self, version: int, in_progress: bool = False, target: int | None = None) -> None:
        self.state_path.write_text(json.dumps({"version": version, "write_in_progress": in_progress,
                                               "target_version": target}))

    def _reset(self) -> None:
        shutil.rmtree(self.weights_dir, ignore_errors=True)
        self._write(0)

    def fetch(self, target_version: int, sync_dir: str) -> dict:
        stats = {"fetch_s": 0.0, "apply_s": 0.0, "reset_s": 0.0}
        state = self._state()
        if state["write_in_progress"]:
            self._reset()
            stats["reset_s"] = 1e-9  # (the reset happened; its seconds are not what the bench reads)
            state = self._state()
        start = state["version"]
        if start == target_version:
            return stats
        if start > target_version:
            raise ValueError(f"Local checkpoint version {start} is ahead of requested target_version {target_version}")
        self._write(start, True, target_version)
        try:
            for version in range(start + 1, target_version + 1):
                uri = f"{sync_dir.rstrip('/')}/{version_name(version)}"
                cache = self.deltas_dir / cache_name(uri)
                manifest, _ = fetch_delta_directory(uri, cache)
                if manifest["version"] != version or manifest["base_version"] != version - 1:
                    raise ValueError(f"Manifest versions {manifest['version']}/{manifest['base_version']} do not "
                                     f"follow local version {version - 1}")
                try:
                    self._apply(manifest, cache)
                except ChecksumMismatchError as e:
                    shutil.rmtree(cache, ignore_errors=True)
                    raise RuntimeError(f"Checksum mismatch for delta URI: {uri}: {e}") from e
            self._write(target_version)
        except Exception:
            self._write(start, True, target_version)
            raise
        return stats

    def _apply(self, manifest: dict, cache: Path) -> None:
        from safetensors import safe_open

        if not manifest["tensors"]:
            return
        if not self.weights_dir.exists():
            shutil.copytree(self.base, self.weights_dir)
        locs = _locations(self.weights_dir)
        payloads = []
        for rec in manifest["tensors"]:
            with safe_open(str(cache / rec["payload_file"]), framework="pt") as f:
                payloads.append((rec, f.get_tensor(rec["payload_key"]).numpy().tobytes()))
        mismatches, maps = [], {}
        try:
            for rec, comp in payloads:
                path, offset, nbytes = locs[rec["name"]]
                if path not in maps:
                    fh = path.open("r+b")
                    maps[path] = (fh, mmap.mmap(fh.fileno(), 0))
                patch = zstandard.ZstdDecompressor().decompress(comp, max_output_size=rec["uncompressed_num_bytes"])
                if len(patch) != nbytes:
                    raise ValueError(f"Patch for {rec['name']!r} has {len(patch)} bytes, expected {nbytes}")
                region = np.ndarray((nbytes,), np.uint8, buffer=maps[path][1], offset=offset)
                region ^= np.frombuffer(patch, np.uint8)
                if _checksum(memoryview(region)) != rec["checksum"]:
                    mismatches.append(rec["name"])
                del region
        finally:
            for fh, mm in maps.values():
                mm.close()
                fh.close()
        if mismatches:
            raise ChecksumMismatchError(f"Post-apply checksum mismatch for {len(mismatches)} tensor(s)")

    def validate_ready(self, target_version: int) -> None:
        state = self._state()
        if state["write_in_progress"]:
            raise RuntimeError("Local checkpoint has write_in_progress=True for "
                               f"target_version={state['target_version']}")
        if state["version"] != target_version:
            raise RuntimeError(f"Local checkpoint version {state['version']} does not match "
                               f"target_version {target_version}")

    def iter_tensors(self):
        from safetensors import safe_open

        directory = self.weights_dir if self.weights_dir.exists() else self.base
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for k in f.keys():
                    yield k, f.get_tensor(k)
