"""Two compact peer encodings for side-by-side byte counts: what other RL systems put on the wire for the
same change.

Both are written from their public descriptions (see ``shared/REFERENCE.md``), compactly and without
their code; each has a decoder so the benchmarks can check that it round-trips bit-exactly. ``dcr-ray
bench codec`` counts their bytes; ``dcr-ray bench peers`` also times them and corrupts their payloads.

``areal``  AReaL-DTE style: per tensor, int32 flat indices + raw new bits (overwrite), no compression;
           the whole tensor's raw bits instead when the sparse form exceeds 0.9x of dense.
``slime``  slime / SGLang-delta style: per tensor, uint16 gaps between consecutive changed indices (a gap
           that does not fit is the escape ``0xFFFF`` followed by the gap as two uint16 words), and the
           absolute new bits (overwrite); each stream compressed with zstd (default level 3).

A peer payload here is ``{name: bytes}`` per tensor plus a small fixed header per tensor (name, sizes),
counted in :func:`wire_bytes`.
"""

from __future__ import annotations

import struct
from typing import Callable, Mapping

import numpy as np
import zstandard

#: Bytes of per-tensor metadata a peer sends besides its streams (sizes, counts, a mode byte).
TENSOR_HEADER_BYTES = 16
AREAL_DENSE_FALLBACK = 0.9
SLIME_ZSTD_LEVEL = 3
_ESC = 0xFFFF


# ---------------------------------------------------------------------------------------------------
# AReaL-DTE style: int32 index + raw value, dense fallback
# ---------------------------------------------------------------------------------------------------
def areal_encode(pos: np.ndarray, new_bits: np.ndarray, numel: int) -> bytes:
    """Encode changed ``pos`` (sorted flat indices) of a tensor whose new bits are ``new_bits`` (all)."""
    w = new_bits.dtype.itemsize
    if len(pos) * (4 + w) > AREAL_DENSE_FALLBACK * numel * w:
        return b"D" + new_bits.tobytes()
    return b"S" + pos.astype("<i4").tobytes() + new_bits[pos].tobytes()


def areal_apply(payload: bytes, target_bits: np.ndarray) -> None:
    """Apply an :func:`areal_encode` payload to a flat bit view in place."""
    w = target_bits.dtype.itemsize
    body = memoryview(payload)[1:]
    if payload[:1] == b"D":
        target_bits[:] = np.frombuffer(body, target_bits.dtype)
        return
    n = len(body) // (4 + w)
    idx = np.frombuffer(body[: 4 * n], "<i4")
    target_bits[idx] = np.frombuffer(body[4 * n:], target_bits.dtype)


# ---------------------------------------------------------------------------------------------------
# slime style: uint16 gaps with escape + zstd, overwrite values + zstd
# ---------------------------------------------------------------------------------------------------
def _gaps_u16(pos: np.ndarray) -> np.ndarray:
    gaps = np.diff(pos.astype(np.int64), prepend=0)
    big = np.flatnonzero(gaps >= _ESC)
    if not len(big):
        return gaps.astype("<u2")
    # each escaped gap becomes three words: ESC, low 16 bits, high 16 bits (gaps < 2**32)
    out = np.empty(len(gaps) + 2 * len(big), "<u2")
    where = big + 2 * np.arange(len(big))  # output index of each escape marker
    keep = np.ones(len(out), bool)
    keep[where] = keep[where + 1] = keep[where + 2] = False
    out[keep] = np.delete(gaps, big)
    out[where] = _ESC
    out[where + 1] = gaps[big] & 0xFFFF
    out[where + 2] = gaps[big] >> 16
    return out


def _ungaps_u16(words: np.ndarray) -> np.ndarray:
    words = words.astype(np.int64)
    # an escape's two payload words may themselves be 0xFFFF: walk the (rare) candidates in order
    esc, skip_to = [], -1
    for c in np.flatnonzero(words == _ESC).tolist():
        if c > skip_to:
            esc.append(c)
            skip_to = c + 2
    if esc:
        e = np.asarray(esc)
        words[e] = words[e + 1] | (words[e + 2] << 16)
        words = np.delete(words, np.concatenate([e + 1, e + 2]))
    return np.cumsum(words)


def slime_encode(pos: np.ndarray, new_bits: np.ndarray, numel: int, level: int = SLIME_ZSTD_LEVEL) -> bytes:
    cctx = zstandard.ZstdCompressor(level=level)
    g = cctx.compress(_gaps_u16(pos).tobytes())
    v = cctx.compress(new_bits[pos].tobytes())
    return struct.pack("<II", len(g), len(v)) + g + v


def slime_apply(payload: bytes, target_bits: np.ndarray) -> None:
    lg, lv = struct.unpack_from("<II", payload)
    d = zstandard.ZstdDecompressor()
    gaps = np.frombuffer(d.decompress(payload[8:8 + lg]), "<u2")
    vals = np.frombuffer(d.decompress(payload[8 + lg:8 + lg + lv]), target_bits.dtype)
    target_bits[_ungaps_u16(gaps)] = vals


PEERS: dict[str, tuple[Callable, Callable]] = {
    "areal": (areal_encode, areal_apply),
    "slime": (slime_encode, slime_apply),
}


def encode_all(name: str, changes: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, bytes]:
    """Encode every tensor's change (``tensor -> (sorted positions, new flat bits)``) with peer ``name``."""
    enc = PEERS[name][0]
    return {t: enc(pos, nb, len(nb)) for t, (pos, nb) in changes.items() if len(pos)}


def apply_all(name: str, payloads: Mapping[str, bytes], targets: Mapping[str, np.ndarray]) -> None:
    """Apply ``payloads`` of peer ``name`` to flat bit views ``targets`` in place."""
    app = PEERS[name][1]
    for t, p in payloads.items():
        app(p, targets[t])


def wire_bytes(payloads: Mapping[str, bytes]) -> int:
    """Bytes on the wire: every stream plus a fixed header and the name per tensor."""
    return sum(len(p) + TENSOR_HEADER_BYTES + len(t.encode()) for t, p in payloads.items())
