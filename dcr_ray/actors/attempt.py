"""The attempt an engine is in: what its frames must name and be built on."""

from __future__ import annotations

from typing import NamedTuple


class Attempt(NamedTuple):
    """The attempt an engine is in: frames of any other (transfer, attempt) are stale."""

    transfer: str
    attempt: int
    base: int
    target: int
    base_id: str | None = None  #: content identity the frames must be built on (None: not checked)
