"""Training data and loss of the feature-level draft (``draft_service.feature_draft``).

Per sample of ``T`` tokens with the target's features ``f_0 .. f_{T-1}``, the draft reads pairs
(f_i, t_{i+1}) and is taught, at every position:
- to regress the target's next feature f_{i+1} (smooth L1), so later draft steps, which read the
  draft's own predictions, start from something close to the target's;
- the target's argmax there, and its distribution over the head (from f_{i+1} itself).
A second, *rollout* pass feeds the draft's own predicted features back in (as drafting beyond the
first token does) and is taught the same targets, so errors do not compound as fast.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from draft_service.feature_draft import FeatureDraft
from specdec.distill.collect import Sample
from specdec.distill.train import IGNORE, head_labels


@dataclass(frozen=True)
class FeatureExample:
    """One sequence: ``tokens [T]``, target features ``[T, D]`` (fp16), and per position p the target's
    argmax at p in head coordinates (``labels [T]``, IGNORE where unknown) with its loss weight."""

    tokens: torch.Tensor
    features: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor


def make_feature_examples(samples: list[Sample], features: list[torch.Tensor], vocab_to_head: torch.Tensor,
                          max_len: int, prompt_weight: float) -> list[FeatureExample]:
    """Examples from samples and their features; long ones keep their last ``max_len`` tokens."""
    out = []
    for s, f in zip(samples, features):
        if s.generated == 0 or len(s.tokens) < 3:
            continue
        labels, weights = head_labels(s, len(s.tokens), vocab_to_head, prompt_weight)
        tokens = torch.tensor(s.tokens, dtype=torch.long)
        if len(tokens) > max_len:
            tokens, f, labels, weights = tokens[-max_len:], f[-max_len:], labels[-max_len:], weights[-max_len:]
        out.append(FeatureExample(tokens, f, labels, weights))
    return out


@dataclass(frozen=True)
class FeatureBatch:
    """Right-padded examples: ``tokens``/``labels``/``weights`` ``[B, T]``, ``features [B, T, D]``,
    ``valid [B, T]`` (real positions)."""

    tokens: torch.Tensor
    features: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    valid: torch.Tensor


def feature_batcher(examples: list[FeatureExample], batch_tokens: int) -> Callable[[random.Random], list]:
    """Epochs of length-bucketed, right-padded batches of at most ``batch_tokens`` padded tokens."""

    def epoch(rng: random.Random) -> list[FeatureBatch]:
        order = sorted(range(len(examples)), key=lambda i: (len(examples[i].tokens), rng.random()))
        groups, current = [], []
        for i in order:
            if current and len(examples[i].tokens) * (len(current) + 1) > batch_tokens:
                groups.append(current)
                current = []
            current.append(i)
        if current:
            groups.append(current)
        rng.shuffle(groups)
        return [_pad([examples[i] for i in g]) for g in groups]

    return epoch


def _pad(members: list[FeatureExample]) -> FeatureBatch:
    width = max(len(e.tokens) for e in members)
    dim = members[0].features.shape[1]
    b = len(members)
    tokens = torch.zeros((b, width), dtype=torch.long)  # [B, T]
    features = torch.zeros((b, width, dim), dtype=members[0].features.dtype)  # [B, T, D]
    labels = torch.full((b, width), IGNORE, dtype=torch.long)  # [B, T]
    weights = torch.zeros((b, width))  # [B, T]
    valid = torch.zeros((b, width), dtype=torch.bool)  # [B, T]
    for row, e in enumerate(members):
        n = len(e.tokens)
        tokens[row, :n], features[row, :n], labels[row, :n], weights[row, :n] = e.tokens, e.features, e.labels, e.weights
        valid[row, :n] = True
    return FeatureBatch(tokens, features, labels, weights, valid)


def feature_loss(draft: FeatureDraft, batch: FeatureBatch, soft_weight: float = 0.5, rollout_weight: float = 0.5,
                 noise: float = 0.05) -> tuple[torch.Tensor, int, int]:
    """Regression + argmax + distribution loss of one batch, plus the same after one rollout step;
    also (correct top-1 on first-step generated positions, their count)."""
    feats = batch.features.float()  # [B, T, W]: f, then any side layers' outputs
    dim = draft.hidden_size
    inputs = feats[:, :-1]  # f_i, i = 0 .. T-2
    if noise > 0:  # on f only: later steps read the draft's own f, never its own side features
        f = inputs[..., :dim]
        inputs = torch.cat([f + noise * f.std() * torch.randn_like(f), inputs[..., dim:]], dim=-1)
    tokens = batch.tokens[:, 1:]  # t_{i+1}
    truth = feats[:, 1:, :dim]  # f_{i+1}
    labels, weights = batch.labels[:, 1:], batch.weights[:, 1:]  # argmax at i + 1
    valid = batch.valid[:, 1:]
    first = draft.predict(inputs, tokens)  # [B, T-1, D]
    loss, correct, count = _targets_loss(draft, first, truth, labels, weights, valid, soft_weight)
    if rollout_weight > 0 and first.shape[1] > 1:
        # Position i + 1 now reads the draft's own prediction of f_{i+1} (and no side features), as the
        # second draft step does.
        second = draft.predict(first[:, :-1], tokens[:, 1:])  # [B, T-2, D]
        rolled, _, _ = _targets_loss(draft, second, truth[:, 1:], labels[:, 1:], weights[:, 1:], valid[:, 1:],
                                     soft_weight)
        loss = loss + rollout_weight * rolled
    return loss, correct, count


def _targets_loss(draft: FeatureDraft, predicted: torch.Tensor, truth: torch.Tensor, labels: torch.Tensor,
                  weights: torch.Tensor, valid: torch.Tensor, soft_weight: float) -> tuple[torch.Tensor, int, int]:
    reg = nn.functional.smooth_l1_loss(predicted[valid], truth[valid])
    keep = weights > 0  # [B, T]; the head, the costly part, runs on labelled positions only
    logp = torch.log_softmax(draft.head_logits(predicted[keep]), dim=-1)  # [M, N]
    w = weights[keep]
    hard = -(logp.gather(1, labels[keep][:, None])[:, 0] * w).sum() / w.sum().clamp(min=1e-6)
    soft = hard * 0
    if soft_weight > 0 and bool(keep.any()):
        with torch.no_grad():  # the target's own distribution over the head, from its true feature
            teacher = torch.softmax(nn.functional.linear(truth[keep], draft.head_weight), dim=-1)  # [M, N]
        soft = -(teacher * logp).sum(-1).mean()
    generated = w == 1.0
    correct = int((logp.detach().argmax(-1)[generated] == labels[keep][generated]).sum())
    return reg + hard + soft_weight * soft, correct, int(generated.sum())
