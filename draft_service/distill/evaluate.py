"""Held-out figures of a draft along the target's own greedy trajectories.

- *Top-1 agreement*: how often the draft's argmax equals the target's next token, teacher-forced on
  the target's greedy continuation (a target token outside the draft's head counts as a miss).
- *Greedy speculative rounds at k*: from the end of the prompt, the draft proposes k tokens, the
  leading ones equal to the target's are accepted, and the round commits accepted + 1 tokens (the
  +1 is the target's recovered or bonus token). Under greedy decoding, draft token i + 1 only
  matters when tokens 1..i were accepted, that is when they equal the target's; so it is the
  draft's argmax after the target's own prefix, the teacher-forced prediction. Rounds therefore
  follow exactly from the teacher-forced matches, with no draft cache replay. Only full rounds
  (k + 1 reference tokens left) are counted.
- *Acceptance by position* i (1..k): the share of rounds whose first i draft tokens were all
  accepted (as ``specdec bench`` reports it); *conditional* acceptance divides by the rounds that
  reached position i. *Mean accepted length* counts tokens committed per round, bonus included.

Each reference is scored once into a ``Tally``; the figures of any group of references (all of them,
or one prompt category) are summed from their tallies, so figures by category cost no second pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from draft_service.distill.collect import Sample
from draft_service.feature_draft import FeatureDraft, FeatureSession
from draft_service.token_draft import TokenDraft
from specdec.kvcache import SessionCache
from specdec.ngram import whole_continuation


@torch.inference_mode()
def teacher_forced_matches(draft: TokenDraft, sample: Sample) -> torch.Tensor:
    """``[C]`` booleans: whether the draft's argmax before continuation token i equals that token."""
    tokens = torch.tensor([sample.tokens[:-1]], dtype=torch.long)  # [1, T]
    start = sample.prompt_len - 1
    hidden = draft.hidden(tokens)[0, start:]  # [C, D]
    guess = draft.head_ids[draft.head_logits(hidden).argmax(-1)]  # [C] full-vocabulary ids
    return guess == torch.tensor(sample.tokens[sample.prompt_len :], dtype=torch.long)


def rounds_from_matches(matches: list[bool], k: int) -> list[int]:
    """Accepted counts of the greedy rounds at ``k`` over one continuation's teacher-forced matches."""
    accepted_counts = []
    pos = 0  # continuation tokens committed so far
    while pos + k < len(matches):  # k proposals and the bonus token all lie in the continuation
        accepted = 0
        while accepted < k and matches[pos + accepted]:
            accepted += 1
        accepted_counts.append(accepted)
        pos += accepted + 1
    return accepted_counts


@dataclass(frozen=True)
class Tally:
    """One reference's score: teacher-forced matches out of its positions, and its rounds' accepted counts."""

    correct: int
    positions: int
    rounds: tuple[int, ...]


def token_tallies(draft: TokenDraft, references: list[Sample], k: int = 4) -> list[Tally]:
    """Each greedy reference's ``Tally`` under a token draft (in order)."""
    draft.eval()
    out = []
    for sample in references:
        if sample.generated == 0:
            out.append(Tally(0, 0, ()))
            continue
        matches = teacher_forced_matches(draft, sample)
        out.append(Tally(int(matches.sum()), len(matches), tuple(rounds_from_matches(matches.tolist(), k))))
    return out


def evaluate(draft: TokenDraft, references: list[Sample], k: int = 4) -> dict:
    """Top-1 agreement and greedy round statistics at ``k`` over greedy ``references``."""
    return summarise(token_tallies(draft, references, k), k)


def summarise(tallies: list[Tally], k: int) -> dict:
    """The figures of a group of references from their tallies (``_summary``)."""
    rounds = [a for t in tallies for a in t.rounds]
    return _summary(sum(t.correct for t in tallies), sum(t.positions for t in tallies), rounds, len(tallies), k)


def summarise_by_category(tallies: list[Tally], categories: list[str], k: int) -> dict[str, dict]:
    """The figures of each category's references (``categories[i]`` is reference i's), by name."""
    groups: dict[str, list[Tally]] = {}
    for tally, category in zip(tallies, categories, strict=True):
        groups.setdefault(category, []).append(tally)
    return {category: summarise(groups[category], k) for category in sorted(groups)}


