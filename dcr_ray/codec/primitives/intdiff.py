"""Integer differences: the ``ADD`` value coding, ``new = old + d (mod 2**(8w))`` on the unsigned view.

A small floating-point update moves a value by a few units in the last place, so ``new - old`` on the
integer view is a small signed number even where the XOR mask is not (a step across a power of two
flips every mantissa bit: XOR ``0x00ff`` for BF16, difference ``1``). The receiver holds ``old``, so the
difference is exactly invertible: it adds ``d`` modulo ``2**(8w)``, whatever the bits mean (NaN
payloads, infinities, -0: only the integer views take part).

On the wire a difference travels *zigzagged* (``0, -1, 1, -2, ... -> 0, 1, 2, 3, ...``) so that small
magnitudes of either sign fill only the low byte plane (:mod:`~dcr_ray.codec.primitives.planes`). A decoded
``ADD`` item carries ``d`` itself (unsigned, modulo ``2**(8w)``), never the zigzag form: apply is one
wrapping add per position. The mapping is a bijection on ``w``-byte words, so every bit pattern a
frame carries decodes to some difference (only bool tensors, whose values must stay 0 or 1, refuse
``ADD`` items; see :mod:`~dcr_ray.codec.decoding.decode`).
"""

from __future__ import annotations

import numpy as np


def difference(new: np.ndarray, xor: np.ndarray) -> np.ndarray:
    """``new - old`` (modulo the word size) of changed elements, from their new bits and XOR masks."""
    old = np.bitwise_xor(new, xor)
    return np.subtract(new, old, out=old)  # unsigned arrays wrap: exactly new - old mod 2**(8w)


def zigzag(d: np.ndarray) -> np.ndarray:
    """The zigzag form of differences ``d`` (unsigned words read as two's complement)."""
    t = d.dtype.type
    sign = np.right_shift(d, t(8 * d.dtype.itemsize - 1))  # 1 where negative
    out = np.left_shift(d, t(1))
    np.bitwise_xor(out, np.subtract(t(0), sign), out=out)  # 0 - 1 wraps to all ones
    return out


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of :func:`zigzag`: the differences (unsigned words, modulo the word size)."""
    t = z.dtype.type
    out = np.right_shift(z, t(1))
    np.bitwise_xor(out, np.subtract(t(0), np.bitwise_and(z, t(1))), out=out)
    return out
