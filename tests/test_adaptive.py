"""The adaptive-k rule on synthetic acceptance and costs."""

from __future__ import annotations

import pytest

from coordinator.adaptive import AcceptanceTracker, CostModel, FleetAcceptance, choose_k, expected_tokens
from draft_service.server import auto_draft_threads
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
    costs.record_draft(20.0, 5)  # 4 ms per token: the first measurement replaces the assumed 2 ms
    assert costs.draft_ms_per_token == pytest.approx(4.0)
    costs.record_draft(12.0, 2)
    drafts = costs.draft_curve()
    assert drafts[0] == 0.0 and drafts[2] == 12.0
    # Unmeasured k: the nearest measured call plus a draft step (the slope of the two calls, 8 ms
    # over 3 tokens) for the difference, not the per-token average that carries the call's fixed cost.
    assert costs.draft_step_ms() == pytest.approx(8.0 / 3)
    assert drafts[3] == pytest.approx(12.0 + 8.0 / 3)
    assert drafts[1] == pytest.approx(12.0 - 8.0 / 3)


def test_a_probe_of_a_model_draft_seeds_the_priors_and_rounds_replace_them():
    """The start-up probe priced a draft call at 10 ms plus 30 ms a token (a model draft, not the
    assumed 2 ms a token) and a verify pass at 95 ms plus 5 ms a row. Before any round those are the
    costs k is chosen by; a round's own measurement of a size then replaces its prior."""
    probe = CostModel(k_max=8)
    for _ in range(3):
        probe.record_draft(40.0, 1)
        probe.record_draft(250.0, 8)
        probe.record_verify(100.0, 2)
        probe.record_verify(135.0, 9)
    costs = CostModel(k_max=8)
    costs.seed(probe)
    assert costs.draft_curve() == pytest.approx([0.0] + [10.0 + 30.0 * k for k in range(1, 9)])
    assert costs.curve()[1:] == pytest.approx([95.0 + 5.0 * (n - 1) for n in range(1, 10)])
    good = AcceptanceTracker(prior=0.9, prior_weight=1e6)
    # Each token of this draft costs a third of a pass: k stops short of the 8 the assumed priors took.
    assert 0 < costs.choose(good) < 8 == CostModel(k_max=8).choose(good)
    costs.record_verify(60.0, 1)
    assert costs.curve()[1] == 60.0
    costs.record_draft(70.0, 2)  # measured: replaces the prior at 2; the probed step extrapolates it
    assert costs.draft_curve()[2] == 70.0 and costs.draft_curve()[3] == pytest.approx(70.0 + 30.0 + 0.2 * 5.0)
    # A probe that measured nothing leaves the priors as they were.
    untouched = CostModel(k_max=8)
    untouched.seed(CostModel(k_max=8))
    assert untouched.draft_curve() == CostModel(k_max=8).draft_curve()
    assert untouched.curve() == CostModel(k_max=8).curve()


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


def test_confidence_cut_off_prices_one_more_token_a_draft_step_and_a_verify_row():
    """min_confidence = (draft step + mean verify row) / one-token verify: a call's fixed part is paid
    whatever it proposes, and a CPU pass's cost jumps at its second row, then barely grows."""
    cpu = CostModel(k_max=4)
    for rows, ms in [(1, 38.0), (2, 44.0), (3, 44.0), (4, 44.0), (5, 44.0)]:
        cpu.record_verify(ms, rows)
    for _ in range(10):
        cpu.record_draft(10.0, 1)
        cpu.record_draft(13.0, 3)
    cpu.record_draft(38.0, 4)  # one slow call of a rare length
    assert cpu.draft_step_ms() == pytest.approx(1.5)
    assert cpu.min_confidence() == pytest.approx((1.5 + 6.0 / 4) / 38.0)
    # Two lengths seen once each still give a slope; one length gives the per-token average.
    fresh = CostModel(k_max=4, draft_ms_per_token=5.0)
    fresh.record_draft(10.0, 1)
    assert fresh.draft_step_ms() == pytest.approx(fresh.draft_ms_per_token)
    fresh.record_draft(16.0, 3)
    assert fresh.draft_step_ms() == pytest.approx(3.0)
    # Rows that cost nothing (an accelerator's pass) leave only the draft's share: drafts run longer.
    gpu = CostModel(k_max=4, draft_ms_per_token=1.0)
    for rows in range(1, 6):
        gpu.record_verify(20.0, rows)
    assert gpu.min_confidence() == pytest.approx(1.0 / 20.0)
    # A draft dearer than the target's own step is never worth a token.
    dear = CostModel(k_max=4, draft_ms_per_token=200.0)
    dear.record_verify(90.0, 1)
    assert dear.min_confidence() == 1.0
    # Before any measurement the priors price it: (2 ms draft + 8% of a 100 ms step) / 100 ms. Sampled
    # requests keep these priors, so their cut-off never depends on timing.
    assert CostModel(k_max=4).min_confidence() == pytest.approx((2.0 + 8.0) / 100.0)


