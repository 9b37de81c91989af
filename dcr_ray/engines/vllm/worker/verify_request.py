"""A digest check's request, checked before anything is digested.

``MirrorReceiver.verify`` answers "does this worker serve committed version v?" from boxes of digests
(:func:`dcr_ray.sharding.digest.box_digests` of the committed version). The request is refused before
any digest is computed when a box is malformed or outside its tensor (:class:`ConfigError`), or when the
boxes leave a checkpoint tensor, or an element of one, uncovered (:class:`EngineStateError`): a check
that skips elements could not show the worker holds the version. Boxes may overlap.
"""

from __future__ import annotations

import torch

from dcr_ray.errors import ConfigError, EngineStateError

#: One box of a request: (start, stop, digest).
Box = tuple[tuple[int, ...], tuple[int, ...], str]


def checked_boxes(boxes, specs: dict[str, tuple]) -> dict[str, list[Box]]:
    """``boxes`` (``[[name, start, stop, digest], ...]``) grouped by tensor name, once each box lies in a
    tensor of ``specs`` (name -> (dtype, shape)) and together they cover every element of every tensor."""
    by_name: dict[str, list[Box]] = {}
    for b in boxes if isinstance(boxes, (list, tuple)) else [None]:
        try:
            name, start, stop, digest = b
            start, stop = tuple(int(x) for x in start), tuple(int(x) for x in stop)
            shape = specs[name][1]
            ok = (isinstance(digest, str) and len(start) == len(stop) == len(shape)
                  and all(0 <= a <= e <= n for a, e, n in zip(start, stop, shape)))
        except (TypeError, ValueError, KeyError):
            ok = False
        if not ok:
            raise ConfigError(f"verify: each box is [checkpoint tensor name, start, stop, digest] within "
                              f"the tensor's shape; got {str(b)[:200]}")
        by_name.setdefault(name, []).append((start, stop, digest))
    missing = [n for n in specs if n not in by_name]
    if missing:
        raise EngineStateError(f"verify: the digests cover {len(specs) - len(missing)} of "
                               f"{len(specs)} tensors (e.g. none for {missing[:3]}): cannot show this "
                               f"worker holds the version")
    for name, bs in by_name.items():
        covered = torch.zeros(specs[name][1], dtype=torch.bool)
        for start, stop, _ in bs:
            covered[tuple(slice(a, e) for a, e in zip(start, stop))] = True
        if not bool(covered.all()):
            raise EngineStateError(f"verify: the boxes of {name} do not cover all its elements")
    return by_name


__all__ = ["Box", "checked_boxes"]
