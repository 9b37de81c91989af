"""The attempt an engine is in: what its frames must name and be built on."""

from __future__ import annotations

from typing import NamedTuple

from dcr_ray.codec.format import BOOTSTRAP_BASE


class Attempt(NamedTuple):
    """The attempt an engine is in: frames of any other (transfer, attempt) are stale."""

    transfer: str
    attempt: int
    base: int
    target: int
    base_id: str | None = None  #: content identity the frames must be built on (None: not checked)

    @property
    def dense(self) -> bool:
        """A dense bootstrap (built on no version): it replaces whatever the engine holds."""
        return self.base == BOOTSTRAP_BASE
