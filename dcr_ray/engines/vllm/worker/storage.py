"""Live parameter storage as bits: integer views, storage identity, sparse writes and digests.

Every comparison and write here is on integer views of the element size (``bfloat16 -> int16``, ...),
never on floating-point values, so NaN payloads, -0 and subnormals are plain bit patterns.
"""

from __future__ import annotations

import hashlib

import torch

from dcr_ray.codec.bits import torch_int

#: Element widths (bytes) that have an integer view (:func:`~dcr_ray.codec.bits.torch_int`).
_WIDTHS = (1, 2, 4, 8)


def int_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer dtype of its element size (any strides): uint8 for one byte, signed
    beyond (torch lacks most ops on uint16/32/64)."""
    return t.view(torch_int(t.element_size()))


def storage_key(t: torch.Tensor):
    """An identity of ``t``'s storage (device and data pointer), or None when it has none."""
    try:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr == 0 or st.nbytes() == 0:
            return None
        return (t.device.type, t.device.index, ptr)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def storage_flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view over all of ``t``'s storage (offset 0), in ``t``'s dtype."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.as_strided(t.detach(), (n,), (1,), 0)


def scatter(flat: torch.Tensor, pos: torch.Tensor, values: torch.Tensor, *, xor: bool) -> None:
    """``flat[pos] ^= values`` (``xor``) or ``flat[pos] = values``, in place; ``pos`` unique.

    On CUDA the CuPy kernels of ``cuda_ext`` are used when that package and CuPy are importable;
    otherwise (and on CPU) PyTorch indexing does the same writes.
    """
    if flat.is_cuda:
        try:
            import cuda_ext
        except ImportError:
            cuda_ext = None
        if cuda_ext is not None and cuda_ext.cupy_available():
            (cuda_ext.scatter_xor if xor else cuda_ext.scatter_overwrite)(flat, pos, values)
            return
    if xor:
        flat.index_put_((pos,), flat.index_select(0, pos) ^ values)
    else:
        flat.index_put_((pos,), values)


def storage_digests(model: torch.nn.Module) -> dict[str, str]:
    """name -> BLAKE2b digest of the bits of every parameter and buffer the model serves with."""
    out = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        if t is None or t.numel() == 0:
            continue
        data = t.detach().contiguous().cpu()
        view = int_view(data) if data.element_size() in _WIDTHS else data
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{data.dtype}{tuple(data.shape)}".encode())
        h.update(view.numpy().tobytes() if view.dtype != torch.bool else view.to(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()
    return out
