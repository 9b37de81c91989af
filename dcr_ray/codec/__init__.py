"""dcr_ray.codec: bits in, bytes out. A one-way stack: each layer imports only the layers below it, and
the two sides on top never import each other (``tests/test_import_rules.py`` checks it).

The format, at the bottom, in this package:

- :mod:`~dcr_ray.codec.format`    the signed wire frame: layout, names, limits, digest, identity
- :mod:`~dcr_ray.codec.bits`      dtypes on the wire and integer views
- :mod:`~dcr_ray.codec.packed`    the pack layout: many small tensors end to end in one pack space
- :mod:`~dcr_ray.codec.arena`     stable small slices carved out of a few large blocks

:mod:`~dcr_ray.codec.compiled`: the compiled kernels and what runs them: whether they are used and loading
them once (``jit``), the codec's worker threads (``threads``), one tensor's flat bits (``kernels``) and many
tensors by data pointer (``ptrkernels``), their numba definitions in ``kernels_numba`` / ``ptrkernels_numba``.

:mod:`~dcr_ray.codec.primitives`: the coding primitives, each both ways on plain arrays: positions
(``locations``), positions in the class order of the old values (``classorder``), ADD values (``intdiff``),
byte planes (``planes``), and the size estimates that pick each item's coding (``estimate``).

:mod:`~dcr_ray.codec.encoding`, the owners' side: where bits differ (``scan``), changed sets (``diff``,
``packdiff`` for packs), changed sets -> frames (``encode``), committed baselines with a pending set
(``baseline``).

:mod:`~dcr_ray.codec.decoding`, the engines' side: prefix, digest and strict header parse (``header``), its
data types (``decoded``), each item's and pack's checked bytes (``sections``, ``packread``), the validating
reader, no writes (``decode``), the class counts of the bits a receiver holds (``classcounts``), class-mode
positions against the old bits (``context``), in-place writes (``apply``) and in-place rollback (``undo``).
"""

from typing import TYPE_CHECKING

from dcr_ray.lazy import exports

#: Public name -> the submodule that defines it, imported on first use: a process that needs the wire format
#: alone (a relay, the coordinator, ``dcr_ray.config``) imports neither torch nor the kernels.
_EXPORTS = {
    "apply_decoded": "decoding.apply", "apply_frame": "decoding.apply", "decode_frame": "decoding.decode",
    "read_frame": "decoding.decode", "DecodedFrame": "decoding.decoded", "DecodedItem": "decoding.decoded",
    "FrameHeader": "decoding.header", "open_frame": "decoding.header", "peek_meta": "decoding.header",
    "BaselineStore": "encoding.baseline", "ChunkDelta": "encoding.diff", "TensorDelta": "encoding.diff",
    "diff_tensor": "encoding.diff", "full_delta": "encoding.diff", "FrameBuilder": "encoding.encode",
    "encode_frames": "encoding.encode", "bits_equal": "bits", "bits_view": "bits", "BOOTSTRAP_BASE": "format",
    "DIGEST_SIZE": "format", "FORMAT_VERSION": "format", "Encoding": "format", "FrameMeta": "format",
    "LocationMode": "format", "PayloadKey": "format",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # what static tools see
    from dcr_ray.codec.decoding.apply import apply_decoded, apply_frame
    from dcr_ray.codec.encoding.baseline import BaselineStore
    from dcr_ray.codec.bits import bits_equal, bits_view
    from dcr_ray.codec.decoding.decode import decode_frame, read_frame
    from dcr_ray.codec.decoding.decoded import DecodedFrame, DecodedItem
    from dcr_ray.codec.encoding.diff import ChunkDelta, TensorDelta, diff_tensor, full_delta
    from dcr_ray.codec.encoding.encode import FrameBuilder, encode_frames
    from dcr_ray.codec.format import (BOOTSTRAP_BASE, DIGEST_SIZE, FORMAT_VERSION, Encoding, FrameMeta,
                                      LocationMode, PayloadKey)
    from dcr_ray.codec.decoding.header import FrameHeader, open_frame, peek_meta
