"""Per-element ownership: the boxes owners declare must tile every canonical tensor exactly once.

A set of boxes tiles a tensor exactly when no two boxes intersect and their volumes add up to the
tensor's size; both are checked without enumerating elements (pairwise interval tests, vectorized).
Errors name the tensor and the overlapping owners, or the first uncovered element.
"""

from __future__ import annotations

import math

import numpy as np

from dcr_ray.errors import ConfigError

#: Tensors up to this many elements get an exact "first uncovered element" in gap errors.
GAP_SEARCH_MAX_ELEMS = 1 << 24


def check_tiling(name: str, shape: tuple[int, ...], boxes: list[tuple[str, tuple, tuple]]) -> None:
    """Raise :class:`ConfigError` unless ``boxes`` (owner, start, stop) tile ``name`` of ``shape`` exactly."""
    numel = math.prod(shape)
    if not boxes:
        raise ConfigError(f"tensor {name!r} has no owner")
    lo = np.array([b[1] for b in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
    hi = np.array([b[2] for b in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
    if (lo < 0).any() or (hi > np.array(shape, dtype=np.int64)).any() or (hi <= lo).any():
        i = int(np.flatnonzero((lo < 0).any(1) | (hi > np.array(shape)).any(1) | (hi <= lo).any(1))[0])
        raise ConfigError(f"owner {boxes[i][0]} declares box {boxes[i][1]}..{boxes[i][2]} of tensor {name!r}, "
                          f"outside its shape {shape}")
    if len(boxes) > 1:
        inter = ((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :])).all(-1)
        np.fill_diagonal(inter, False)
        if inter.any():
            i, j = (int(x) for x in np.argwhere(inter)[0])
            raise ConfigError(f"tensor {name!r}: owners {boxes[i][0]} and {boxes[j][0]} both own elements of "
                              f"{tuple(np.maximum(lo[i], lo[j]).tolist())}.."
                              f"{tuple(np.minimum(hi[i], hi[j]).tolist())}: each "
                              f"canonical element needs exactly one owner (replicas split replicated tensors)")
    covered = int(np.prod(hi - lo, axis=1).sum())
    if covered != numel:
        where = ""
        if numel <= GAP_SEARCH_MAX_ELEMS:
            mask = np.zeros(shape, dtype=bool)
            for a, b in zip(lo, hi):
                mask[tuple(slice(x, y) for x, y in zip(a, b))] = True
            where = f"; first uncovered element {tuple(int(x) for x in np.argwhere(~mask)[0])}"
        raise ConfigError(f"tensor {name!r}: owners cover {covered} of its {numel} elements{where}")


__all__ = ["GAP_SEARCH_MAX_ELEMS", "check_tiling"]
