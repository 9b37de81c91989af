"""Giving the C heap's free pages back to the OS once a refit's work in a process is done.

A refit's temporaries are large and short-lived: payloads a relay reads before it re-puts them, frames and
decoded items in an engine, diff chunks and encoded frames in an owner. glibc keeps the pages of freed blocks
below its mmap threshold (which it raises, after the first large free, up to 32 MiB) in its arenas, one per
thread that allocated, so an actor that handled a refit would hold them until the next one.
:func:`return_free_heap` (glibc's ``malloc_trim(0)``) hands them back at the end of each transfer; where
there is no glibc it does nothing.
"""

from __future__ import annotations

_TRIM = None


def return_free_heap() -> None:
    """Return the heap's free pages to the OS (a few milliseconds; nothing where glibc is absent)."""
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)