@torch.inference_mode()
def ms_per_step(model, context: list[int], steps: int = 64) -> float:
    """Median milliseconds of one cached one-token draft step (as ``ModelDrafter`` takes it)."""
    cache = SessionCache(committed=list(context))
    cache.prefill(model)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        logits = cache.forward(model, [], logits_to_keep=1)  # [1, V]
        token = int(logits[0].argmax())
        times.append(time.perf_counter() - started)
        cache.sync(len(cache.committed), [token])
        if len(cache.committed) > len(context) + 32:
            cache.sync(len(context), [])
    times.sort()
    return round(1000 * times[len(times) // 2], 3)


def _summary(correct: int, total: int, rounds: list[int], sequences: int, k: int) -> dict:
    reached = [sum(1 for a in rounds if a >= i) for i in range(k + 1)]  # reached[i]: rounds with >= i accepted
    n = max(1, len(rounds))
    return {
        "top1_agreement": round(correct / max(1, total), 4),
        "positions": total,
        "sequences": sequences,
        "k": k,
        "rounds": len(rounds),
        "acceptance_by_position": [round(reached[i] / n, 4) for i in range(1, k + 1)],
        "conditional_acceptance_by_position": [round(reached[i] / max(1, reached[i - 1]), 4) for i in range(1, k + 1)],
        "mean_accepted_length": round(sum(a + 1 for a in rounds) / n, 4),
    }


def evaluate_feature(
    draft: FeatureDraft, references: list[Sample], features: list[torch.Tensor], k: int = 4, lookup_min: int = 0
) -> dict:
    """Top-1 agreement and greedy rounds at ``k`` of a feature draft (``feature_tallies``)."""
    return summarise(feature_tallies(draft, references, features, k, lookup_min), k)


@torch.inference_mode()
def feature_tallies(
    draft: FeatureDraft, references: list[Sample], features: list[torch.Tensor], k: int = 4, lookup_min: int = 0
) -> list[Tally]:
    """Each reference's ``Tally``: top-1 agreement (teacher-forced on the target's features) and greedy rounds at ``k``.

    A feature draft's later proposals read its own predicted features, so rounds cannot be derived
    from teacher-forced matches: they are replayed through ``FeatureSession`` exactly as the draft
    service runs them, with the target's features arriving for committed tokens only. With
    ``lookup_min`` > 0 each round first tries prompt lookup, as the draft service serves the draft
    (``whole_continuation``); top-1 agreement is the model's alone either way.
    """
    draft.eval()
    out = []
    for sample, feats in zip(references, features):
        if sample.generated == 0:
            out.append(Tally(0, 0, ()))
            continue
        tokens = torch.tensor([sample.tokens])  # [1, T]
        predicted = draft.predict(feats[None, :-1].float(), tokens[:, 1:])  # [1, T-1, D]: f_{i+1} for i < T-1
        guess = draft.head_ids[draft.head_logits(predicted[0, sample.prompt_len - 2 : -1]).argmax(-1)]  # [C]
        matches = guess == tokens[0, sample.prompt_len :]
        out.append(Tally(int(matches.sum()), len(matches), tuple(replay_rounds(draft, sample, feats, k, lookup_min))))
    return out


def replay_rounds(draft: FeatureDraft, sample: Sample, feats: torch.Tensor, k: int, lookup_min: int = 0) -> list[int]:
    """Accepted counts of greedy rounds at ``k`` along one reference, drafted as the service drafts
    (prompt lookup first when ``lookup_min`` > 0)."""
    session = FeatureSession(committed=list(sample.tokens[: sample.prompt_len]))
    session.add_features(0, feats[: sample.prompt_len - 1].float())
    greedy = lambda logits: (int(logits[0].argmax()), None)  # noqa: E731
    out = []
    while len(session.committed) + k < len(sample.tokens):
        n = len(session.committed)
        proposal = whole_continuation(session.committed, k, min_n=lookup_min) or session.propose(draft, k, greedy)[0]
        reference = sample.tokens[n : n + k + 1]
        accepted = 0
        while accepted < k and proposal[accepted] == reference[accepted]:
            accepted += 1
        out.append(accepted)
        session.sync(n, reference[: accepted + 1])
        session.add_features(n - 1, feats[n - 1 : n + accepted].float())
    return out
