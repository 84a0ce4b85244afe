"""Growing many sessions' token trees at once on a model draft: EAGLE-2's dynamic tree for the token
draft (or any causal LM with a ragged pass) as the feature draft grows it.

One ragged pass takes every session's pending committed tokens; the last row's logits are the root's.
Then each level feeds every session's frontier in one more pass, each node attending to its session's
committed rows and its own ancestors only (``draft_service.tree_draft.level_layout``), so a node's
logits are the draft's after the path from the root to it, the same numbers a chain along that path
gives (``tests/test_trees.py``). The nodes' rows follow no committed token: they are cropped once the
trees are grown, and the cache is again a prefix of the committed tokens.

A model whose family has no ragged pass, or whose layers attend through a sliding window (the level
masks have none), grows its trees along one path instead (``DraftEngine._grow_one``).
"""

from __future__ import annotations

import torch
from torch import nn

from draft_service.feature_draft import on_host
from draft_service.token_draft import TokenDraft
from draft_service.tree_draft import TreeGrower, TreeRows, grow_level, level_layout
from specdec.kvcache import SessionCache
from specdec.ragged import RaggedItem, RaggedLayout, layer_windows, ragged_forward, ragged_unsupported
from specdec.sampling import ranked_top


def grows_ragged_trees(model: nn.Module) -> bool:
    """Whether ``model`` (a token draft or a Hugging Face causal LM) can grow trees level by level."""
    config = model.config
    return ragged_unsupported(config) is None and not any(w is not None for w in layer_windows(config))


def level_logits(model: nn.Module, caches: list, fed: list[list[int]], layout: RaggedLayout) -> list[torch.Tensor]:
    """Logits ``[n_i, V]`` (float32) of every row each session feeds, in one ragged pass; the caches grow
    by the rows."""
    if isinstance(model, TokenDraft):
        ids = torch.tensor([t for rows in fed for t in rows], dtype=torch.long, device=model.device)  # [N]
        return list(torch.split(model.ragged_logits(ids, caches, layout).float(), [len(rows) for rows in fed]))
    items = [RaggedItem(kv, rows, len(rows)) for kv, rows in zip(caches, fed)]
    return ragged_forward(model, items, layout)[0]


def grow_rows(logits: torch.Tensor, growing: list[tuple[TreeGrower, int]]) -> None:
    """Adds children to each ``(grower, node)`` from the draft's logits ``[R, V]`` after it (row r: after
    that node), greedy trees' for all their rows at once."""

    def top(rows: list[int], width: int) -> tuple[list[list[int]], list[list[float]]]:
        scores = logits[rows].float()  # [G, V]
        best = ranked_top(scores, width)  # [G, width]: ties in index order, as the verifier's argmax
        return on_host(best).tolist(), on_host(torch.softmax(scores, dim=-1).gather(-1, best)).tolist()

    grow_level(growing, top, lambda rows: on_host(logits[rows]))


@torch.inference_mode()
def grow_model_trees(model: nn.Module, jobs: list[tuple[SessionCache, TreeGrower]]) -> list[tuple]:
    """Grows the tree of every ``(cache, grower)`` job: ``(tokens, q, looked_up, parents)`` each."""
    device = model.device
    caches = [cache for cache, _ in jobs]
    try:
        pending = [cache.pending() for cache in caches]
        layout = RaggedLayout.of([len(p) for p in pending], [c.kv.get_seq_length() for c in caches], device=device)
        roots = level_logits(model, [c.kv for c in caches], pending, layout)
        for cache, fed in zip(caches, pending):
            cache.kv_tokens.extend(fed)
        trees = [TreeRows(grower, cache.kv, len(cache.kv_tokens), len(cache.kv_tokens) - 1) for cache, grower in jobs]
        grow_rows(torch.stack([logits[-1] for logits in roots]), [(tree.grower, -1) for tree in trees])
        while (level := level_layout(trees, device)) is not None:
            layout, ordered = level
            sessions = list(dict.fromkeys(b for b, _ in ordered))
            fed = [[trees[b].grower.nodes[node].token for s, node in ordered if s == b] for b in sessions]
            rows = torch.cat(level_logits(model, [trees[b].cache for b in sessions], fed, layout))  # [R, V]
            grow_rows(rows, [(trees[b].grower, node) for b, node in ordered])
    finally:
        for cache in caches:
            cache.drop_unrecorded_kv()  # the nodes' rows (or a failed pass's) follow no committed token
    results = []
    for _, grower in jobs:
        tokens, parents, qs = grower.result()
        results.append((tokens, qs, False, parents))
    return results
