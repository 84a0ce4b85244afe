"""Token trees: many draft continuations in one round, and their shape (plain Python, no torch).

A round may propose a tree instead of a chain. Its nodes are listed parents first: node i carries a
token and ``parents[i]``, the index of an earlier node or -1 for a child of the root (the last
committed token). A chain of k tokens is the tree with parents ``[-1, 0, 1, ..., k - 2]``. Children
of one node are its *siblings*, ranked by their order in the list (rank 0 first).

How the target verifies a tree, and why the sampled rule is exact: ``specdec.tree_verify``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec.config import MAX_TREE_NODES


@dataclass(frozen=True)
class TreeShape:
    """The size a tree proposal may take: ``nodes`` in all, ``depth`` levels, ``width`` children a node."""

    nodes: int
    depth: int
    width: int

    def check(self) -> None:
        """Raises ValueError for a shape no proposal can take."""
        if not 0 < self.nodes <= MAX_TREE_NODES:
            raise ValueError(f"tree.nodes: must lie in [1, {MAX_TREE_NODES}]")
        if not 0 < self.depth <= self.nodes or not 0 < self.width <= self.nodes:
            raise ValueError("tree.depth and tree.width: must lie in [1, tree.nodes]")


def check_parents(parents: Sequence[int], max_nodes: int = MAX_TREE_NODES) -> None:
    """Raises ValueError unless ``parents`` lists a tree parents first (each parent an earlier node or -1)."""
    if len(parents) > max_nodes:
        raise ValueError(f"draft_parents: at most {max_nodes} nodes per tree, got {len(parents)}")
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(
                f"draft_parents: node {i} names parent {parent}; a parent must be an earlier node or -1 (the root)"
            )


def chain_parents(k: int) -> list[int]:
    """The parents of a chain of ``k`` tokens."""
    return list(range(-1, k - 1))


def is_chain(parents: Sequence[int]) -> bool:
    """Whether ``parents`` is a plain chain (each node the child of the one before)."""
    return all(parent == i - 1 for i, parent in enumerate(parents))


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: 1 for a child of the root."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def ranks(parents: Sequence[int]) -> list[int]:
    """Each node's rank among its siblings (0: its parent's first child)."""
    seen: dict[int, int] = {}
    out = []
    for parent in parents:
        out.append(seen.get(parent, 0))
        seen[parent] = out[-1] + 1
    return out


def children(parents: Sequence[int]) -> dict[int, list[int]]:
    """Each node's children in rank order, keyed by node index (-1: the root)."""
    out: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        out.setdefault(parent, []).append(i)
    return out


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's first child down to ``node`` (empty for the root, -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def node_paths(tokens: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """The draft tokens before each row a tree is scored in: ``[]`` for the root's row, then for node
    i the tokens from the root's child down to i itself (what row i + 1 follows)."""
    out: list[list[int]] = [[]]
    for i, parent in enumerate(parents):
        out.append([*out[parent + 1], tokens[i]])
    return out
