"""Penalties and logit bias keep speculation exact: the committed tokens follow the *penalised* target.

The draft side runs the draft service's own pickers (``TokenPicker``, ``TreeGrower``) and the target
side the target engine's own verdict (``TargetEngine._verdict``), on synthetic logits that depend on
the whole prefix, over a 4-token vocabulary. Each test compares the joint distribution of the first
three tokens a turn commits with the penalised target's, enumerated exactly with a plain-Python
reference of the penalties (chi-square, p = 0.001). The broken variants are the same code with one
side's transform patched out; each must fail the same test by a wide margin.

Why "penalise only p" is not among the failing variants: the rejection rule min(1, p/q) with the
residual max(p - q, 0) returns exactly p for *any* q the draft truly drew from, so a draft that
ignores the penalties costs acceptance, never exactness. The test below shows both halves. What does
break exactness is a target whose p is not the penalised one: "penalise only q" (or "bias only q"),
or a target that penalises each row by the committed tokens alone, forgetting the draft tokens
before it on its path.
"""

from __future__ import annotations

import math

import pytest
import torch
from synthetic_rounds import chi_square, engine_verdict, exact_joint, prefix_logits

import draft_service.picking as picking
import target_service.engine as target_engine
from draft_service.picking import TokenPicker
from draft_service.tree_draft import TreeGrower
from specdec.sampling import Sampling, chain_paths, penalize_logits, warp_probs
from specdec.trees import TreeShape, node_paths
from target_service.engine import SparseQ, VerifyCall

VOCAB = 4
POSITIONS = 2
# The session so far: prompt [0, 3] then output [2, 2] (output_start 2).
COMMITTED = (0, 3, 2, 2)
OUTPUT_START = 2
TRIALS = 1000

PENALISED = Sampling(
    temperature=0.9, seed=11, presence_penalty=1.0, frequency_penalty=1.2, repetition_penalty=1.3, output_start=2
)
BIASED = Sampling(temperature=1.0, seed=12, logit_bias=((1, 2.0), (3, -1.5)), output_start=2)


def _target(prefix: tuple[int, ...]) -> torch.Tensor:
    return prefix_logits(prefix, 1, VOCAB)


def _draft(prefix: tuple[int, ...]) -> torch.Tensor:
    return prefix_logits(prefix, 2, VOCAB)


def _reference_probs(logits: list[float], generated: tuple[int, ...], s: Sampling) -> list[float]:
    """The penalised target's distribution after ``COMMITTED + generated``, written out plainly."""
    out = list(logits)
    for token, bias in s.logit_bias:
        out[token] += bias
    prompt, output = COMMITTED[: s.output_start], [*COMMITTED[s.output_start :], *generated]
    for t in range(VOCAB):
        if s.repetition_penalty != 1.0 and (t in prompt or t in output):
            out[t] = out[t] / s.repetition_penalty if out[t] > 0 else out[t] * s.repetition_penalty
        count = output.count(t)
        out[t] -= s.frequency_penalty * count + s.presence_penalty * (count > 0)
    exps = [math.exp(x / s.temperature) for x in out]
    return [e / sum(exps) for e in exps]


def _expected_joint(s: Sampling) -> torch.Tensor:
    """``[V] * POSITIONS``: the penalised target's joint distribution of its first tokens."""
    return exact_joint(lambda prefix: _reference_probs(_target(prefix).tolist(), prefix, s), VOCAB, POSITIONS)


def _chain_round(s: Sampling, trial: int, k: int = 2, draft=_draft) -> list[int]:
    """One sampled round over a chain of ``k``: the draft's picker proposes (from ``draft``'s logits),
    the engine verifies."""
    committed = list(COMMITTED)
    pick = TokenPicker(s, trial, committed=committed, position=len(committed))
    tokens: list[int] = []
    qs: list[SparseQ] = []
    for _ in range(k):
        token, q = pick(draft(tuple(tokens))[None])
        tokens.append(token)
        qs.append(SparseQ(*q))
    logits = torch.stack([_target(tuple(tokens[:i])) for i in range(k + 1)])  # [k + 1, V]
    call = VerifyCall("s", len(committed), [], tokens, qs, s, trial)
    return engine_verdict(call, logits, committed).tokens


def _tree_round(s: Sampling, trial: int) -> list[int]:
    """One sampled round over a tree (2 siblings a level, 2 levels): the draft's tree grower proposes,
    the engine verifies it with its tree rule."""
    committed = list(COMMITTED)
    grower = TreeGrower(TreeShape(4, 2, 2), s, trial, len(committed), committed=committed)
    grower.grow(-1, _draft(()))
    while frontier := grower.frontier():
        grower.grow(frontier[0], _draft(tuple(grower.path_tokens(frontier[0]))))
    tokens, parents, qs = grower.result()
    logits = torch.stack([_target(tuple(path)) for path in node_paths(tokens, parents)])  # [n + 1, V]
    call = VerifyCall("s", len(committed), [], tokens, [SparseQ(*q) for q in qs], s, trial, draft_parents=parents)
    return engine_verdict(call, logits, committed).tokens


