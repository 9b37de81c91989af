"""Dtypes on the wire and the integer views that make every comparison and write bit-exact.

dcr_ray never compares or combines floating-point values. Every tensor is viewed as an unsigned
integer array of the same element size (``bfloat16 -> uint16``, ``float8_e4m3fn -> uint8``,
``bool -> uint8``, ...), so NaN payloads, +0/-0, infinities and subnormals are just bit patterns.
"""

from __future__ import annotations

import numpy as np
import torch

from dcr_ray.errors import TargetMismatchError

#: Wire name -> torch dtype. The wire names are part of the frame format (see :mod:`~dcr_ray.codec.format`).
WIRE_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_NAME_OF = {dt: name for name, dt in WIRE_DTYPES.items()}

#: Element width in bytes -> (torch integer view dtype, numpy unsigned dtype, numpy dtype of the torch view).
#: torch lacks most operations on its 16/32/64-bit unsigned types, so its views are signed beyond one byte;
#: one byte stays unsigned (bool and uint8 tensors view as uint8).
_BY_WIDTH = {
    1: (torch.uint8, np.uint8, np.uint8),
    2: (torch.int16, np.uint16, np.int16),
    4: (torch.int32, np.uint32, np.int32),
    8: (torch.int64, np.uint64, np.int64),
}


def wire_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; raises :class:`TargetMismatchError` for unsupported dtypes."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise TargetMismatchError(
            f"dtype {dtype} is not supported by dcr_ray; supported: {sorted(WIRE_DTYPES)}"
        ) from None


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype for a wire name (raises :class:`TargetMismatchError` if unknown)."""
    try:
        return WIRE_DTYPES[name]
    except (KeyError, TypeError):
        raise TargetMismatchError(f"unknown wire dtype {name!r}; known: {sorted(WIRE_DTYPES)}") from None


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def np_uint(width: int) -> type[np.unsignedinteger]:
    """The numpy unsigned integer type of ``width`` bytes (1, 2, 4 or 8): how the codec holds bits."""
    return _BY_WIDTH[width][1]


def np_int(width: int) -> type[np.integer]:
    """The numpy integer type matching :func:`torch_int` of ``width`` (``torch.from_numpy`` gives that dtype)."""
    return _BY_WIDTH[width][2]


def torch_int(width: int) -> torch.dtype:
    """The torch integer dtype that views ``width``-byte elements for bitwise work: ``uint8`` for one
    byte, signed beyond (torch lacks most operations on its wider unsigned types)."""
    return _BY_WIDTH[width][0]


def bits_view(t: torch.Tensor) -> np.ndarray:
    """A flat, zero-copy numpy unsigned-integer view of a contiguous CPU tensor's bits.

    Writes through the view change the tensor: this is how payloads are applied in place.
    """
    if t.device.type != "cpu":
        raise TargetMismatchError(f"bits_view needs a CPU tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise TargetMismatchError("bits_view needs a contiguous tensor (call .contiguous() on a copy)")
    w = t.element_size()
    return t.detach().reshape(-1).view(torch_int(w)).numpy().view(np_uint(w))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same dtype, shape and stored bits (NaN payloads and -0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    tv = torch_int(a.element_size())
    return torch.equal(a.contiguous().view(tv), b.contiguous().view(tv))
