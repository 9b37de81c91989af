"""dcr_ray.codec: bits in, bytes out.

- :mod:`~dcr_ray.codec.bits`      dtypes on the wire and integer views
- :mod:`~dcr_ray.codec.diff`      chunked change detection -> changed sets
- :mod:`~dcr_ray.codec.locations` position coding (gaps / runs, narrow widths with escapes)
- :mod:`~dcr_ray.codec.planes`    byte planes for value compression
- :mod:`~dcr_ray.codec.frame`     the signed wire frame, its builder and validating reader
- :mod:`~dcr_ray.codec.baseline`  committed baselines with a pending set
"""

from dcr_ray.codec.baseline import BaselineStore
from dcr_ray.codec.bits import bits_equal, bits_view
from dcr_ray.codec.diff import ChunkDelta, TensorDelta, diff_tensor, full_delta
from dcr_ray.codec.frame import (
    DIGEST_SIZE,
    FORMAT_VERSION,
    DecodedFrame,
    DecodedItem,
    FrameBuilder,
    FrameMeta,
    apply_decoded,
    apply_frame,
    encode_frames,
    peek_meta,
    read_frame,
)

__all__ = [
    "BaselineStore", "ChunkDelta", "DIGEST_SIZE", "DecodedFrame", "DecodedItem", "FORMAT_VERSION", "FrameBuilder", "FrameMeta",
    "TensorDelta", "apply_decoded", "apply_frame", "bits_equal", "bits_view", "diff_tensor",
    "encode_frames", "full_delta", "peek_meta", "read_frame",
]
