"""The verification rule on synthetic distributions, with no model and no network."""

from __future__ import annotations

import torch

from specdec.sampling import (
    Sampling,
    dense_to_sparse,
    draw,
    round_generator,
    sparse_to_dense,
    verify_greedy,
    verify_sampled,
    warp_probs,
)


def _draw_many(p: torch.Tensor, q: torch.Tensor, n: int) -> tuple[torch.Tensor, float]:
    """Runs one-token speculation n times: draft x ~ q, then verify against p."""
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).tolist()
    counts = torch.zeros_like(p)
    accepted = 0
    p2 = torch.stack([p, p])  # [k + 1, V]: the bonus row is unused when we look at the first token
    for i, x in enumerate(drafts):
        verdict = verify_sampled(p2, q.view(1, -1), [x], round_generator(7, i, 2))
        counts[verdict.tokens[0]] += 1
        accepted += verdict.accepted
    return counts / n, accepted / n


def test_lesson_example_matches_target_distribution():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.7, 0.2, 0.1])
    n = 100_000
    freq, acceptance = _draw_many(p, q, n)
    # Binomial standard error is at most 0.5 / sqrt(n) = 0.0016; allow about 4 of them.
    assert torch.allclose(freq, p, atol=0.0065), freq
    assert abs(acceptance - float(torch.minimum(p, q).sum())) < 0.0065


def test_random_distributions_match_target():
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(6, generator=gen) * 2, 0)
    q = torch.softmax(torch.randn(6, generator=gen) * 2, 0)
    freq, acceptance = _draw_many(p, q, 100_000)
    assert torch.allclose(freq, p, atol=0.0065)
    assert abs(acceptance - float(torch.minimum(p, q).sum())) < 0.0065


def test_point_mass_draft_accepts_with_probability_p():
    # The n-gram drafter's q is a point mass: acceptance must be p(x) and output still p.
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.0, 1.0, 0.0])
    freq, acceptance = _draw_many(p, q, 50_000)
    assert torch.allclose(freq, p, atol=0.01)
    assert abs(acceptance - 0.3) < 0.01


def test_all_accepted_draws_bonus_from_last_row():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    verdict = verify_sampled(p, q, [1, 2], round_generator(0, 0, 2))
    assert verdict.accepted == 2 and verdict.tokens == [1, 2, 0]


def test_rejection_never_returns_the_rejected_token():
    p = torch.tensor([[0.1, 0.9], [0.5, 0.5]])
    q = torch.tensor([[1.0, 0.0]])
    for i in range(200):
        verdict = verify_sampled(p, q, [0], round_generator(1, i, 2))
        if verdict.accepted == 0:
            assert verdict.tokens == [1]


def test_greedy_accepts_matching_prefix():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])  # argmax 1, 0, 2
    assert verify_greedy(logits, [1, 0]).tokens == [1, 0, 2]
    assert verify_greedy(logits, [1, 2]).tokens == [1, 0]
    assert verify_greedy(logits, [2, 0]).tokens == [1]
    assert verify_greedy(logits[:1], []).tokens == [1]


def test_seeded_streams_repeat_and_differ():
    a = torch.rand(4, generator=round_generator(5, 3, 1))
    b = torch.rand(4, generator=round_generator(5, 3, 1))
    c = torch.rand(4, generator=round_generator(5, 3, 2))
    d = torch.rand(4, generator=round_generator(5, 4, 1))
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d)


