"""Verifying a token tree (``specdec.trees``) in one target pass, exactly.

The target scores every node in one pass: each node attends to the committed context and to its own
ancestors only (``tree_mask``), at the position its depth gives, so row i's logits are the target's
distribution after the path root -> i. The *accepted path* is then walked from the root:

- **Greedy**: the child whose token equals the target's argmax, while one does; then the argmax.
- **Coupled** (seeded sampling, ``specdec.sampling``): the same walk with the target's Gumbel-max
  draw at each position in place of the argmax. Neither depends on the tree: both are exact for any
  tree, however it was chosen.
- **Sampled**: recursive rejection sampling over the siblings (SpecInfer's multi-step speculative
  sampling, Miao et al., arXiv 2305.09781; without replacement as in Jeon et al.'s recursive
  speculative decoding, arXiv 2402.14160). At a reached node with target distribution p, its
  children are tried in rank order; child c, drawn by the draft from q_c, is accepted with
  probability min(1, p(x_c) / q_c(x_c)); on rejection p becomes normalize(max(p - q_c, 0)) and the
  next child is tried. When every child is rejected (or there is none), the committed token is drawn
  from the p left. Each step is the classic speculative-sampling step for target p and proposal q_c,
  whose output is distributed as p whether the step accepts or passes its residual on, so the token
  committed at each reached node follows the target exactly. This needs q_c to be exactly what x_c
  was drawn from given the siblings before it: with siblings drawn without replacement from q, q_c
  is q with the earlier siblings' mass removed and renormalized (``without_replacement``), which the
  draft sends per node. The tree's shape must not depend on the draws themselves (a sampled tree's
  shape is fixed before drawing; see ``draft_service.tree_draft``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.sampling import coupled_token, draw
from specdec.trees import children


def tree_mask(parents: Sequence[int], lead: int = 1) -> torch.Tensor:
    """``[lead + n, lead + n]`` bool mask over a block of ``lead`` chain rows (the pending committed
    tokens, the last of them the root) followed by the ``n`` tree nodes: every row sees the chain rows
    up to itself, and a node sees every chain row, its ancestors and itself."""
    n = len(parents)
    size = lead + n
    mask = torch.zeros(size, size, dtype=torch.bool)
    mask[:lead, :lead] = torch.ones(lead, lead, dtype=torch.bool).tril()
    mask[lead:, :lead] = True
    for i, parent in enumerate(parents):
        row = lead + i
        if parent >= 0:
            mask[row, lead:] = mask[lead + parent, lead:]
        mask[row, row] = True
    return mask


@dataclass(frozen=True)
class TreeVerdict:
    """A verified tree: the accepted nodes (root to leaf) and the tokens committed (theirs, then one
    of the target's own)."""

    path: list[int]
    tokens: list[int]

    @property
    def accepted(self) -> int:
        """Draft tokens accepted."""
        return len(self.path)


def _walk(tokens: Sequence[int], parents: Sequence[int], pick) -> TreeVerdict:
    """Walks from the root while a child's token equals ``pick(row, depth)``, the target's own token
    after node ``row - 1`` (row 0: after the root) at depth ``depth``."""
    kids = children(parents)
    node, depth, path = -1, 0, []
    while True:
        token = pick(node + 1, depth)
        match = next((c for c in kids.get(node, ()) if tokens[c] == token), None)
        if match is None:
            return TreeVerdict(path, [tokens[i] for i in path] + [token])
        node, depth = match, depth + 1
        path.append(node)


def verify_tree_greedy(logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int]) -> TreeVerdict:
    """Greedy acceptance over a tree. ``logits [n + 1, V]``: row 0 scores the root's next token, row
    i + 1 the token after node i."""
    argmax = logits.argmax(dim=-1).tolist()  # [n + 1]
    return _walk(tokens, parents, lambda row, _depth: argmax[row])


def verify_tree_coupled(
    p: torch.Tensor, tokens: Sequence[int], parents: Sequence[int], seed: int, position: int
) -> TreeVerdict:
    """Coupled acceptance over a tree: the target's draw at depth d uses the noise of sequence position
    ``position + d`` (``position``: that of the root's children). ``p [n + 1, V]`` after warping."""
    return _walk(tokens, parents, lambda row, depth: coupled_token(p[row], seed, position + depth))


def verify_tree_sampled(
    p: torch.Tensor,
    q: torch.Tensor,
    tokens: Sequence[int],
    parents: Sequence[int],
    generator: torch.Generator,
) -> TreeVerdict:
    """Recursive rejection sampling over a tree (see the module docstring).

    ``p [n + 1, V]``: the target's warped distributions after the root (row 0) and after each node;
    ``q [n, V]``: the distribution node i's token was drawn from, given its earlier siblings.
    """
    kids = children(parents)
    node, path = -1, []
    while True:
        residual = p[node + 1]  # [V]
        moved = False
        for child in kids.get(node, ()):
            x = tokens[child]
            p_x, q_x = float(residual[x]), float(q[child, x])
            u = float(torch.rand(1, generator=generator, dtype=torch.float64))
            if q_x > 0 and u * q_x <= p_x:
                node, moved = child, True
                path.append(child)
                break
            left = torch.clamp(residual - q[child], min=0.0)  # [V]
            # p <= q everywhere means p == q, where a rejection has probability zero: p stays.
            if float(left.sum()) > 0.0:
                residual = left / left.sum()
        if not moved:
            token = draw(residual, generator)
            return TreeVerdict(path, [tokens[i] for i in path] + [token])


def without_replacement(q: torch.Tensor, taken: Sequence[int]) -> torch.Tensor:
    """``q [V]`` with the ``taken`` tokens' mass removed, renormalized: what the next sibling drawn
    without replacement is drawn from."""
    if not taken:
        return q
    out = q.clone()
    out[list(taken)] = 0.0
    total = out.sum()
    return out / total if float(total) > 0 else out
