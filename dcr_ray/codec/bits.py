"""Dtypes on the wire and the integer views that make every comparison and write bit-exact.

dcr_ray never compares or combines floating-point values. Every tensor is viewed as an unsigned
integer array of the same element size (``bfloat16 -> uint16``, ``float8_e4m3fn -> uint8``,
``bool -> uint8``, ...), so NaN payloads, +0/-0, infinities and subnormals are just bit patterns.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from dcr_ray.errors import TargetMismatchError

if TYPE_CHECKING:  # annotations only: torch is imported where it runs (a relay reads frames, never tensors)
    import torch

#: The wire names of the dtypes dcr_ray carries, part of the frame format (see :mod:`~dcr_ray.codec.format`);
#: :data:`WIRE_DTYPES` maps each to its torch dtype.
WIRE_NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
              "float8_e4m3fn", "float8_e5m2")

#: Element width in bytes -> (numpy unsigned dtype, numpy dtype of the torch view): see :func:`torch_int`.
_NP_BY_WIDTH = {1: (np.uint8, np.uint8), 2: (np.uint16, np.int16), 4: (np.uint32, np.int32), 8: (np.uint64, np.int64)}


@functools.cache
def _torch_tables() -> tuple[dict, dict, dict]:
    """(wire name -> torch dtype, torch dtype -> wire name, width -> torch integer view dtype), built when
    first needed: torch lacks most operations on its 16/32/64-bit unsigned types, so its views are signed
    beyond one byte; one byte stays unsigned (bool and uint8 tensors view as uint8)."""
    import torch

    wire = {name: getattr(torch, name) for name in WIRE_NAMES}
    views = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return wire, {dt: name for name, dt in wire.items()}, views


def __getattr__(name: str):
    if name == "WIRE_DTYPES":  # wire name -> torch dtype (PEP 562: torch is imported on first use)
        return dict(_torch_tables()[0])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def wire_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; raises :class:`TargetMismatchError` for unsupported dtypes."""
    try:
        return _torch_tables()[1][dtype]
    except KeyError:
        raise TargetMismatchError(
            f"dtype {dtype} is not supported by dcr_ray; supported: {sorted(WIRE_NAMES)}"
        ) from None


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype for a wire name (raises :class:`TargetMismatchError` if unknown)."""
    try:
        return _torch_tables()[0][name]
    except (KeyError, TypeError):
        raise TargetMismatchError(f"unknown wire dtype {name!r}; known: {sorted(WIRE_NAMES)}") from None


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    import torch

    return torch.empty((), dtype=dtype).element_size()


def np_uint(width: int) -> type[np.unsignedinteger]:
    """The numpy unsigned integer type of ``width`` bytes (1, 2, 4 or 8): how the codec holds bits."""
    return _NP_BY_WIDTH[width][0]


def np_int(width: int) -> type[np.integer]:
    """The numpy integer type matching :func:`torch_int` of ``width`` (``torch.from_numpy`` gives that dtype)."""
    return _NP_BY_WIDTH[width][1]


def torch_int(width: int) -> torch.dtype:
    """The torch integer dtype that views ``width``-byte elements for bitwise work: ``uint8`` for one
    byte, signed beyond (torch lacks most operations on its wider unsigned types)."""
    return _torch_tables()[2][width]


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
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    tv = torch_int(a.element_size())
    return torch.equal(a.contiguous().view(tv), b.contiguous().view(tv))
