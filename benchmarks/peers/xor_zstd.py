"""XOR + zstd: each changed tensor's dense XOR mask (new bits ^ old bits, every element), compressed with
zstd at one level, no checksum and no positions: the construction SkyRL wraps in safetensors and a manifest,
without the wrapping. Written here; the receiver XORs each mask into the engine's tensor as it arrives."""

from __future__ import annotations

import numpy as np
import zstandard


def encode(old: np.ndarray, new: np.ndarray, level: int) -> bytes | None:
    """The compressed XOR mask of one tensor's flat bits, or None when no bit changed."""
    mask = np.bitwise_xor(old, new)
    if not mask.any():
        return None
    return zstandard.ZstdCompressor(level=level).compress(mask.tobytes())


def apply(stream, view: np.ndarray) -> None:
    """XOR the mask in ``stream`` into the flat bit view ``view`` in place."""
    raw = zstandard.ZstdDecompressor().decompress(stream, max_output_size=view.nbytes)
    if len(raw) != view.nbytes:
        raise ValueError(f"mask has {len(raw)} bytes, the tensor {view.nbytes}")
    view ^= np.frombuffer(raw, view.dtype)
