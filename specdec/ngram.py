"""Prompt-lookup drafting: propose what followed the latest earlier occurrence of the context's tail.

Needs no model, so both the draft service (before its model) and the coordinator (when the draft
service is not worth its cost) use it. Proposals are deterministic, so for sampled requests q is a
point mass on each proposed token, and speculative sampling stays exact (a token is then accepted
with probability p(x)).
"""

from __future__ import annotations

# Longest context suffix a lookup matches: longer suffixes rarely occur, and a 4-token match already
# predicts what follows well.
LOOKUP_MAX_N = 4


def propose_ngram(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier match of the last n tokens.

    Tries the longest suffix first (n from ``max_n`` down to ``min_n``); returns [] when no suffix
    occurs earlier.
    """
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        last = suffix[-1]
        # Scan right to left so the most recent occurrence wins; it best predicts what comes next.
        # Comparing the last token first skips the slice at nearly every start: the coordinator
        # scans a greedy session's whole context every round.
        for start in range(length - n - 1, -1, -1):
            if tokens[start + n - 1] == last and tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


def whole_continuation(tokens: list[int], k: int, *, min_n: int, max_n: int = LOOKUP_MAX_N) -> list[int] | None:
    """The k tokens that followed the most recent earlier match of the context's tail (a suffix of
    ``min_n`` to ``max_n`` tokens), or None when no match is followed by a whole k tokens.

    A feature draft proposes this before its model (``draft_service.engine.FeatureDrafter``), and the
    held-out evaluation of such a draft replays the same rule (``draft_service.distill.evaluate``).
    """
    found = propose_ngram(tokens, k, max_n, min_n) if min_n else []
    return found if found and len(found) == k else None