def _committed_joint(s: Sampling, round_fn) -> tuple[torch.Tensor, float]:
    """Counts ``[V] * POSITIONS`` of the first tokens committed over ``TRIALS`` turns (a round, then
    exact target-only draws where it committed fewer) and the mean tokens the round committed."""
    counts = torch.zeros((VOCAB,) * POSITIONS)
    g = torch.Generator().manual_seed(5)
    committed_per_round = 0
    for trial in range(TRIALS):
        out = round_fn(s, trial)
        committed_per_round += len(out)
        out = out[:POSITIONS]
        while len(out) < POSITIONS:
            row = penalize_logits(_target(tuple(out))[None], s, [*COMMITTED, *out])
            out.append(int(torch.multinomial(warp_probs(row, s)[0], 1, generator=g)))
        counts[tuple(out)] += 1
    return counts, committed_per_round / TRIALS


def _chi2(counts: torch.Tensor, s: Sampling) -> tuple[float, float, float]:
    """Chi-square of ``counts`` against the expected joint, its bound, and the count of impossible cells."""
    return chi_square(counts, _expected_joint(s))


def _identity(logits, *_args, **_kwargs):
    return logits


def _counts_committed_only(logits, sampling, committed, paths=None):
    """A target that penalises every row by the committed tokens alone (the broken rule)."""
    return penalize_logits(logits, sampling, committed, None)


def test_penalize_logits_matches_the_plain_reference():
    """Bias, repetition, frequency and presence penalties, row by row along a chain's paths."""
    s = Sampling(
        presence_penalty=0.5, frequency_penalty=-0.3, repetition_penalty=1.7, logit_bias=((0, 3.0),), output_start=2
    )
    logits = torch.tensor([[1.0, -2.0, 0.5, 2.0], [0.0, 1.0, -1.0, 3.0], [-0.5, 0.25, 4.0, -3.0]])
    draft = [3, 3]
    got = penalize_logits(logits, s, COMMITTED, chain_paths(draft))
    for i, row in enumerate(logits.tolist()):
        want = torch.tensor(_reference_probs(row, tuple(draft[:i]), Sampling(**{**s.__dict__, "temperature": 1.0})))
        torch.testing.assert_close(torch.softmax(got[i], -1), want.float())
    # Hand-checked: row 0 follows output [2, 2], prompt [0, 3]. Token 3 (prompt only): 2.0 / 1.7;
    # token 2 (twice in the output): 0.5 / 1.7 + 0.3 * 2 - 0.5; token 0: (1 + 3) / 1.7; token 1 untouched.
    torch.testing.assert_close(got[0], torch.tensor([4 / 1.7, -2.0, 0.5 / 1.7 + 0.6 - 0.5, 2 / 1.7]))
    assert penalize_logits(logits, Sampling(), COMMITTED) is logits  # neutral settings: untouched


@pytest.mark.parametrize("round_fn", [_chain_round, _tree_round], ids=["chain", "tree"])
@pytest.mark.parametrize("s", [PENALISED, BIASED], ids=["penalties", "logit_bias"])
def test_speculation_follows_the_penalised_target(s, round_fn):
    counts, per_round = _committed_joint(s, round_fn)
    chi2, bound, _ = _chi2(counts, s)
    assert chi2 < bound, f"chi2={chi2:.1f} > {bound:.1f}"
    assert per_round > 1.2  # draft tokens were accepted: the rule's both branches ran


@pytest.mark.parametrize(
    "s,broken",
    [
        (PENALISED, "only q"),
        (PENALISED, "committed only"),
        (BIASED, "only q"),
    ],
    ids=["penalise-only-q", "target-forgets-draft-path", "bias-only-q"],
)
@pytest.mark.parametrize("round_fn", [_chain_round, _tree_round], ids=["chain", "tree"])
def test_a_target_that_is_not_penalised_per_path_fails_the_same_test(monkeypatch, s, broken, round_fn):
    patch = _identity if broken == "only q" else _counts_committed_only
    monkeypatch.setattr(target_engine, "penalize_logits", patch)
    counts, _ = _committed_joint(s, round_fn)
    chi2, bound, _ = _chi2(counts, s)
    assert chi2 > 3 * bound, f"chi2={chi2:.1f} passes {bound:.1f}: the test cannot see this bug"


def _self_draft_round(s: Sampling, trial: int) -> list[int]:
    """A chain round whose draft computes the target's own logits."""
    return _chain_round(s, trial, draft=_target)


@pytest.mark.parametrize("s", [PENALISED, BIASED], ids=["penalties", "logit_bias"])
def test_a_draft_that_ignores_penalties_costs_acceptance_not_exactness(monkeypatch, s):
    """Penalise (or bias) only p: still the penalised target's output, since q is what the draft drew
    from; but a draft equal to the target no longer has every token accepted, as it has when its q
    is transformed like p."""
    _, both = _committed_joint(s, _self_draft_round)
    assert both == 3  # q == p: both draft tokens and the bonus, every round
    monkeypatch.setattr(picking, "penalize_logits", _identity)
    counts, only_p = _committed_joint(s, _self_draft_round)
    chi2, bound, _ = _chi2(counts, s)
    assert chi2 < bound, f"chi2={chi2:.1f} > {bound:.1f}"
    assert only_p < both - 0.3, (only_p, both)
