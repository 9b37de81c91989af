"""The two corruptions every peer's receiver is run on, and how its behaviour is judged from what happened.

A corrupted payload is the peer's largest payload of the step (a frame, a file, a message) with either
its middle byte flipped (``^ 0xFF``) or everything from its middle on cut off. The receiver runs on it as
it would on a good one; then the bench reads the bits (integer views) and judges:

- ``detected``: the receiver raised;
- ``refused_before_write``: it raised and no bit of its storage differs from what it held before that
  payload (SkyRL's storage is its local checkpoint file, the others' the engine's tensors);
- ``wrong_bits_served``: what the engine would serve afterwards is wrong: anything but the new version
  when the receiver reported success, anything but the old or the new version when it raised (a mix);
- ``recovered`` and ``refetched_bytes``: the peer's own recovery, when it has one, run and checked
  (dcr_ray: the retry's OVERWRITE frames of the whole changed set; SkyRL: its next fetch, which resets
  from the base and replays), with the bytes it moved again.
"""

from __future__ import annotations

KINDS = ("flip", "truncate")


def corrupt(kind: str, data: bytes) -> tuple[bytes, int]:
    """``data`` with the corruption ``kind`` applied, and the offset it hit."""
    mid = len(data) // 2
    if kind == "flip":
        b = bytearray(data)
        b[mid] ^= 0xFF
        return bytes(b), mid
    if kind == "truncate":
        return bytes(data[:mid]), mid
    raise ValueError(f"corruption kind must be one of {KINDS}, got {kind!r}")


def describe(exc: BaseException | None) -> str | None:
    """An exception as ``Type: message`` (first 160 characters), or None."""
    return None if exc is None else f"{type(exc).__name__}: {exc}"[:160]


def verdict(*, payload: str, payload_bytes: int, offset: int, error: BaseException | None, wrote: bool,
            served_old: bool, served_new: bool, recovery: str, recovered: bool | None = None,
            refetched_bytes: int = 0, reset_and_replay: bool = False, **extra) -> dict:
    """One corruption's outcome (see the module docstring), every judgement from a measured fact."""
    detected = error is not None
    return {
        "payload": payload, "payload_bytes": payload_bytes, "offset": offset,
        "detected": detected, "error": describe(error),
        "refused_before_write": detected and not wrote,
        "wrong_bits_served": (not served_new) if not detected else not (served_old or served_new),
        "reset_and_replay": reset_and_replay, "recovered": recovered, "refetched_bytes": int(refetched_bytes),
        "recovery": recovery, **extra,
    }


def largest(payloads: list) -> int:
    """Index of the largest payload (the first of equals)."""
    return max(range(len(payloads)), key=lambda i: (len(payloads[i]), -i))
