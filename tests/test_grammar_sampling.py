"""A grammar keeps sampled speculation exact: the committed tokens follow the *constrained* target.

As ``tests/test_penalties.py`` does for penalties: the draft side runs the draft service's own
pickers (``TokenPicker``, ``TreeGrower``, each given a fork of the session's grammar state) and the
target side the target engine's own verdict (``TargetEngine._verdict`` with the grammar), on
synthetic logits that depend on the whole prefix, over a 4-token vocabulary (an end token and
"a", "b", "c") under the regex ``(a|b)(b|c)(a|c)+``. Each test compares the joint distribution of
the first three tokens a turn commits with the constrained target's, enumerated exactly (chi-square,
p = 0.001), and checks that no committed prefix breaks the grammar.

The broken variants are genuinely inexact: a target that verifies against its unmasked p (the
output is then the unconstrained target's), and a draft that samples from its masked q but reports
the unmasked q (the rule min(1, p/q) then divides by the wrong q). Each must fail by a wide margin.
A draft that does not mask at all stays exact (q is what it drew from) and only loses acceptance.
"""

from __future__ import annotations

import math

import pytest
import torch
from synthetic_rounds import chi_square, engine_verdict, exact_joint, prefix_logits

import target_service.engine as target_engine
from draft_service.picking import TokenPicker
from draft_service.tree_draft import TreeGrower
from specdec.constrain import mask_logits
from specdec.grammar import GrammarCompiler, GrammarMatcher, ResponseFormat
from specdec.sampling import Sampling, dense_to_sparse, penalize_logits, warp_probs
from specdec.trees import TreeShape, node_paths
from target_service.engine import SparseQ, VerifyCall

TOKENS = [b"<eos>", b"a", b"b", b"c"]
VOCAB = len(TOKENS)
PATTERN = "(a|b)(b|c)(a|c)+"
POSITIONS = 3
COMMITTED = (1, 3)  # the prompt; the output (and the grammar) starts after it
TRIALS = 1000
FORMAT = ResponseFormat("regex", pattern=PATTERN).key()
SAMPLED = Sampling(temperature=0.9, seed=21, response_format=FORMAT, output_start=len(COMMITTED))
PENALISED = Sampling(
    temperature=1.0, seed=22, presence_penalty=1.5, logit_bias=((3, 1.0),), response_format=FORMAT, output_start=2
)
# Legal tokens at output positions 0, 1, 2 (and on): the regex's character classes.
LEGAL = [{1, 2}, {2, 3}, {1, 3}]


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler.from_token_bytes(TOKENS, [0])


def _target(prefix: tuple[int, ...]) -> torch.Tensor:
    return prefix_logits(prefix, 1, VOCAB)


def _draft(prefix: tuple[int, ...]) -> torch.Tensor:
    return prefix_logits(prefix, 2, VOCAB)


def _reference_probs(logits: list[float], generated: tuple[int, ...], s: Sampling) -> list[float]:
    """The constrained target's distribution after ``COMMITTED + generated``, written out plainly:
    bias and presence penalty, then the regex's class at the position, then temperature."""
    out = list(logits)
    for token, bias in s.logit_bias:
        out[token] += bias
    for t in range(VOCAB):
        out[t] -= s.presence_penalty * (t in generated)
    legal = LEGAL[min(len(generated), 2)]
    exps = [math.exp(x / s.temperature) if t in legal else 0.0 for t, x in enumerate(out)]
    return [e / sum(exps) for e in exps]


def _expected_joint(s: Sampling) -> torch.Tensor:
    """``[V] * POSITIONS``: the constrained target's joint distribution of its first tokens."""
    return exact_joint(lambda prefix: _reference_probs(_target(prefix).tolist(), prefix, s), VOCAB, POSITIONS)


class _ReportsUnmaskedQ(TokenPicker):
    """Broken: draws from the masked q, as a constrained draft should, but reports the unmasked q."""

    def __call__(self, logits):
        penalised = penalize_logits(logits, self.sampling, self.committed, [self._picked])
        picked = super().__call__(logits)
        assert picked is not None
        return picked[0], dense_to_sparse(warp_probs(penalised, self.sampling)[0])


def _chain_round(s: Sampling, trial: int, grammar: GrammarMatcher, picker=TokenPicker, draft_mask=True) -> list[int]:
    """One sampled round over a chain of 2: the draft's picker proposes, the engine verifies."""
    committed = list(COMMITTED)
    pick = picker(
        s, trial, committed=committed, position=len(committed), grammar=grammar.fork() if draft_mask else None
    )
    tokens: list[int] = []
    qs: list[SparseQ] = []
    for _ in range(2):
        token, q = pick(_draft(tuple(tokens))[None])
        tokens.append(token)
        qs.append(SparseQ(*q))
    logits = torch.stack([_target(tuple(tokens[:i])) for i in range(3)])  # [k + 1, V]
    call = VerifyCall("s", len(committed), [], tokens, qs, s, trial)
    return engine_verdict(call, logits, list(COMMITTED), grammar).tokens


