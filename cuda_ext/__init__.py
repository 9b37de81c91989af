"""CUDA kernels for dcr_ray's hot loops, loaded with CuPy, with the numpy path as automatic fallback.

- :func:`diff_compact` — owner side: positions where two bit arrays differ, the XOR masks there and the
  new bits there, in one fused compare + compaction (sorted by position, like
  :func:`dcr_ray.codec.encoding.scan.changed_positions`).
- :func:`scatter_xor` / :func:`scatter_overwrite` — receiver side: ``dst[pos] ^= values`` /
  ``dst[pos] = values`` in place.

Arrays may be numpy arrays, CPU or CUDA ``torch`` tensors, or CuPy arrays, of any 1/2/4/8-byte dtype
(they are reinterpreted as unsigned integers of that width: bits, never values). Device arrays run on
the GPU (CuPy kernels, on torch's current stream for torch tensors); host arrays run the numpy path,
or — ``device="gpu"``, or ``device="auto"`` with a large array and a usable GPU — are uploaded,
processed on the GPU and returned on the host. Without CuPy or a CUDA device everything runs on the
host: results are bit-for-bit the same either way (``tests/test_cuda_ext.py`` checks it on a GPU).

Not part of the ``dcr_ray`` wheel unless ``cuda_ext*`` is listed in ``[tool.setuptools.packages.find]``.
"""

from cuda_ext.api import (
    UPLOAD_MIN_ELEMS,
    cupy_available,
    diff_compact,
    on_gpu,
    scatter_overwrite,
    scatter_xor,
)

__all__ = ["UPLOAD_MIN_ELEMS", "cupy_available", "diff_compact", "on_gpu", "scatter_overwrite", "scatter_xor"]
