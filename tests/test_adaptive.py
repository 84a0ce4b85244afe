"""The adaptive-k rule on synthetic acceptance and costs."""

from __future__ import annotations

import pytest

from coordinator.adaptive import AcceptanceTracker, CostModel, choose_k, expected_tokens
from specdec.batching import PassLoad


@pytest.mark.parametrize("a,k", [(0.3, 4), (0.8, 6), (0.5, 1)])
def test_expected_tokens_matches_closed_form(a, k):
    assert expected_tokens([a] * k, k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))


def test_flat_verify_cost_and_good_draft_takes_long_drafts():
    verify = [0.0] + [100.0] * 10  # verifying 1..9 tokens costs the same (a GPU)
    assert choose_k([0.9] * 8, 1.0, verify, 8) == 8


def test_verify_cost_linear_in_tokens_never_speculates():
    verify = [0.0] + [100.0 * n for n in range(1, 11)]  # compute-bound: each token costs a full pass
    assert choose_k([0.9] * 8, 1.0, verify, 8) == 0


def test_useless_draft_turns_speculation_off():
    verify = [0.0] + [100.0 + 5 * n for n in range(1, 11)]
    assert choose_k([0.0] * 8, 1.0, verify, 8) == 0


def test_moderate_draft_picks_a_middle_k():
    verify = [0.0] + [100.0, 110.0, 120.0, 140.0, 170.0, 210.0, 260.0, 320.0, 390.0, 470.0]
    k = choose_k([0.6] * 8, 2.0, verify, 8)
    assert 1 <= k <= 5
    rate = lambda kk: expected_tokens([0.6] * 8, kk) / (kk * 2.0 + verify[kk + 1])  # noqa: E731
    assert all(rate(k) >= rate(other) for other in range(9))


def test_tracker_smooths_and_conditions_on_position():
    tracker = AcceptanceTracker(prior=0.5, prior_weight=2.0)
    assert tracker.rates(2) == [0.5, 0.5]
    for _ in range(8):
        tracker.record(drafted=2, accepted=2)
    tracker.record(drafted=2, accepted=0)
    first, second = tracker.rates(3)[:2]
    assert first == pytest.approx((8 + 1) / (9 + 2))
    # The round that failed at position 1 never tried position 2; a position's prior is the estimate
    # of the position before it.
    assert second == pytest.approx((8 + first * 2) / (8 + 2))


def test_tracker_rates_are_conditional_so_their_product_is_the_chance_to_get_that_far():
    """Half the rounds fail at once, half pass all three tokens: a round that reaches position 2 or 3
    always passes it, and E(3) must be the measured 1 + 0.5 * 3 tokens a round."""
    tracker = AcceptanceTracker(prior=0.5, prior_weight=1e-9)
    for _ in range(10):
        tracker.record(drafted=3, accepted=0)
        tracker.record(drafted=3, accepted=3)
    assert tracker.rates(3) == pytest.approx([0.5, 1.0, 1.0])
    assert expected_tokens(tracker.rates(3), 3) == pytest.approx(2.5)
    assert (tracker.drafted, tracker.accepted) == ([20, 20, 20], [10, 10, 10])  # what the stats report


def test_cost_model_learns_and_fills_gaps():
    costs = CostModel(k_max=4)
    costs.record_verify(100.0, 1)
    costs.record_verify(130.0, 3)
    curve = costs.curve()
    assert curve[1] == 100.0 and curve[3] == 130.0
    assert curve[1] < curve[2] < curve[3] < curve[4]
    costs.record_draft(20.0, 5)  # 4 ms per token
    assert costs.draft_ms_per_token == pytest.approx(2.0 + 0.2 * (4.0 - 2.0))
    costs.record_draft(12.0, 2)
    drafts = costs.draft_curve()
    assert drafts[0] == 0.0 and drafts[2] == 12.0
    # Unmeasured k: the nearest measured call plus the per-token cost for the difference.
    assert drafts[3] == pytest.approx(12.0 + costs.draft_ms_per_token)
    assert drafts[1] == pytest.approx(12.0 - costs.draft_ms_per_token)


def test_a_round_whose_pass_also_fed_the_prompt_is_not_a_rounds_cost():
    """The first round after a deferred prefill fed the prompt too: its round trip still counts, its
    milliseconds do not enter the verify curve."""
    costs = CostModel(k_max=4)
    costs.record_verify(100.0, 1, PassLoad(1, 1, 0, 95.0, [], [], 0.0, fed_rows=1))
    trip = costs.overhead_ms
    costs.record_verify(700.0, 1, PassLoad(3, 150, 2, 690.0, [], [], 0.0, fed_rows=148))
    assert costs.curve()[1] == 100.0
    assert costs.overhead_ms > trip  # a 10 ms trip, folded in
    costs.record_verify(120.0, 1, PassLoad(2, 2, 1, 110.0, [], [], 0.0, fed_rows=1))
    assert costs.curve()[1] == pytest.approx(100.0 + 0.2 * 20.0)


def test_a_cheap_average_token_does_not_hide_an_expensive_call():
    """Prompt-lookup hits make tokens look free; the call's round trip still counts against k."""
    accept = [0.5] * 4
    verify = [0.0, 100.0, 101.0, 102.0, 103.0, 104.0]
    assert choose_k(accept, 0.5, verify, 4) > 0
    assert choose_k(accept, [0.0, 100.0, 101.0, 102.0, 103.0], verify, 4) == 0


def test_confidence_cut_off_prices_a_token_against_a_target_only_step():
    """min_confidence = (draft ms per token + one verify row) / one-token verify, from measured costs."""
    cpu = CostModel(k_max=4, draft_ms_per_token=5.0)
    cpu.record_verify(90.0, 1)
    cpu.record_verify(99.0, 2)
    assert cpu.min_confidence() == pytest.approx((5.0 + 9.0) / 90.0)
    # Rows that cost nothing (an accelerator's pass) leave only the draft's share: drafts run longer.
    gpu = CostModel(k_max=4, draft_ms_per_token=1.0)
    gpu.record_verify(20.0, 1)
    gpu.record_verify(20.0, 2)
    assert gpu.min_confidence() == pytest.approx(1.0 / 20.0)
    # A draft dearer than the target's own step is never worth a token.
    dear = CostModel(k_max=4, draft_ms_per_token=200.0)
    dear.record_verify(90.0, 1)
    assert dear.min_confidence() == 1.0
    # Before any measurement the priors price it: (2 ms draft + 8% of a 100 ms step) / 100 ms. Sampled
    # requests keep these priors, so their cut-off never depends on timing.
    assert CostModel(k_max=4).min_confidence() == pytest.approx((2.0 + 8.0) / 100.0)