def _tree_round(s: Sampling, trial: int, grammar: GrammarMatcher) -> list[int]:
    """One sampled round over a tree (2 siblings a level, 2 levels) grown under the grammar."""
    committed = list(COMMITTED)
    grower = TreeGrower(TreeShape(4, 2, 2), s, trial, len(committed), committed=committed, grammar=grammar.fork())
    grower.grow(-1, _draft(()))
    while frontier := grower.frontier():
        grower.grow(frontier[0], _draft(tuple(grower.path_tokens(frontier[0]))))
    tokens, parents, qs = grower.result()
    logits = torch.stack([_target(tuple(path)) for path in node_paths(tokens, parents)])  # [n + 1, V]
    call = VerifyCall("s", len(committed), [], tokens, [SparseQ(*q) for q in qs], s, trial, draft_parents=parents)
    return engine_verdict(call, logits, list(COMMITTED), grammar).tokens


def _committed_joint(
    s: Sampling, compiler: GrammarCompiler, round_fn, trials: int = TRIALS
) -> tuple[torch.Tensor, float]:
    """Counts ``[V] * POSITIONS`` of the first tokens committed over ``trials`` turns (a round, then
    exact constrained target-only draws where it committed fewer) and the mean tokens per round."""
    counts = torch.zeros((VOCAB,) * POSITIONS)
    g = torch.Generator().manual_seed(5)
    fresh = compiler.matcher(ResponseFormat.from_key(FORMAT))
    per_round = 0
    for trial in range(trials):
        out = round_fn(s, trial, fresh)[:POSITIONS]
        per_round += len(out)
        state = fresh.fork()
        for t in out:
            if state.is_allowed(t):
                state.advance(t)
        while len(out) < POSITIONS:
            row = penalize_logits(_target(tuple(out))[None], s, [*COMMITTED, *out])
            row = mask_logits(row, state.allowed()[None])
            out.append(int(torch.multinomial(warp_probs(row, s)[0], 1, generator=g)))
            state.advance(out[-1])
        counts[tuple(out)] += 1
    return counts, per_round / trials


def _chi2(counts: torch.Tensor, s: Sampling) -> tuple[float, float, float]:
    """Chi-square of ``counts`` against the expected joint, its bound, and the count of impossible cells."""
    return chi_square(counts, _expected_joint(s))


def _unmasked(logits, _masks):
    return logits


@pytest.mark.parametrize("round_fn", [_chain_round, _tree_round], ids=["chain", "tree"])
@pytest.mark.parametrize("s", [SAMPLED, PENALISED], ids=["sampled", "penalised"])
def test_speculation_follows_the_constrained_target(compiler, s, round_fn):
    counts, per_round = _committed_joint(s, compiler, round_fn)
    chi2, bound, illegal = _chi2(counts, s)
    assert illegal == 0
    assert chi2 < bound, f"chi2={chi2:.1f} > {bound:.1f}"
    assert per_round > 1.2  # draft tokens were accepted: the rule's both branches ran


@pytest.mark.parametrize("round_fn", [_chain_round, _tree_round], ids=["chain", "tree"])
def test_a_target_that_verifies_the_unmasked_p_fails_the_same_test(monkeypatch, compiler, round_fn):
    monkeypatch.setattr(target_engine, "mask_logits", _unmasked)
    counts, _ = _committed_joint(SAMPLED, compiler, round_fn)
    chi2, bound, illegal = _chi2(counts, SAMPLED)
    assert illegal > 0 or chi2 > 3 * bound, f"chi2={chi2:.1f} passes {bound:.1f}: the test cannot see this bug"


def test_a_draft_that_reports_its_unmasked_q_fails_the_same_test(compiler):
    def broken(s, trial, grammar):
        return _chain_round(s, trial, grammar, picker=_ReportsUnmaskedQ)

    # This bug skews the joint less than the target's: three times the turns give the test its margin.
    counts, _ = _committed_joint(SAMPLED, compiler, broken, trials=3 * TRIALS)
    chi2, bound, _ = _chi2(counts, SAMPLED)
    assert chi2 > 3 * bound, f"chi2={chi2:.1f} passes {bound:.1f}: the test cannot see this bug"


def test_a_draft_that_does_not_mask_costs_acceptance_not_exactness(compiler):
    """Unmasked proposals (as prompt lookup makes) are still exact: q is what was drawn from, and the
    target's masked p rejects every illegal token; but fewer draft tokens are accepted."""
    masked = _committed_joint(SAMPLED, compiler, _chain_round)[1]

    def unmasked(s, trial, grammar):
        return _chain_round(s, trial, grammar, draft_mask=False)

    counts, per_round = _committed_joint(SAMPLED, compiler, unmasked)
    chi2, bound, illegal = _chi2(counts, SAMPLED)
    assert illegal == 0
    assert chi2 < bound, f"chi2={chi2:.1f} > {bound:.1f}"
    assert per_round < masked - 0.2, (per_round, masked)
