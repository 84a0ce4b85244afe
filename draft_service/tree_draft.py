"""Growing a draft token tree, level by level, from the draft's own distributions (EAGLE-2's dynamic tree).

Each level, the draft scores the nodes chosen for expansion (its *frontier*) and gives each its top
``width`` children; the frontier of the next level is the ``beam`` new nodes of highest path
probability (the product of the draft's probabilities along the path, which on the default feature
draft tracks the chance the path is accepted). After ``depth`` levels the tree keeps its ``nodes``
nodes of highest path probability. A child's path probability never exceeds its parent's, so the
kept nodes always include their ancestors. Greedy and coupled trees may be shaped this way by any
rule: their acceptance does not depend on the tree (``specdec.trees``).

A sampled tree's shape must not depend on its draws (``specdec.trees``): each level draws ``width``
children without replacement from the draft's q and only the first drawn expands, so every level
holds ``width`` nodes whatever was drawn, and each node carries the q it was drawn from given the
siblings before it.

A drafter whose model runs ragged grows every session's tree in one pass per level
(``level_layout``): each frontier node is a row that attends to its session's true rows and its own
ancestors' rows. With ``beam`` 1 only one node per level is fed, along one path, so a drafter whose
model has no ragged pass grows trees with no tree mask and no extra draft passes: the siblings come
from distributions it computes anyway.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from draft_service.picking import DRAFT_STREAM
from specdec.constrain import mask_logits
from specdec.grammar import GrammarMatcher
from specdec.ragged import RaggedLayout
from specdec.sampling import (
    Sampling,
    dense_to_sparse,
    draw,
    penalize_logits,
    position_generator,
    ranked_top,
    round_generator,
    warp_probs,
)
from specdec.tree_verify import without_replacement
from specdec.trees import TreeShape

# EAGLE-2 expands the best few nodes of each level; each is one more row in a level's pass.
TREE_BEAM = 4


@dataclass
class _Node:
    token: int
    parent: int  # index of the parent node, -1: the root
    depth: int
    logp: float  # the draft's log probability of the path root -> this node
    q: tuple[list[int], list[float]] | None


@dataclass
class TreeGrower:
    """One session's draft tree as it grows; the drafter feeds its frontier and hands back logits."""

    shape: TreeShape
    sampling: Sampling
    round_index: int
    position: int
    """Sequence position of the root's children (coupled noise is keyed by position)."""
    beam: int = 1
    sample_top_k: int = 0
    nodes: list[_Node] = field(default_factory=list)
    committed: Sequence[int] = ()
    """The session's committed tokens, which a penalised request's penalties count."""
    grammar: GrammarMatcher | None = None
    """A constrained request's grammar state after the committed tokens (the root); each node's state
    is a fork of its parent's, advanced by the node's token."""
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)
    _states: dict[int, GrammarMatcher | None] = field(default_factory=dict, init=False, repr=False)

    @property
    def ranks_on_head(self) -> bool:
        """Whether a greedy level may take its children from the draft's likeliest tokens found by the
        caller (``grow_top``): not when penalties reorder them or a grammar masks them, which only
        ``grow`` applies."""
        return self.sampling.greedy and not self.sampling.penalized and self.grammar is None

    def grammar_after(self, node: int) -> GrammarMatcher | None:
        """The grammar state after the path to ``node`` (-1: the root); None where the grammar refuses a
        token on the path (no child of it can be accepted) or the request has no grammar."""
        if node < 0 or self.grammar is None:
            return self.grammar
        if node not in self._states:
            parent = self.grammar_after(self.nodes[node].parent)
            state = None
            if parent is not None and (parent.ended or parent.is_allowed(self.nodes[node].token)):
                state = parent.fork()
                if not parent.ended:
                    state.advance(self.nodes[node].token)
            self._states[node] = state
        return self._states[node]

    def path_tokens(self, node: int) -> list[int]:
        """The tokens from the root's child down to ``node`` (none for the root, -1)."""
        tokens: list[int] = []
        while node >= 0:
            tokens.append(self.nodes[node].token)
            node = self.nodes[node].parent
        return tokens[::-1]

    def grow(self, parent: int, logits: torch.Tensor) -> None:
        """Adds the children of ``parent`` (-1: the root) from the draft's logits ``[V]`` after it,
        penalised (for a penalised request) by the committed tokens and the path to ``parent``, as the
        target penalises that node's row."""
        depth = 1 if parent < 0 else self.nodes[parent].depth + 1
        base = 0.0 if parent < 0 else self.nodes[parent].logp
        width = self.shape.width
        if self.sampling.penalized:
            logits = penalize_logits(logits[None], self.sampling, self.committed, [self.path_tokens(parent)])[0]
        state = self.grammar_after(parent)
        if state is not None:
            logits = mask_logits(logits[None], state.allowed()[None])[0]  # as the target masks that node's row
        if self.sampling.greedy:
            probs = torch.softmax(logits.float(), -1)  # [V]
            # Ranked on the logits, as the verifier's argmax is: a softmax can round two of them to one.
            picked = ranked_top(logits.float(), min(width, int((probs > 0).sum()))).tolist()
            qs: list = [None] * len(picked)
        else:
            probs = warp_probs(logits[None], self.sampling, extra_top_k=self.sample_top_k)[0]  # [V]
            picked, qs = self._draw(probs, depth, width)
        self._add(parent, depth, base, picked, [float(probs[t]) for t in picked], qs)

    def grow_top(self, parent: int, tokens: list[int], probs: list[float]) -> None:
        """``grow`` for a greedy tree from the draft's ``width`` likeliest tokens after ``parent`` and
        their probabilities, found by the caller (for many nodes at once, on the draft's own head)."""
        depth = 1 if parent < 0 else self.nodes[parent].depth + 1
        base = 0.0 if parent < 0 else self.nodes[parent].logp
        self._add(parent, depth, base, tokens, probs, [None] * len(tokens))

    def _add(self, parent: int, depth: int, base: float, tokens: list[int], probs: list[float], qs: list) -> None:
        for token, mass, q in zip(tokens, probs, qs):
            logp = base + (math.log(mass) if mass > 0 else -math.inf)
            self.nodes.append(_Node(int(token), parent, depth, logp, q))

    def _draw(self, probs: torch.Tensor, depth: int, width: int) -> tuple[list[int], list]:
        """``width`` children drawn without replacement: coupled, by the position's noise (the first is
        the coupled draw itself); sampled, one after another from the round's draft stream."""
        support = int((probs > 0).sum())
        width = min(width, support)
        if self.sampling.coupled:
            noise = torch.rand(
                probs.shape[-1],
                generator=position_generator(self.sampling.seed, self.position + depth - 1),
                dtype=torch.float64,
            )
            keys = probs.double() / -torch.log1p(-noise)  # [V]; the argmax is ``coupled_token``'s draw
            order = torch.topk(keys, width).indices.tolist()
            q = dense_to_sparse(probs)
            return order, [q] * len(order)
        if self._generator is None:
            self._generator = round_generator(self.sampling.seed, self.round_index, DRAFT_STREAM)
        taken: list[int] = []
        qs = []
        for _ in range(width):
            q = without_replacement(probs, taken)
            taken.append(draw(q, self._generator))
            qs.append(dense_to_sparse(q))
        return taken, qs

    def frontier(self) -> list[int]:
        """The nodes to feed next (whose children the next level adds), or [] when the tree is grown.

        Sampled trees expand the first child drawn at the newest level: a shape fixed before drawing.
        """
        if not self.nodes:
            return []
        depth = self.nodes[-1].depth
        if depth >= self.shape.depth:
            return []
        newest = [i for i, n in enumerate(self.nodes) if n.depth == depth]
        if not self.sampling.greedy and not self.sampling.coupled:
            return newest[:1]
        newest.sort(key=lambda i: -self.nodes[i].logp)
        return [i for i in newest[: self.beam] if self.nodes[i].logp > -math.inf]

    def result(self) -> tuple[list[int], tuple[int, ...], list]:
        """The tree proposed: tokens, parents and (sampled) per-node q, parents listed first.

        A greedy or coupled tree keeps its ``nodes`` best nodes by path probability; a sampled one keeps
        its first ``nodes`` in drawing order, an order no draw changes."""
        order = list(range(len(self.nodes)))
        if self.sampling.greedy or self.sampling.coupled:
            order.sort(key=lambda i: (-self.nodes[i].logp, i))
        kept = sorted(order[: self.shape.nodes])
        index = {old: new for new, old in enumerate(kept)}
        tokens = [self.nodes[i].token for i in kept]
        parents = tuple(-1 if self.nodes[i].parent < 0 else index[self.nodes[i].parent] for i in kept)
        qs = [] if self.sampling.greedy else [self.nodes[i].q for i in kept]
        return tokens, parents, qs


