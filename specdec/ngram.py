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
    top, shortest = min(max_n, length - 1), max(min_n, 1)  # a suffix is at least one token
    if top < shortest:
        return []
    # One pass over the earlier occurrences of the last token, most recent first (the most recent
    # occurrence best predicts what comes next), measuring how much of the context's tail each one
    # ends: the first to end the longest tail is the match the longest-suffix-first rule picks.
    # ``list.index`` hops between occurrences in C, where a loop over every position took ~0.3 ms
    # a call at 2,000 tokens, and both the draft and the coordinator look up every round.
    backwards = tokens[::-1]  # backwards[j] = tokens[length - 1 - j]
    last, best, end, j = tokens[-1], 0, -1, 0
    while best < top:
        try:
            j = backwards.index(last, j + 1)
        except ValueError:
            break
        at = length - 1 - j  # the occurrence's position; tokens after it exist since j >= 1
        matched = 1
        while matched < top and matched <= at and backwards[j + matched] == backwards[matched]:
            matched += 1
        if matched > best:
            best, end = matched, at
    return tokens[end + 1 : end + 1 + k] if best >= shortest else []


def whole_continuation(tokens: list[int], k: int, *, min_n: int, max_n: int = LOOKUP_MAX_N) -> list[int] | None:
    """The k tokens that followed the most recent earlier match of the context's tail (a suffix of
    ``min_n`` to ``max_n`` tokens), or None when no match is followed by a whole k tokens.

    A feature draft proposes this before its model (``draft_service.engine.FeatureDrafter``), and the
    held-out evaluation of such a draft replays the same rule (``draft_service.distill.evaluate``).
    """
    found = propose_ngram(tokens, k, max_n, min_n) if min_n else []
    return found if found and len(found) == k else None


def lookup_tree(
    tokens: list[int], nodes: int, depth: int, width: int, max_n: int, min_n: int
) -> tuple[list[int], tuple[int, ...]]:
    """A token tree of what followed earlier matches of the context's tail, every continuation a branch.

    The longest suffix (``max_n`` down to ``min_n``) that occurs earlier is matched; each occurrence,
    most recent first, adds the ``depth`` tokens after it to a trie. Siblings are ranked by how many
    occurrences share them (the most recent breaking ties), at most ``width`` per node and ``nodes``
    in all. Returns tokens and parents, parents first (``specdec.trees``); empty when nothing matches.
    """
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        follows = [
            tokens[start + n : start + n + depth]
            for start in range(length - n - 1, -1, -1)
            if tokens[start + n - 1] == suffix[-1] and tokens[start : start + n] == suffix
        ]
        follows = [f for f in follows if f]
        if follows:
            return _trie(follows, nodes, width)
    return [], ()


def _trie(paths: list[list[int]], nodes: int, width: int) -> tuple[list[int], tuple[int, ...]]:
    """The trie of ``paths`` (most important first), breadth first, within ``nodes`` and ``width``."""
    out_tokens: list[int] = []
    out_parents: list[int] = []
    level = [(-1, paths)]  # (parent node, the paths through it)
    while level and len(out_tokens) < nodes:
        following = []
        for parent, through in level:
            groups: dict[int, list[list[int]]] = {}
            for path in through:
                if path:
                    groups.setdefault(path[0], []).append(path[1:])
            # dicts keep insertion order: among equal counts the most recent occurrence comes first
            ranked = sorted(groups.items(), key=lambda item: -len(item[1]))[:width]
            for token, rest in ranked:
                if len(out_tokens) >= nodes:
                    break
                out_tokens.append(token)
                out_parents.append(parent)
                following.append((len(out_tokens) - 1, rest))
        level = following
    return out_tokens, tuple(out_parents)
