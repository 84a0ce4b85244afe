"""The draft's token picker and its confidence cut-off, on synthetic distributions, and the engine's check."""

from __future__ import annotations

import math

import pytest
import torch

from draft_service.engine import NgramDrafter
from draft_service.picking import DRAFT_STREAM, HeadLogits, TokenPicker
from specdec.sampling import Sampling, dense_to_sparse, round_generator, sparse_to_dense, verify_sampled, warp_probs

# A two-token world over three tokens: the target's p and the draft's q for the first token, and for
# the second given the first. The draft's peak after token 1 differs by token (0.6, 0.34, 0.8), so a
# cut-off of 0.2 after a first confidence of 0.4 proposes a second token after 0 and 2 but not after 1.
P1 = torch.tensor([0.5, 0.3, 0.2])
Q1 = torch.tensor([0.4, 0.4, 0.2])
P2 = torch.tensor([[0.2, 0.5, 0.3], [0.3, 0.3, 0.4], [0.1, 0.6, 0.3]])
Q2 = torch.tensor([[0.6, 0.3, 0.1], [0.34, 0.33, 0.33], [0.1, 0.1, 0.8]])
BONUS = torch.full((3,), 1 / 3)


class DrawnTokenCutoff(TokenPicker):
    """The wrong rule: it stops on the probability of the token it drew, not on the distribution."""

    def __call__(self, logits):
        probs = warp_probs(logits, self.sampling)[0]
        if self._generator is None:
            self._generator = round_generator(self.sampling.seed, self.round_index, DRAFT_STREAM)
        token = int(torch.multinomial(probs, 1, generator=self._generator))
        self.confidence *= float(probs[token])
        return (token, dense_to_sparse(probs)) if self.confidence >= self.min_confidence else None


def _joint_of_two_tokens(picker_type: type[TokenPicker], n: int) -> tuple[torch.Tensor, float]:
    """Frequencies ``[3, 3]`` of the first two committed tokens over n sampled rounds (a round that
    commits fewer is completed by target-only draws), and the share of two-token proposals."""
    counts = torch.zeros(3, 3)
    gen = torch.Generator().manual_seed(11)
    two = 0
    for i in range(n):
        pick = picker_type(Sampling(1.0, seed=i), 0, min_confidence=0.2)
        tokens, qs = [], []
        for logits in (Q1.log(), None):
            picked = pick((logits if logits is not None else Q2[tokens[0]].log())[None])
            if picked is None:
                break
            tokens.append(picked[0])
            qs.append(sparse_to_dense(*picked[1], 3))
        two += len(tokens) == 2
        if tokens:
            p_rows = torch.stack([P1, P2[tokens[0]], BONUS][: len(tokens) + 1])
            out = verify_sampled(p_rows, torch.stack(qs), tokens, round_generator(i, 0, 2)).tokens
        else:  # nothing proposed: a target-only step
            out = [int(torch.multinomial(P1, 1, generator=gen))]
        if len(out) < 2:
            out.append(int(torch.multinomial(P2[out[0]], 1, generator=gen)))
        counts[out[0], out[1]] += 1
    return counts / n, two / n


def test_cut_off_proposals_keep_sampling_exact():
    want = P1[:, None] * P2  # [3, 3]
    freq, two = _joint_of_two_tokens(TokenPicker, 8000)
    # The cut-off did act: a second token only after a first token of 0 or 2 (q1 mass 0.6).
    assert abs(two - 0.6) < 0.025
    # A cell's binomial standard error is at most sqrt(0.25 / 8000) = 0.0056; allow about 3.6 of them.
    assert torch.allclose(freq, want, atol=0.02), freq
    # The check has the power to see the wrong rule, which commits 2 then 1 about 0.09 too rarely.
    wrong, _ = _joint_of_two_tokens(DrawnTokenCutoff, 4000)
    assert (wrong - want).abs().max() > 0.05, wrong


def test_greedy_cut_off_multiplies_top_probabilities():
    peaked = torch.tensor([[math.log(1.0), math.log(8.0), math.log(1.0)]])  # argmax 1, top probability 0.8
    pick = TokenPicker(Sampling(), 0, min_confidence=0.3)
    # 0.8, 0.64, 0.51, 0.41, 0.33 pass; 0.26 does not.
    assert [pick(peaked) for _ in range(5)] == [(1, None)] * 5
    assert pick(peaked) is None
    # The first token is never cut: the call is paid for, and an empty one would teach the policy nothing.
    strict = TokenPicker(Sampling(), 0, min_confidence=0.9)
    assert strict(peaked) == (1, None)
    assert strict(peaked) is None
    no_cut_off = TokenPicker(Sampling(), 0)
    assert [no_cut_off(peaked) for _ in range(40)] == [(1, None)] * 40