@dataclass
class TreeRows:
    """One session's tree while it grows level by level over its draft's KV cache."""

    grower: TreeGrower
    cache: object
    """The session's draft KV cache (a transformers ``Cache``)."""
    base: int
    """Cached rows every node attends to: the session's true (committed) rows."""
    root_position: int
    """Sequence position of the root, the last true row; a node at depth d sits d after it."""
    rows: dict[int, int] = field(default_factory=dict)
    """Node -> its row in the cache, once fed."""


def level_layout(
    trees: list[TreeRows], device: torch.device | str
) -> tuple[RaggedLayout, list[tuple[int, int]]] | None:
    """The next level of every growing tree as one ragged block, or None once every tree is grown.

    Each frontier node is fed at its depth's position and attends to its session's true rows, its
    ancestors' rows (fed at earlier levels) and itself, never to its cousins. Those rows are
    speculative: the drafter crops them once the trees are grown. Returns the layout and the
    ``(tree index, node)`` of each row, in order.
    """
    masks, positions, bounds, ordered = [], [], [0], []
    for b, tree in enumerate(trees):
        mine = tree.grower.frontier()
        if not mine:
            continue
        nodes = tree.grower.nodes
        past = tree.cache.get_seq_length()
        mask = torch.zeros(len(mine), past + len(mine), dtype=torch.bool, device=device)  # [n_b, past + n_b]
        mask[:, : tree.base] = True
        for r, node in enumerate(mine):
            parent = nodes[node].parent
            while parent >= 0:
                mask[r, tree.rows[parent]] = True
                parent = nodes[parent].parent
            mask[r, past + r] = True
            tree.rows[node] = past + r
            positions.append(tree.root_position + nodes[node].depth)
            ordered.append((b, node))
        masks.append(mask)
        bounds.append(bounds[-1] + len(mine))
    if not ordered:
        return None
    return RaggedLayout(bounds, masks, torch.tensor(positions, device=device)), ordered


