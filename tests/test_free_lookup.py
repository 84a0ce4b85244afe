"""The coordinator's own prompt lookup: the rule that sizes it, and greedy rounds it drafts stay exact."""

from __future__ import annotations

from harness import InProcessStack
from test_e2e_tiny import hf_greedy

from coordinator.adaptive import AcceptanceTracker, CostModel
from draft_service.engine import ModelDrafter
from specdec import Client
from specdec.batching import PassLoad
from target_service.engine import TargetEngine

# The tiny target falls into loops over this prompt, so what it writes repeats its own context.
REPEATING = "w1 w2 w3 w1 w2 w3 w1 w2 w3"


def _pass(sessions: int, first_ms: float, per_row_ms: float) -> PassLoad:
    """A pass of ``sessions`` one-row sessions whose every extra row costs ``per_row_ms``."""
    curve = [first_ms + per_row_ms * n for n in range(9)]
    return PassLoad(sessions, sessions, sessions - 1, first_ms, curve, [110.0 + 3.0 * n for n in range(9)])


def test_free_lookup_pays_where_rows_are_cheap_and_not_where_they_are_not():
    costs = CostModel(k_max=8)
    hits = AcceptanceTracker(prior=0.7)
    # Two sessions on a pass that reads every weight anyway: rows are nearly free, take most of the find
    # (in a shared pass each further row must promise 5% more).
    assert costs.choose_free(hits, _pass(2, 120.0, 3.0), 4) >= 3
    assert costs.choose_free(hits, _pass(2, 120.0, 3.0), 1) == 1  # never more than was found
    # Sixteen sessions on a compute-bound pass: a row costs its full share of the pass (13 ms of 210),
    # more than the 0.7 of a token it brings.
    assert costs.choose_free(hits, _pass(16, 210.0, 13.2), 4) == 0
    # A session whose lookups keep missing stops paying for them, however cheap the rows.
    misses = AcceptanceTracker(prior=0.7)
    for _ in range(100):
        misses.record(2, 0)
    assert costs.choose_free(misses, _pass(2, 120.0, 3.0), 4) == 0
    # Without a load report the rule reads the verify costs this coordinator measured.
    for _ in range(5):
        costs.record_verify(10.0, 1)
        costs.record_verify(10.5, 5)
    assert costs.choose_free(hits, None, 4) == 4


def test_a_lookup_hit_replaces_the_draft_call_only_where_it_promises_more():
    """A lone session: verify 90 ms for one row and 9 ms a row more, a draft call for one token
    12 ms. The model draft passes 45% of its tokens."""
    costs = CostModel(k_max=8)
    costs.record_draft(12.0, 1)
    alone = _pass(1, 90.0, 9.0)
    drafted = AcceptanceTracker(prior=0.45, prior_weight=1e6)
    # Copied text: four looked-up tokens that pass 80% of the time give about 3.4 tokens for 126 ms,
    # against 1.45 for 111 ms from the draft call.
    copied = AcceptanceTracker(prior=0.8, prior_weight=1e6)
    assert costs.prefers_free(copied, 4, drafted, 1, alone)
    # A lookup that mostly misses is not worth even a free call's rows, against a fair draft.
    missing = AcceptanceTracker(prior=0.1, prior_weight=1e6)
    assert not costs.prefers_free(missing, 1, drafted, 1, alone)
    # With the draft call's cost measured at 60 ms (a loaded draft replica), one even-odds lookup token wins.
    costs.record_draft(300.0, 1)
    assert costs.draft_curve()[1] > 60
    assert costs.prefers_free(AcceptanceTracker(prior=0.5, prior_weight=1e6), 1, drafted, 1, alone)


def _rounds(stack: InProcessStack) -> list:
    return [s for s in stack.exporter.get_finished_spans() if s.name == "specdec.round"]


def test_rounds_the_draft_sits_out_are_drafted_by_lookup_and_stay_exact(tiny_target, tiny_draft, tiny_dir, redis_url):
    """A draft that hardly ever agrees with the target soon gets k = 0; the coordinator then proposes
    from the context itself, without calling the draft service, and the output is still greedy's."""
    stack = InProcessStack(
        TargetEngine(tiny_target, 64), ModelDrafter(tiny_draft, 64, 64), tiny_dir / "target", redis_url
    ).start()
    try:
        off = stack.add_coordinator(free_lookup_min=0)
        expected = hf_greedy(tiny_target, REPEATING, 40)
        with Client(stack.address, timeout=60) as client:
            result = client.complete(REPEATING, max_new_tokens=40)
        assert result.token_ids == expected
        looked_up = [s for s in _rounds(stack) if s.attributes["specdec.looked_up"]]
        assert looked_up, "no round was drafted by the coordinator's lookup"
        assert sum(s.attributes["specdec.accepted"] for s in looked_up) > 0
        assert result.stats.accepted_tokens >= sum(s.attributes["specdec.accepted"] for s in looked_up)
        # A looked-up round calls no draft service (a call would have taken time).
        assert all(s.attributes["specdec.draft_ms"] == 0 for s in looked_up)

        stack.exporter.clear()
        with Client(off, timeout=60) as client:
            assert client.complete(REPEATING, max_new_tokens=40).token_ids == expected
        assert not any(s.attributes["specdec.looked_up"] for s in _rounds(stack))
    finally:
        stack.close()
