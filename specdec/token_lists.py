"""Helpers over token-id lists that the coordinator shares with the model services (no torch)."""

from __future__ import annotations


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
