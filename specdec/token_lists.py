"""Helpers over token-id lists that the coordinator shares with the model services (no torch)."""

from __future__ import annotations

# Tokens compared a slice at a time before the first differing slice is searched token by token: a
# slice compares in C, so a 2,000-token context costs tens of Python steps rather than 2,000.
_CHUNK = 64


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo = 0
    while a[lo : lo + _CHUNK] == b[lo : lo + _CHUNK]:  # stops at the slice holding the first difference
        lo += _CHUNK
    while a[lo] == b[lo]:
        lo += 1
    return lo
