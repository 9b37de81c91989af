"""Ownership coverage: every canonical element the engines hold has exactly one owner, same dtype and shape.

Owners declare, per canonical tensor, ``(wire dtype, shape)`` when they own all of it, or
``(wire dtype, shape, boxes)`` when they own parts (training shards, see :mod:`dcr_ray.sharding`);
several owners may share a tensor as long as their boxes tile it exactly
(:func:`~dcr_ray.sharding.coverage.check_tiling`).
"""

from __future__ import annotations

from dcr_ray.errors import ConfigError
from dcr_ray.sharding.coverage import check_tiling


def check_coverage(owner_specs: dict[str, dict], engine_specs: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Raise :class:`ConfigError` naming the gap, overlap or mismatch between owners and engines.

    ``owner_specs``: owner id -> {name: (wire dtype, shape[, boxes])} as each owner's ``dcr_attach`` returned.
    """
    union: dict[str, tuple] = {}
    boxes: dict[str, list] = {}
    for o, specs in owner_specs.items():
        for n, s in specs.items():
            meta = (s[0], tuple(s[1]))
            if n in union and union[n] != meta:
                raise ConfigError(f"tensor {n!r}: owners disagree on its dtype/shape ({union[n]} vs {o}: {meta})")
            union[n] = meta
            parts = s[2] if len(s) > 2 and s[2] is not None else [((0,) * len(meta[1]), meta[1])]
            boxes.setdefault(n, []).extend((o, tuple(a), tuple(b)) for a, b in parts)
    for n, bs in boxes.items():
        if len(bs) > 1 or any(bs[0][1]) or tuple(bs[0][2]) != union[n][1]:
            check_tiling(n, union[n][1], bs)
    missing = sorted(set(engine_specs) - set(union))
    extra = sorted(set(union) - set(engine_specs))
    bad = sorted(n for n in set(engine_specs) & set(union) if engine_specs[n] != union[n])
    if missing or extra or bad:
        raise ConfigError(
            "owners and engines disagree on the canonical tensors: "
            f"no owner for {missing[:5]}{'...' if len(missing) > 5 else ''}; "
            f"unknown to engines {extra[:5]}; dtype/shape differ for "
            f"{[(n, union[n], engine_specs[n]) for n in bad[:3]]}"
        )
