"""The tree ceiling: acceptance by depth and rank measured through the in-process round loop, and the
report that prices chains and trees with it (``bench.tree_ceiling``)."""

from __future__ import annotations

import pytest

from bench.single import BenchPrompt
from bench.tree_ceiling import MEASURED_DEPTH, TreeRun, measure_tree_rounds, monotone_fit, report
from coordinator.tree_choice import TreeAcceptance
from draft_service.engine import ModelDrafter


def test_monotone_fit_pools_what_decreases():
    assert monotone_fit([3.0, 1.0, 2.0, 5.0, 4.0]) == pytest.approx([2.0, 2.0, 2.0, 4.5, 4.5])
    assert monotone_fit([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]


def test_a_draft_equal_to_the_target_passes_every_first_child(tiny_target):
    prompts = [BenchPrompt("a", "w1 w2 w3"), BenchPrompt("b", "w4 w5")]
    run = measure_tree_rounds(tiny_target, ModelDrafter(tiny_target, 8, 64), prompts, 12, nodes=8, depth=4)
    assert 0 < run.tokens <= 24 and 0 < run.rounds < run.tokens and run.tree_levels > 0
    assert run.acceptance.judged[(1, 0)] > 0
    assert run.chain_rates() and all(rate == 1.0 for rate in run.chain_rates())
    # The first child always passes, so no sibling is ever judged.
    assert all(rank == 0 for _, rank in run.acceptance.judged)


def test_report_prices_chains_against_trees():
    """Every first child passes and siblings never do: the best tree is no better than the deepest chain,
    which also reaches the goal."""
    acceptance = TreeAcceptance()
    for depth in range(1, MEASURED_DEPTH + 1):
        acceptance.judged[(depth, 0)] = acceptance.accepted[(depth, 0)] = 50
        acceptance.judged[(depth, 1)] = 50
    run = TreeRun(acceptance, rounds=10, committed_in_rounds=40, draft_ms=20.0, tree_levels=10)
    pass_ms = [10.0 + 0.1 * n for n in range(33)]
    out = report(run, pass_ms, generate_tps=50.0, goal_tokens=2.3, config={})
    free = out["free_draft"]
    assert free["best_chain"]["depth"] == MEASURED_DEPTH and free["best_chain"]["width"] == 1
    assert free["best_chain"]["tokens_per_pass"] == pytest.approx(MEASURED_DEPTH + 1)
    assert free["tree_vs_chain"] <= 1.0
    assert free["reaching_goal"]["width"] == 1
    assert out["at_measured_draft"]["draft_ms_per_level"] == 2.0
    assert out["most_over_draft_costs"]["tree_vs_chain"] <= 1.0
    assert out["measured"]["acceptance_judged_accepted"]["1,1"] == [50, 0]
