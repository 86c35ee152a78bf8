"""Finding markers in text that arrives in pieces: how much of the end of a piece might still become one."""

from __future__ import annotations


def partial_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (text that may yet become it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def is_proper_prefix(text: str, *markers: str) -> bool:
    """Whether `text` is the start of one of `markers`, but not all of it."""
    return any(len(text) < len(m) and m.startswith(text) for m in markers)
