"""The tree choice: acceptance by depth and rank, the best tree of each size, and the policy's pick."""

from __future__ import annotations

import pytest

from coordinator.adaptive import expected_tokens
from coordinator.tree_choice import TreeAcceptance, TreeDraftCosts, best_tree, round_options, spine_tokens
from specdec.trees import TreeShape


def test_acceptance_counts_follow_the_walk():
    trees = TreeAcceptance()
    # root -> (0, 1); 0 -> (2, 3); the path took node 1 (rank 1) and stopped there.
    trees.record((-1, -1, 0, 0), (1,))
    assert trees.judged == {(1, 0): 1, (1, 1): 1}  # node 1 has no children: depth 2 judged nothing
    assert trees.accepted == {(1, 1): 1}
    # A path through rank 0 at depth 1 and rank 1 at depth 2: depth 2 judged both children, depth 3 none.
    trees.record((-1, -1, 0, 0), (0, 3))
    assert trees.judged[(1, 0)] == 2 and trees.judged[(2, 0)] == 1 and trees.judged[(2, 1)] == 1
    assert trees.accepted[(1, 0)] == 1 and trees.accepted[(2, 1)] == 1


def test_best_tree_of_rank_zero_only_is_the_chain():
    """With siblings that never pass, the best tree of N nodes is the chain of N: E equals the chain's."""
    chain = [0.7, 0.6, 0.5, 0.4]

    def rate(depth, rank):
        return chain[depth - 1] if rank == 0 else 0.0

    trees = best_tree(rate, max_nodes=4, max_depth=4)
    for n, (tokens, shape) in enumerate(trees, start=1):
        assert tokens == pytest.approx(expected_tokens(chain, n))
        assert shape == TreeShape(n, n, 1)


def test_siblings_that_pass_widen_the_tree_and_never_lose_to_the_chain():
    def rate(depth, rank):
        return 0.5 if rank == 0 else 0.4

    trees = best_tree(rate, max_nodes=8, max_depth=6)
    for n, (tokens, _) in enumerate(trees, start=1):
        assert tokens >= expected_tokens([0.5], n) - 1e-9
    assert trees[-1][1].width > 1 and trees[-1][0] > expected_tokens([0.5], 8) + 0.1


def test_every_best_tree_is_a_shape_the_draft_accepts_when_a_sibling_outranks_the_first():
    """A sampled turn's own rates can make a second sibling likelier than the first (a(1, 0) tiny): the
    tree still takes siblings in rank order, so no shape is wider than its nodes (the draft refuses those)."""

    def rate(depth, rank):
        return 0.02 if rank == 0 else 0.9

    trees = best_tree(rate, max_nodes=8, max_depth=4)
    for n, (_, shape) in enumerate(trees, start=1):
        shape.check()
        assert shape.nodes == n and shape.width <= n


def test_spine_tokens_count_a_passing_sibling_once():
    def rate(depth, rank):
        return 0.5 if rank == 0 else 1.0

    # Depth 1 always accepts some child; depth 2 is reached only through rank 0 (half the time).
    assert spine_tokens(rate, 2, 2) == pytest.approx(1 + 1.0 + 0.5 * 1.0)
    assert spine_tokens(rate, 1, 1) == pytest.approx(1.5)


def test_tree_draft_costs_start_pessimistic_and_learn():
    costs = TreeDraftCosts()
    assert costs.estimate(TreeShape(6, 3, 2), 10.0) == 15.0
    costs.record(TreeShape(6, 3, 2), 12.0)
    assert costs.estimate(TreeShape(6, 3, 2), 10.0) == 12.0
    assert costs.estimate(TreeShape(9, 3, 3), 10.0) == pytest.approx(18.0)  # scaled by width from the nearest


