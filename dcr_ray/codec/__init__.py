"""dcr_ray.codec: bits in, bytes out.

- :mod:`~dcr_ray.codec.bits`      dtypes on the wire and integer views
- :mod:`~dcr_ray.codec.diff`      chunked change detection -> changed sets
- :mod:`~dcr_ray.codec.locations` position coding (gaps / runs, narrow widths with escapes)
- :mod:`~dcr_ray.codec.context`   positions in the class order of the old values (exponents)
- :mod:`~dcr_ray.codec.intdiff`   ADD values: integer differences, zigzagged
- :mod:`~dcr_ray.codec.estimate`  size estimates that pick each item's coding
- :mod:`~dcr_ray.codec.planes`    byte planes for value compression
- :mod:`~dcr_ray.codec.format`    the signed wire frame: layout, names, limits, digest, identity
- :mod:`~dcr_ray.codec.encode`    changed sets -> frames (builder, section compression)
- :mod:`~dcr_ray.codec.header`    opening a frame: prefix, digest, then the strict header parse
- :mod:`~dcr_ray.codec.decode`    the validating reader: an opened frame -> a decoded frame, no writes
- :mod:`~dcr_ray.codec.apply`     writing a decoded frame into tensors in place
- :mod:`~dcr_ray.codec.baseline`  committed baselines with a pending set
- :mod:`~dcr_ray.codec.threads`   the codec's worker threads; :mod:`~dcr_ray.codec.kernels` compiled loops
"""

from dcr_ray.codec.apply import apply_decoded, apply_frame
from dcr_ray.codec.baseline import BaselineStore
from dcr_ray.codec.bits import bits_equal, bits_view
from dcr_ray.codec.decode import DecodedFrame, DecodedItem, decode_frame, read_frame
from dcr_ray.codec.diff import ChunkDelta, TensorDelta, diff_tensor, full_delta
from dcr_ray.codec.encode import FrameBuilder, encode_frames
from dcr_ray.codec.format import BOOTSTRAP_BASE, DIGEST_SIZE, FORMAT_VERSION, Encoding, FrameMeta, LocationMode, PayloadKey
from dcr_ray.codec.header import FrameHeader, open_frame, peek_meta

__all__ = [
    "BOOTSTRAP_BASE", "BaselineStore", "ChunkDelta", "DIGEST_SIZE", "DecodedFrame", "DecodedItem", "Encoding", "FORMAT_VERSION",
    "FrameBuilder", "FrameHeader", "FrameMeta", "LocationMode", "PayloadKey", "TensorDelta", "apply_decoded",
    "apply_frame", "bits_equal", "bits_view", "decode_frame", "diff_tensor", "encode_frames", "full_delta",
    "open_frame", "peek_meta", "read_frame",
]
