"""Ownership coverage: every canonical tensor the engines hold has exactly one owner, same dtype and shape."""

from __future__ import annotations

from dcr_ray.errors import ConfigError


def check_coverage(owner_specs: dict[str, dict], engine_specs: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Raise :class:`ConfigError` naming the gap, overlap or mismatch between owners and engines.

    ``owner_specs``: owner id -> {name: (wire dtype, shape)} as each owner's ``dcr_attach`` returned.
    """
    union: dict[str, tuple] = {}
    first: dict[str, str] = {}
    for o, specs in owner_specs.items():
        for n, s in specs.items():
            if n in union:
                raise ConfigError(f"tensor {n!r} has two owners ({first[n]} and {o}): each canonical "
                                  f"element needs exactly one owner (see dcr_ray.owned_names)")
            union[n] = (s[0], tuple(s[1]))
            first[n] = o
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
