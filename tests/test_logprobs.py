"""Logprobs come from the target's own verification pass: the greedy token tops them at every position,
and they are the same whether the tokens were verified one per pass (k = 0), as accepted draft
tokens of a chain, after a rejection, or along a token tree's accepted path."""

from __future__ import annotations

import pytest
import torch

from specdec.models import load_model
from specdec.sampling import Sampling, token_logprobs
from target_service.engine import TargetEngine, VerifyCall

PROMPT = [3, 7, 7, 8, 9]
NEW = 16
TOP = 5


@pytest.fixture(scope="module")
def engine(tiny_dir):
    """The tiny target on the row-invariant kernels the served target runs (``pack``), so a position's
    logits do not depend on how many rows its pass fed."""
    return TargetEngine(load_model(str(tiny_dir / "target"), tiny_dir, pack=True), 8)


def _round(engine, cache_id: str, committed: int, drafts: list[int], parents: tuple[int, ...] = ()):
    call = VerifyCall(cache_id, committed, [], drafts, [], Sampling(), 0, draft_parents=parents, top_logprobs=TOP)
    outcome = engine.verify_batch([call])[0]
    assert not isinstance(outcome, Exception), outcome
    assert outcome.logprobs is not None and [e.token for e in outcome.logprobs] == outcome.tokens
    return outcome


def _target_only(engine) -> tuple[list[int], list]:
    cache_id, committed, _ = engine.prefill(PROMPT)
    tokens, logprobs = [], []
    while len(tokens) < NEW:
        outcome = _round(engine, cache_id, committed, [])
        tokens += outcome.tokens
        logprobs += outcome.logprobs
        committed = outcome.committed
    engine.release(cache_id)
    return tokens, logprobs


def test_the_greedy_token_tops_the_logprobs_and_matches_a_plain_forward(engine, tiny_target):
    tokens, logprobs = _target_only(engine)
    for entry in logprobs:
        assert entry.top[0][0] == entry.token  # greedy: the committed token is the likeliest
        assert len(entry.top) == TOP and entry.top[0][1] == entry.logprob
        assert all(a[1] >= b[1] for a, b in zip(entry.top, entry.top[1:]))
    # The same numbers as a plain full-sequence forward of the model, log-softmaxed.
    with torch.inference_mode():
        logits = tiny_target.model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]  # [NEW, V]
    want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([e.logprob for e in logprobs]), want, atol=1e-4, rtol=0)


def test_logprobs_are_identical_with_speculation_on_and_off(engine):
    tokens, reference = _target_only(engine)
    # k = 3: every round drafts the target's own next tokens, except that the second round's last
    # draft token is wrong, so accepted, recovered and bonus tokens all report.
    cache_id, committed, _ = engine.prefill(PROMPT)
    got: list = []
    rounds = 0
    while len(got) < NEW:
        drafts = tokens[len(got) : len(got) + 3]
        if rounds == 1 and len(drafts) == 3:
            drafts[2] = (drafts[2] + 1) % 32
        outcome = _round(engine, cache_id, committed, drafts)
        got += outcome.logprobs
        committed, rounds = outcome.committed, rounds + 1
    engine.release(cache_id)
    assert rounds < NEW  # draft tokens were accepted
    assert got[:NEW] == reference  # bit for bit: the verify pass is batch-invariant


def test_logprobs_along_a_trees_accepted_path_equal_target_only(engine):
    tokens, reference = _target_only(engine)
    cache_id, committed, _ = engine.prefill(PROMPT)
    # Root children: a wrong token, then the right one; below the right one the next true token.
    wrong = (tokens[0] + 1) % 32
    outcome = _round(engine, cache_id, committed, [wrong, tokens[0], tokens[1]], parents=(-1, -1, 1))
    engine.release(cache_id)
    assert outcome.path == [1, 2] and outcome.tokens == tokens[:3]
    assert outcome.logprobs == reference[:3]


def test_token_logprobs_ranks_ties_as_argmax_picks():
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0]])
    (entry,) = token_logprobs(logits, [2], 3)
    assert [t for t, _ in entry.top] == [1, 2, 0]  # argmax takes the lower index of a tie
    assert entry.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[0, 2]))
    assert token_logprobs(logits, [0], 0)[0].top == ()
