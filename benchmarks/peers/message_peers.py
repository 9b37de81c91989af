"""The peers whose step is one message of per-tensor streams (:mod:`.container`), all run in this process:
vLLM ``sparse_nccl`` (bytes from the format, vLLM's own apply), XOR + zstd at levels 1 and 3, and the
AReaL- and slime-style encodings of :mod:`.encodings` (reimplemented from their descriptions).

Each is timed as its two sides: the sender finds the changed elements and builds the message from the
committed bits and the new tensors; the receiver, handed the message and an engine holding the committed
bits (set back untimed before every repeat), leaves the engine holding the new version. Its corruption
trials run that receiver on the corrupted message and read the engine's bits afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from benchmarks.codec.timing import timed
from benchmarks.peers import container, encodings, sparse_nccl, xor_zstd
from benchmarks.peers.corrupt import KINDS, corrupt, verdict


@dataclass
class MessagePeer:
    """A peer as its sender's per-tensor stream and its receiver of the whole message."""

    name: str
    peer_code: str
    note: str
    encode: Callable  # (old flat bits, new flat bits) -> stream bytes, or None when nothing changed
    receive: Callable  # (message, Engine) -> None, the engine holding the new version after it
    recovery: str  # what the peer does after a payload it cannot use

    def send(self, step) -> bytes:
        """The message of one step."""
        from dcr_ray.codec import bits_view

        streams, numels = {}, {}
        for n, t in step.new.items():
            nb = bits_view(t)
            s = self.encode(step.old[n], nb)
            if s is not None:
                streams[n], numels[n] = s, len(nb)
        return container.pack(streams, numels)

    def measure(self, step, engine, repeats: int) -> dict:
        """Wire bytes, every repeat's sender and receiver seconds (wall and CPU), bit-exactness; the message."""
        sent = timed(lambda: self.send(step), repeats)
        msg = sent.result
        got = timed(lambda _: self.receive(msg, engine), repeats, setup=lambda: engine.hold(step.old))
        return {"wire_bytes": len(msg), "sender": sent, "receiver": got, "bit_exact": engine.holds(step.new),
                "message": msg}

    def corruption(self, step, engine, msg: bytes) -> dict:
        """Each corruption of the step's message, run through the receiver and judged on the engine's bits."""
        out = {}
        for kind in KINDS:
            bad, offset = corrupt(kind, msg)
            engine.hold(step.old)
            error = None
            try:
                self.receive(bad, engine)
            except Exception as e:  # noqa: BLE001 - whatever the receiver raises is what it does
                error = e
            old, new = engine.holds(step.old), engine.holds(step.new)
            out[kind] = verdict(payload="message", payload_bytes=len(msg), offset=offset, error=error, wrote=not old,
                                served_old=old, served_new=new, recovery=self.recovery,
                                hit=container.locate(msg, offset))
        return out


def _positions(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.bitwise_xor(old, new))


def _encoding(name: str) -> Callable:
    enc = encodings.PEERS[name][0]

    def encode(old, new):
        pos = _positions(old, new)
        return enc(pos, new, len(new)) if len(pos) else None
    return encode


def _streaming(apply_one: Callable) -> Callable:
    """A receiver that applies each record as it arrives (a record cut short raises after the ones before)."""
    def receive(msg, engine):
        views = engine.views()
        for name, _numel, stream in container.unpack(msg):
            apply_one(bytes(stream), views[name])
    return receive


def message_peers() -> list[MessagePeer]:
    """The peers of this module, in table order."""
    none = "none: the receiver has no check or retry of its own"
    peers = [MessagePeer(
        "vllm_sparse_nccl", "format", "bytes from the format (NCCL does not run on CPU); apply: vLLM 0.32's own "
        "load_checkpoint_weight_patches through the engine's loader", sparse_nccl.encode, sparse_nccl.apply,
        "none: load_checkpoint_weight_patches 'does not roll back a partial update' (vLLM's docstring)")]
    for level in (1, 3):
        peers.append(MessagePeer(f"xor_zstd{level}", "reimplemented", f"written here: dense XOR mask, zstd {level}",
                                 lambda o, n, level=level: xor_zstd.encode(o, n, level), _streaming(xor_zstd.apply),
                                 none))
    peers.append(MessagePeer("areal", "reimplemented", "written here from AReaL-DTE's description (no checksum)",
                             _encoding("areal"), _streaming(encodings.areal_apply),
                             none + " (AReaL-DTE checks base/payload versions)"))
    peers.append(MessagePeer("slime", "reimplemented", "written here from slime's description (its checksums are "
                             "not reimplemented)", _encoding("slime"), _streaming(encodings.slime_apply),
                             none + " (slime's own checksums are not reimplemented here)"))
    return peers