def test_a_new_session_starts_from_the_drafts_acceptance_across_sessions():
    """Early rejections move a session's estimate less when its prior is what the draft achieves
    across sessions, and a session's own long record still outweighs that prior."""
    fleet = FleetAcceptance()
    for i in range(200):  # the draft passes its first token 60% of the time, its second 50%
        first = i % 5 < 3
        fleet.record(2, (1 + (i % 2 == 0)) if first else 0)
    fresh = fleet.session_tracker(4)
    assert fresh.rates(2) == pytest.approx([0.6, 0.5], abs=0.02)
    for _ in range(3):  # three rejections in a row
        fresh.record(2, 0)
    alone = AcceptanceTracker()
    for _ in range(3):
        alone.record(2, 0)
    assert alone.rates(1)[0] == pytest.approx(0.2)
    assert fresh.rates(1)[0] == pytest.approx((0.6 * 6) / 9, abs=0.02)  # 0.4: still worth a draft
    poor = fleet.session_tracker(4)
    for _ in range(60):
        poor.record(2, 0)
    assert poor.rates(1)[0] < 0.07
    resumed = fleet.session_tracker(4, [3, 3], [2, 1], [3, 2])
    assert resumed.tried == [3, 2] and resumed.rates(1)[0] == pytest.approx((2 + 0.6 * 6) / 9, abs=0.02)


def test_the_fleet_estimate_follows_a_changing_draft():
    fleet = FleetAcceptance(horizon=100)
    for _ in range(1000):
        fleet.record(1, 1)
    for _ in range(300):
        fleet.record(1, 0)
    assert fleet.counts.tried[0] <= 100 and fleet.session_tracker(1).rates(1)[0] < 0.15


@pytest.mark.parametrize(
    "parameters,cores,passive,threads",
    [
        (0, 8, True, 1),  # n-gram lookup: no model at all
        (7_000_000, 8, True, 1),  # a shipped feature or token draft
        (135_000_000, 2, True, 1),  # SmolLM2-135M drafting: still small
        (494_000_000, 2, True, 2),  # Qwen2.5-0.5B drafting on 2 cores, idle while the target verifies
        (494_000_000, 16, False, 8),  # its idle threads spin: half the cores, the rest the target's
        (494_000_000, 1, False, 1),
    ],
)
def test_auto_draft_threads_follow_the_drafts_size_and_the_cores(parameters, cores, passive, threads):
    assert auto_draft_threads(parameters, cores, passive) == threads


def test_draft_threads_default_to_auto_on_every_command(tiny_dir, monkeypatch):
    """``specdec up --draft-threads`` and ``serve-draft --threads`` default to auto; a model draft past
    the small size sets its model thread's torch threads once loaded."""
    import argparse

    import torch

    import draft_service.server as draft_server
    from specdec.cli import add_stack, threads_arg
    from specdec.config import DraftConfig, ModelConfig
    from specdec.stack import StackConfig

    parser = argparse.ArgumentParser()
    add_stack(parser)
    assert parser.parse_args([]).draft_threads is None and StackConfig().draft_threads is None
    assert parser.parse_args(["--draft-threads", "3"]).draft_threads == 3
    assert threads_arg("auto") is None
    with pytest.raises(argparse.ArgumentTypeError):
        threads_arg("0")

    model = ModelConfig(model=str(tiny_dir / "draft"), cache_dir=tiny_dir)
    config = DraftConfig(kind="model", model=model, auto_threads=True, cores=3, passive_wait=True)

    def threads_after_build(config: DraftConfig) -> int:
        torch.set_num_threads(1)
        draft_server.build_drafter(config)
        return torch.get_num_threads()

    before = torch.get_num_threads()
    try:
        assert threads_after_build(config) == 1  # a tiny draft is small
        monkeypatch.setattr(draft_server, "SMALL_DRAFT_PARAMETERS", 0)  # as if it were a big model
        assert threads_after_build(config) == 3
        fixed = DraftConfig(kind="model", model=model, cores=3, passive_wait=True)
        assert threads_after_build(fixed) == 1  # a fixed count is left as given
    finally:
        torch.set_num_threads(before)
