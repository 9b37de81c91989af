"""``dcr-ray bench peers``: the peers side by side on the same optimizer steps, through their own code where
it runs here.

The two compact encodings written here from the peers' descriptions (AReaL-DTE style, slime style) live in
:mod:`.encodings`; their names stay importable from ``benchmarks.peers`` (the codec and refit benchmarks
count their bytes).
"""

from __future__ import annotations

from benchmarks.peers.encodings import (AREAL_DENSE_FALLBACK, PEERS, SLIME_ZSTD_LEVEL, TENSOR_HEADER_BYTES, apply_all,
                                        areal_apply, areal_encode, encode_all, slime_apply, slime_encode, wire_bytes)

__all__ = [
    "AREAL_DENSE_FALLBACK", "PEERS", "SLIME_ZSTD_LEVEL", "TENSOR_HEADER_BYTES", "apply_all", "areal_apply",
    "areal_encode", "encode_all", "slime_apply", "slime_encode", "wire_bytes",
]
