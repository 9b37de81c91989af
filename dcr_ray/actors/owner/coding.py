"""Which coding an owner's stream uses (:func:`stream_coding`): the one the coordinator chose for the refit
(:mod:`dcr_ray.actors.coordinator.coding` decides ``CodecConfig.coding="auto"``), else the configured one."""

from __future__ import annotations

from dcr_ray.errors import ConfigError

#: Codings a refit can use (``"auto"`` picks one of them).
CODINGS = ("plain", "context")


def stream_coding(configured: str, coding: str | None, owner_id: str = "") -> str:
    """The coding an owner's stream uses: the coordinator's choice ``coding`` (checked), else the
    ``configured`` ``CodecConfig.coding``, where ``"auto"`` is plain for an owner streaming on its own
    (no coordinator measured its links)."""
    if coding is None:
        return "plain" if configured == "auto" else configured
    if coding not in CODINGS:
        raise ConfigError(f"owner {owner_id}: coding must be one of {CODINGS} (the coordinator decides 'auto' "
                          f"before it streams), got {coding!r}")
    return coding