def test_a_cut_off_outside_zero_to_one_is_refused(tiny_target):
    """The engine's check, which the draft service turns into INVALID_ARGUMENT."""
    drafter = NgramDrafter(tiny_target.facts("ngram"), 4, 3, 1)
    cache_id, committed = drafter.prefill([5, 6, 7, 5, 6])
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="min_confidence"):
            drafter.propose(cache_id, committed, [], 2, Sampling(), 0, min_confidence=bad)
    assert drafter.propose(cache_id, committed, [], 2, Sampling(), 0, min_confidence=1.0).tokens == [7, 5]


def _head(vocab: int = 40, size: int = 12, seed: int = 0) -> HeadLogits:
    """A reduced head over ``size`` ids of a ``vocab``-token vocabulary (in increasing order, as the
    draft hands them to a pick), whose top logit is tied between two of them."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=gen)[:size].sort().values
    logits = torch.randn(1, size, generator=gen)
    top = int(logits.argmax())
    logits[0, (top + 3) % size] = logits[0, top]
    return HeadLogits(logits, ids, vocab)


@pytest.mark.parametrize("seed", range(5))
def test_a_head_row_picks_the_greedy_tokens_of_its_full_row(seed):
    head = _head(seed=seed)
    # The tie goes to the lower id, as the full row's argmax gives it.
    assert head.argmax() == int(head.full()[0].argmax())
    for cutoff in (0.0, 0.05, 0.3):
        # Picks from one picker run on until the product of top probabilities falls below the cut-off.
        from_head, from_full = (TokenPicker(Sampling(), 0, min_confidence=cutoff) for _ in range(2))
        picks = [(from_head(head), from_full(head.full())) for _ in range(6)]
        assert all(a == b for a, b in picks), picks
        if cutoff:
            assert picks[0][0] is not None and picks[-1][0] is None  # the first is kept, the cut-off acts


@pytest.mark.parametrize("sampling", [Sampling(0.8), Sampling(0.8, top_k=5), Sampling(1.3, top_p=0.8)])
def test_a_head_row_draws_from_the_q_of_its_full_row(sampling):
    head = _head(seed=7)
    picker = TokenPicker(sampling, 0, sample_top_k=8)
    token, (ids, probs) = picker(head)
    want_ids, want_probs = TokenPicker(sampling, 0, sample_top_k=8)(head.full())[1]
    assert ids == want_ids and probs == pytest.approx(want_probs, abs=1e-6)
    assert token in ids
    # The drawn tokens follow that q: every one in its support, each at its rate (standard error at
    # most sqrt(0.25 / 6000) = 0.0065; allow about 3.5 of them).
    n = 6000
    counts = torch.zeros(head.vocab)
    for i in range(n):
        counts[TokenPicker(sampling, i, sample_top_k=8)(head)[0]] += 1
    q = sparse_to_dense(want_ids, want_probs, head.vocab)
    assert counts[q == 0].sum() == 0
    assert torch.allclose(counts / n, q, atol=0.023), (counts / n, q)
    # With the same draft stream, the same token as the full row's pick.
    for i in range(200):
        head_pick = TokenPicker(sampling, i, sample_top_k=8)(head)[0]
        assert head_pick == TokenPicker(sampling, i, sample_top_k=8)(head.full())[0]


def test_a_penalised_or_coupled_pick_reads_the_full_row():
    head = _head(seed=2)
    for sampling in (Sampling(0.8, seed=3, coupled=True), Sampling(0.8, presence_penalty=1.5)):
        picker = TokenPicker(sampling, 0, position=10)
        picker._picked.append(int(head.ids[0]))  # a token the penalty counts
        full = TokenPicker(sampling, 0, position=10)
        full._picked.append(int(head.ids[0]))
        assert picker(head) == full(head.full())


def test_drafting_ahead_may_cut_before_its_first_token():
    """Drafting ahead asks for tokens no round's plan chose to draft: its cut-off acts from the first."""
    peaked = torch.tensor([[math.log(1.0), math.log(8.0), math.log(1.0)]])  # top probability 0.8
    assert TokenPicker(Sampling(), 0, min_confidence=0.9, cut_first=True)(peaked) is None
    assert TokenPicker(Sampling(), 0, min_confidence=0.9)(peaked) == (1, None)
