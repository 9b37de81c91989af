"""dcr_ray.codec: bits in, bytes out. A one-way stack: each layer imports only the layers below it, and
the two sides on top never import each other (``tests/test_import_rules.py`` checks it).

The format, at the bottom:

- :mod:`~dcr_ray.codec.format`    the signed wire frame: layout, names, limits, digest, identity
- :mod:`~dcr_ray.codec.bits`      dtypes on the wire and integer views
- :mod:`~dcr_ray.codec.packed`    the pack layout: many small tensors end to end in one pack space
- :mod:`~dcr_ray.codec.jit`       whether the compiled kernels are used, and loading them once
- :mod:`~dcr_ray.codec.threads`   the codec's worker threads; :mod:`~dcr_ray.codec.arena` stable small slices

Kernels: :mod:`~dcr_ray.codec.kernels` (one tensor's flat bits) and :mod:`~dcr_ray.codec.ptrkernels`
(many tensors by data pointer), numba definitions in ``kernels_numba`` / ``ptrkernels_numba``.

Coding primitives, each both ways on plain arrays:

- :mod:`~dcr_ray.codec.locations`  position coding (gaps / runs, narrow widths with escapes)
- :mod:`~dcr_ray.codec.classorder` positions in the class order of the old values (exponents)
- :mod:`~dcr_ray.codec.intdiff`    ADD values: integer differences, zigzagged
- :mod:`~dcr_ray.codec.planes`     byte planes for value compression
- :mod:`~dcr_ray.codec.estimate`   size estimates that pick each item's coding

The encode side (owners): :mod:`~dcr_ray.codec.scan` (where bits differ), :mod:`~dcr_ray.codec.diff`
(changed sets), :mod:`~dcr_ray.codec.packdiff` (changed sets of packs), :mod:`~dcr_ray.codec.encode`
(changed sets -> frames), :mod:`~dcr_ray.codec.baseline` (committed baselines with a pending set).

The decode side (engines): :mod:`~dcr_ray.codec.header` (prefix, digest, strict header parse),
:mod:`~dcr_ray.codec.decoded` (its data types), :mod:`~dcr_ray.codec.sections` and
:mod:`~dcr_ray.codec.packread` (each item's and pack's checked bytes), :mod:`~dcr_ray.codec.decode`
(the validating reader, no writes), :mod:`~dcr_ray.codec.classcounts` (the class counts of the bits a
receiver holds, kept between refits, checked on use), :mod:`~dcr_ray.codec.context` (class-mode
positions against the old bits), :mod:`~dcr_ray.codec.apply` (in-place writes), :mod:`~dcr_ray.codec.undo`
(in-place rollback).
"""

from typing import TYPE_CHECKING

from dcr_ray.lazy import exports

#: Public name -> the submodule that defines it, imported on first use: a process that needs the wire format
#: alone (a relay, the coordinator, ``dcr_ray.config``) imports neither torch nor the kernels.
_EXPORTS = {
    "apply_decoded": "apply", "apply_frame": "apply", "BaselineStore": "baseline", "bits_equal": "bits",
    "bits_view": "bits", "decode_frame": "decode", "read_frame": "decode", "DecodedFrame": "decoded",
    "DecodedItem": "decoded", "ChunkDelta": "diff", "TensorDelta": "diff", "diff_tensor": "diff", "full_delta": "diff",
    "FrameBuilder": "encode", "encode_frames": "encode", "BOOTSTRAP_BASE": "format", "DIGEST_SIZE": "format",
    "FORMAT_VERSION": "format", "Encoding": "format", "FrameMeta": "format", "LocationMode": "format",
    "PayloadKey": "format", "FrameHeader": "header", "open_frame": "header", "peek_meta": "header",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what static tools see
    from dcr_ray.codec.apply import apply_decoded, apply_frame
    from dcr_ray.codec.baseline import BaselineStore
    from dcr_ray.codec.bits import bits_equal, bits_view
    from dcr_ray.codec.decode import decode_frame, read_frame
    from dcr_ray.codec.decoded import DecodedFrame, DecodedItem
    from dcr_ray.codec.diff import ChunkDelta, TensorDelta, diff_tensor, full_delta
    from dcr_ray.codec.encode import FrameBuilder, encode_frames
    from dcr_ray.codec.format import (BOOTSTRAP_BASE, DIGEST_SIZE, FORMAT_VERSION, Encoding, FrameMeta,
                                      LocationMode, PayloadKey)
    from dcr_ray.codec.header import FrameHeader, open_frame, peek_meta
