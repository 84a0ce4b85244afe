"""Choosing each round's token tree from measured acceptance by depth and sibling rank.

A tree round commits, in expectation, one token of the target's own plus, for every node, the chance
that the walk from the root accepts it (``specdec.trees``). With a(d, r) the probability that the
rank-r child at depth d is accepted given that its parent was and its earlier siblings were not,

    P(node) = P(parent) * a(d, r) * (1 - a(d, 0)) * ... * (1 - a(d, r - 1)),

so E(tree) = 1 + the sum of P over its nodes. A child's P never exceeds its parent's, so the best tree
of N nodes holds the N largest P of the unbounded tree, found best first (``best_tree``); this is the
expected value of the tree the draft grows by its own path probabilities (``draft_service.tree_draft``).
A chain of k is the tree whose nodes are all rank 0, so a tree of k nodes never expects fewer tokens
than the chain of k, and costs the same verify rows.

Sampled (not coupled) trees have a fixed shape (``width`` siblings per level, the first expanding):
for them the expectation is summed over that shape (``spine_tokens``).

The round's cost is that of a draft call over ``depth`` levels plus a verify pass over N + 1 rows, so
the policy compares tokens per millisecond of the best tree of each size with the best chain and
target-only (``coordinator.adaptive``), and a tree only wins where it pays.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from specdec.trees import TreeShape, children

# A sibling's acceptance before it is measured: the draft's second guess, given its first failed.
SIBLING_PRIOR = 0.25
PRIOR_WEIGHT = 4.0
# Most children per node a tree takes.
MAX_WIDTH = 4


@dataclass
class TreeAcceptance:
    """Counts by (depth, rank) of children judged (their parent accepted, earlier siblings not) and
    accepted, smoothed towards priors: the chain's rate by depth for rank 0, SIBLING_PRIOR otherwise."""

    judged: dict[tuple[int, int], int] = field(default_factory=dict)
    accepted: dict[tuple[int, int], int] = field(default_factory=dict)
    # Past this many judged first children the counts halve, so the estimate follows a changing draft.
    horizon: int = 2000

    def record(self, parents: tuple[int, ...], path: tuple[int, ...]) -> None:
        """Counts one verified tree and its accepted path (root to leaf)."""
        if self.judged.get((1, 0), 0) > self.horizon:
            self.judged = {key: n // 2 for key, n in self.judged.items()}
            self.accepted = {key: n // 2 for key, n in self.accepted.items()}
        kids = children(parents)
        node = -1
        for depth in range(1, len(path) + 2):
            taken = path[depth - 1] if depth <= len(path) else None
            for rank, child in enumerate(kids.get(node, ())):
                key = (depth, rank)
                self.judged[key] = self.judged.get(key, 0) + 1
                if child == taken:
                    self.accepted[key] = self.accepted.get(key, 0) + 1
                    break
            if taken is None:
                return
            node = taken

    def rate(self, depth: int, rank: int, chain_rates: list[float]) -> float:
        """a(depth, rank), smoothed; ``chain_rates[d - 1]`` is the chain's conditional rate at depth d."""
        if rank == 0:
            prior = chain_rates[min(depth, len(chain_rates)) - 1] if chain_rates else 0.5
        else:
            prior = SIBLING_PRIOR
        key = (depth, rank)
        return (self.accepted.get(key, 0) + prior * PRIOR_WEIGHT) / (self.judged.get(key, 0) + PRIOR_WEIGHT)


@dataclass
class TreeDraftCosts:
    """Moving averages of tree draft calls' milliseconds by (depth, width): a level of a tree feeds
    several nodes, so it costs more than a chain's step, by how much only measuring tells."""

    smoothing: float = 0.2
    # Before a shape is measured: its chain of the same depth's cost times this.
    prior_factor: float = 1.5
    seen: dict[tuple[int, int], float] = field(default_factory=dict)

    def record(self, shape: TreeShape, ms: float) -> None:
        """Folds in one routine tree draft call of ``shape``."""
        key = (shape.depth, shape.width)
        known = self.seen.get(key)
        self.seen[key] = ms if known is None else known + self.smoothing * (ms - known)

    def estimate(self, shape: TreeShape, chain_ms: float) -> float:
        """The call's expected cost: measured for its depth and width, else from the nearest measured
        width at its depth scaled by width, else ``prior_factor`` times the chain's ``chain_ms``."""
        known = self.seen.get((shape.depth, shape.width))
        if known is not None:
            return known
        widths = [w for d, w in self.seen if d == shape.depth]
        if widths:
            near = min(widths, key=lambda w: abs(w - shape.width))
            return self.seen[(shape.depth, near)] * max(1.0, shape.width / near)
        return chain_ms * self.prior_factor


def best_tree(rate, max_nodes: int, max_depth: int, max_width: int = MAX_WIDTH) -> list[tuple[float, TreeShape]]:
    """For N = 1 .. max_nodes: the expected tokens of the best tree of N nodes and its shape.

    ``rate(depth, rank)`` is a(d, r). Nodes are taken best first from the unbounded tree (depth up to
    ``max_depth``, ``max_width`` children a node); each taken node offers its children next.
    """
    out: list[tuple[float, TreeShape]] = []
    heap: list[tuple[float, int, int, int, float]] = []  # (-P, tie, depth, rank, P of the parent)
    shares: dict[int, list[float]] = {}  # by depth: a(d, r) times the misses of the ranks before r
    tie = 0

    def offer(p_parent: float, depth: int, rank: int) -> None:
        nonlocal tie
        if depth > max_depth or rank >= max_width:
            return
        if depth not in shares:
            missed, row = 1.0, []
            for r in range(max_width):
                a = rate(depth, r)
                row.append(missed * a)
                missed *= 1.0 - a
            shares[depth] = row
        heapq.heappush(heap, (-(p_parent * shares[depth][rank]), tie, depth, rank, p_parent))
        tie += 1

    # A draft grows a node's children in rank order (its top-w), so a child of rank r is offered only
    # once its sibling of rank r - 1 is taken: every prefix of the order is a tree a draft can propose.
    offer(1.0, 1, 0)
    total, deepest, widest = 1.0, 0, 0
    while heap and len(out) < max_nodes:
        neg_p, _, depth, rank, p_parent = heapq.heappop(heap)
        total -= neg_p
        deepest, widest = max(deepest, depth), max(widest, rank + 1)
        out.append((total, TreeShape(len(out) + 1, deepest, widest)))
        offer(p_parent, depth, rank + 1)
        offer(-neg_p, depth + 1, 0)
    return out


def spine_tokens(rate, depth: int, width: int) -> float:
    """Expected tokens of a fixed-shape sampled tree: ``width`` siblings per level, the first expanding."""
    total, reach = 1.0, 1.0
    for d in range(1, depth + 1):
        missed, gained = 1.0, 0.0
        for rank in range(width):
            a = rate(d, rank)
            gained += missed * a
            missed *= 1.0 - a
        total += reach * gained
        reach *= rate(d, 0)
    return total


@dataclass(frozen=True)
class RoundOption:
    """A round's proposal priced: ``tokens`` expected per round over the round's milliseconds, ``ms``
    (its verify pass plus ``depth`` draft levels). A chain has width 1; target-only, 0 nodes."""

    shape: TreeShape | None
    tokens: float
    ms: float

    @property
    def per_ms(self) -> float:
        """Expected tokens per millisecond."""
        return self.tokens / self.ms

    @property
    def nodes(self) -> int:
        """Draft tokens the round verifies (0: target-only)."""
        return self.shape.nodes if self.shape is not None else 0


def round_options(
    rate, pass_ms: list[float], level_ms: float, max_depth: int, max_width: int = MAX_WIDTH
) -> tuple[list[RoundOption], list[RoundOption]]:
    """Every chain (target-only first) and every best-first tree (``best_tree``) that ``pass_ms``
    prices, each costed at ``pass_ms[nodes]`` (a pass over nodes + 1 rows) plus ``level_ms`` per
    draft level; returns ``(chains, trees)``, trees of width 1 left out (they are the chains).

    With the measured a(d, r), a pass-cost curve and ``level_ms`` 0 this is the ceiling of speculation
    on that hardware with that draft: a draft that cost nothing and a stack with no overhead could get
    no more than the best of these (``bench.tree_ceiling``)."""
    most = len(pass_ms) - 1
    chains = [RoundOption(None, 1.0, pass_ms[0])]
    chains += [
        RoundOption(shape, tokens, pass_ms[shape.nodes] + level_ms * shape.depth)
        for tokens, shape in best_tree(rate, min(most, max_depth), max_depth, max_width=1)
    ]
    trees = [
        RoundOption(shape, tokens, pass_ms[shape.nodes] + level_ms * shape.depth)
        for tokens, shape in best_tree(rate, most, max_depth, max_width)
        if shape.width > 1
    ]
    return chains, trees