def grow_level(
    growing: list[tuple[TreeGrower, int]],
    top_of: Callable[[list[int], int], tuple[list[list[int]], list[list[float]]]],
    logits_of: Callable[[list[int]], torch.Tensor],
) -> None:
    """Adds children to each ``(grower, node)`` of one level, row r being the draft's output after that
    node. Greedy trees take their likeliest ``width`` children for all their rows at once, from
    ``top_of(rows, width)`` (host lists ``[G, width]`` of ids and probabilities); the others draw from
    ``logits_of(rows)`` (``[S, V]`` on the host), row by row."""
    greedy = [r for r, (grower, _) in enumerate(growing) if grower.ranks_on_head]
    if greedy:
        ids, probs = top_of(greedy, max(growing[r][0].shape.width for r in greedy))
        for row, r in enumerate(greedy):
            grower, node = growing[r]
            top = [(i, q) for i, q in zip(ids[row], probs[row]) if q > 0][: grower.shape.width]  # its support only
            grower.grow_top(node, [i for i, _ in top], [q for _, q in top])
    taken = set(greedy)
    rest = [r for r in range(len(growing)) if r not in taken]
    if rest:
        for (grower, node), logits in zip((growing[r] for r in rest), logits_of(rest)):
            grower.grow(node, logits)
