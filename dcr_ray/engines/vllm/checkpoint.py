"""Reading a Hugging Face checkpoint directory: its safetensors files, tensors and tensor specs.

The checkpoint's tensor names are the canonical names of a vLLM engine; both the backend (host mirror,
specs) and the workers (loader capture) read it through these functions.
"""

from __future__ import annotations

import glob
import os
from typing import Iterable, Iterator, Sequence

import torch

from dcr_ray.errors import BackendError

#: safetensors dtype -> dcr_ray wire dtype name.
_ST_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
              "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def checkpoint_files(directory: str) -> list[str]:
    """The ``*.safetensors`` files of a Hugging Face checkpoint directory, sorted."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise BackendError(f"no *.safetensors files in {directory!r}: the vLLM backend needs a Hugging Face "
                           f"checkpoint directory (save_pretrained writes one)")
    return files


def iter_checkpoint(files: Sequence[str], names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, CPU tensor)`` from safetensors ``files`` one tensor at a time (``names``: a subset)."""
    from safetensors import safe_open

    want = None if names is None else set(names)
    for f in files:
        with safe_open(f, framework="pt", device="cpu") as fh:
            for k in fh.keys():
                if want is None or k in want:
                    yield k, fh.get_tensor(k)


def checkpoint_specs(directory: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (wire dtype, shape) of every tensor in a checkpoint, read from the safetensors headers."""
    from safetensors import safe_open

    out = {}
    for f in checkpoint_files(directory):
        with safe_open(f, framework="pt", device="cpu") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                dt = _ST_DTYPES.get(sl.get_dtype())
                if dt is None:
                    raise BackendError(f"{k}: safetensors dtype {sl.get_dtype()} is not supported by dcr_ray")
                out[k] = (dt, tuple(sl.get_shape()))
    return out