def _policy_with(rates, curve, colocated=False, sessions=1):
    """A policy over one batching target whose pass costs ``curve`` ms by rows, with acceptance ``rates``."""
    from coordinator.policy import SpeculationConfig, SpeculationPolicy
    from coordinator.replicas import CacheRef
    from coordinator.sessions import SessionRecord, TurnState
    from coordinator.turns import GenerationRequest, Stats, Turn
    from specdec.batching import PassLoad
    from specdec.sampling_params import Sampling

    policy = SpeculationPolicy(SpeculationConfig(tree_nodes=15, max_auto_k=8, draft_colocated=colocated))
    request = GenerationRequest("x", None, 64)
    record = SessionRecord("s", [1, 2, 3], turn=TurnState(fingerprint="", prompt_len=3, seed=0))
    target = CacheRef("t", "c", 3, 0)
    turn = Turn(request, record, False, Sampling(), Stats(), lambda: None, None, target)
    policy.start(turn)
    turn.stats.positions.prior_rates = rates["chain"]
    turn.stats.positions.prior_weight = 1e6
    for depth in range(1, 9):
        for rank in range(1, 4):
            policy.trees.judged[(depth, rank)] = 10_000
            policy.trees.accepted[(depth, rank)] = int(10_000 * rates["sibling"])
    policy.loads.note("t", PassLoad(sessions, sessions, sessions - 1, curve[0], list(curve), list(curve)))
    for n in range(1, 9):
        policy.costs.record_draft(2.0 * n + 1.0, n)
    return policy, turn


def test_the_policy_takes_a_tree_where_siblings_pay_and_a_chain_where_they_do_not():
    flat = [60.0 + 1.0 * rows for rows in range(16)]  # rows nearly free: an accelerator's pass
    policy, turn = _policy_with({"chain": [0.5] * 8, "sibling": 0.4}, flat)
    plan = policy.plan(turn, 64)
    assert plan.tree is not None and plan.tree.width > 1 and plan.k == plan.tree.depth
    steep = [60.0 + 30.0 * rows for rows in range(16)]  # every row costs half a pass
    policy, turn = _policy_with({"chain": [0.5] * 8, "sibling": 0.4}, steep)
    assert policy.plan(turn, 64).tree is None
    useless = [60.0 + 1.0 * rows for rows in range(16)]
    policy, turn = _policy_with({"chain": [0.5] * 8, "sibling": 0.0}, useless)
    assert policy.plan(turn, 64).tree is None  # siblings never pass: the chain of the same rows is as good


def test_no_tree_under_load_where_the_draft_shares_the_targets_cores():
    """A shared pass with the draft on the target's cores gets no tree: under load trees cannot make
    a level slower than chains, which the same rule already keeps short there."""
    flat = [60.0 + 1.0 * rows for rows in range(16)]
    rates = {"chain": [0.5] * 8, "sibling": 0.4}
    policy, turn = _policy_with(rates, flat, colocated=True, sessions=1)
    assert policy.plan(turn, 64).tree is not None  # alone, the same tree pays
    for sessions in (2, 8):
        policy, turn = _policy_with(rates, flat, colocated=True, sessions=sessions)
        assert policy.plan(turn, 64).tree is None


def test_a_request_can_turn_trees_off():
    from dataclasses import replace

    flat = [60.0 + 1.0 * rows for rows in range(16)]
    policy, turn = _policy_with({"chain": [0.5] * 8, "sibling": 0.4}, flat)
    turn.request = replace(turn.request, tree_nodes=0)
    assert policy.plan(turn, 64).tree is None


def test_round_options_price_chains_and_trees_by_rows_and_levels():
    def rate(depth, rank):
        return 0.5 if rank == 0 else 0.4

    pass_ms = [10.0 + n for n in range(7)]  # a pass over n + 1 rows
    chains, trees = round_options(rate, pass_ms, level_ms=2.0, max_depth=3)
    assert [c.nodes for c in chains] == [0, 1, 2, 3]  # target-only, then chains up to max_depth
    assert chains[0].tokens == 1.0 and chains[0].ms == 10.0
    assert chains[2].tokens == pytest.approx(expected_tokens([0.5], 2)) and chains[2].ms == 12.0 + 2 * 2.0
    assert all(t.shape.width > 1 for t in trees) and max(t.nodes for t in trees) == 6
    for option in trees:
        assert option.ms == pass_ms[option.nodes] + 2.0 * option.shape.depth
    # A tree of N nodes expects at least the chain of N (within max_depth).
    widest = max(trees, key=lambda t: t.nodes)
    assert widest.tokens > chains[-1].tokens


def test_costly_rows_make_the_chain_the_ceiling():
    """Rows that cost as much as a pass: no proposal beats target-only, and trees never beat chains."""

    def rate(depth, rank):
        return 0.5 if rank == 0 else 0.3

    chains, trees = round_options(rate, [10.0 * (n + 1) for n in range(9)], level_ms=0.0, max_depth=4)
    best_chain = max(chains, key=lambda o: o.per_ms)
    assert best_chain.shape is None
    assert max(t.per_ms for t in trees) < best_chain.per_ms