def test_warp_top_k_top_p_temperature():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert torch.allclose(warp_probs(logits, Sampling(1.0)), torch.tensor([[0.4, 0.3, 0.2, 0.1]]), atol=1e-6)
    top2 = warp_probs(logits, Sampling(1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([[0.4 / 0.7, 0.3 / 0.7, 0.0, 0.0]]), atol=1e-6)
    nucleus = warp_probs(logits, Sampling(1.0, top_p=0.75))  # 0.4 + 0.3 < 0.75, so 0.2 joins
    assert torch.allclose(nucleus, torch.tensor([[0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0.0]]), atol=1e-6)
    assert torch.count_nonzero(warp_probs(logits, Sampling(1.0, top_p=0.4))) == 1
    cold = warp_probs(logits, Sampling(0.5))
    expected = torch.tensor([0.16, 0.09, 0.04, 0.01]) / 0.30
    assert torch.allclose(cold, expected.view(1, -1), atol=1e-6)
    assert torch.count_nonzero(warp_probs(logits, Sampling(1.0), extra_top_k=3)) == 3


def test_sparse_round_trip():
    dist = torch.tensor([0.0, 0.25, 0.0, 0.75])
    ids, probs = dense_to_sparse(dist)
    assert ids == [1, 3]
    assert torch.equal(sparse_to_dense(ids, probs, 4), dist)


def test_coupled_draws_follow_p_and_ignore_the_draft():
    """Coupled sampling: each position's token is an exact draw of p, over seeds, and the committed
    tokens are the target's own draws whatever the draft proposed (drafter invariance)."""
    from specdec.sampling import coupled_token, verify_coupled

    # A two-step chain over 4 tokens: p(first), then p(second | first).
    first = torch.tensor([0.5, 0.3, 0.2, 0.0])
    second = torch.tensor([[0.1, 0.6, 0.3, 0.0], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25], [1.0, 0, 0, 0]])
    n, counts = 3000, torch.zeros(4, 4)
    drafts = ([], [1, 1], [2, 3])
    for seed in range(n):
        a = coupled_token(first, seed, 10)
        b = coupled_token(second[a], seed, 11)
        counts[a, b] += 1
        for draft in drafts:  # every draft commits the same two tokens
            rows = [first] + [second[t] for t in draft[:1]] + [second[a]] * 2
            verdict = verify_coupled(torch.stack(rows[: len(draft) + 1]), draft, seed, 10)
            assert verdict.tokens[0] == a
            if len(verdict.tokens) > 1 and verdict.accepted >= 1:
                assert verdict.tokens[1] == b
    expected = first[:, None] * second * n  # [4, 4]
    assert counts[3].sum() == 0  # a token p gives no mass is never drawn
    mask = expected > 0
    chi2 = float((((counts - expected) ** 2)[mask] / expected[mask]).sum())
    assert chi2 < 40.0, chi2  # 11 degrees of freedom: p < 1e-4 at 40


def test_coupled_noise_depends_on_position_not_round():
    from specdec.sampling import coupled_token

    p = torch.full((50,), 1 / 50)
    draws = [coupled_token(p, 3, pos) for pos in range(40)]
    assert draws == [coupled_token(p, 3, pos) for pos in range(40)]  # repeatable
    assert len(set(draws)) > 10  # and fresh at every position


def test_draw_follows_weights_and_never_picks_a_zero_weight():
    # Unnormalized weights with zeros inside and at both ends: each drawn index's frequency matches
    # its share of the total, and a zero-weight index is never drawn.
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5, 0.0])
    gen = torch.Generator().manual_seed(5)
    n = 20000
    counts = torch.bincount(torch.tensor([draw(weights, gen) for _ in range(n)]), minlength=len(weights))
    assert counts[weights == 0].sum() == 0
    share = weights / weights.sum()
    # Binomial standard error at most sqrt(0.25 / 20000) = 0.0035; allow about 3 of them.
    assert torch.allclose(counts / n, share, atol=0.011), counts / n


def test_draw_of_a_point_mass_and_of_a_float32_tail():
    gen = torch.Generator().manual_seed(1)
    assert {draw(torch.tensor([0.0, 0.0, 7.0]), gen) for _ in range(50)} == {2}
    # A vocabulary-sized float32 distribution whose mass sits on its last entries: every draw lands
    # on an entry with mass.
    probs = torch.zeros(49152)
    probs[-3:] = torch.tensor([0.25, 0.5, 0.25])
    assert {draw(probs, gen) for _ in range(300)} <= {49149, 49150, 49151}


def test_a_draw_that_reaches_the_total_takes_the_last_weighted_index(monkeypatch):
    # torch.rand stays below one; were a uniform to reach it, the draw must still land on weight.
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.ones(1, dtype=torch.float64))
    assert draw(torch.tensor([0.0, 2.0, 1.0, 0.0, 0.0]), torch.Generator()) == 2
