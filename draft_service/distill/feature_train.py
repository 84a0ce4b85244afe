"""Training data and loss of the feature-level draft (``draft_service.feature_draft``).

Per sample of ``T`` tokens with the target's features ``f_0 .. f_{T-1}``, the draft reads pairs
(f_i, t_{i+1}) and is taught, at every position:
- to regress the target's next feature f_{i+1} (smooth L1), so later draft steps, which read the
  draft's own predictions, start from something close to the target's;
- the target's argmax there, and its distribution over the head (from f_{i+1} itself).
A second, *rollout* pass feeds the draft's own predicted features back in (as drafting beyond the
first token does) and is taught the same targets, so errors do not compound as fast. It is built as
the draft service drafts (the "training-time test" of EAGLE-3): the rollout pair at position p
attends to the first pass's keys and values at positions before p, which came from the target's
true features, as a served session's KV cache does, and to its own.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draft_service.distill.collect import Sample
from draft_service.distill.train import IGNORE, head_labels
from draft_service.feature_draft import FeatureDraft
from specdec.ragged import finish_layer, project_qkv, rotary_of


@dataclass(frozen=True)
class FeatureExample:
    """One sequence: ``tokens [T]``, target features ``[T, D]`` (fp16), and per position p the target's
    argmax at p in head coordinates (``labels [T]``, IGNORE where unknown) with its loss weight."""

    tokens: torch.Tensor
    features: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor


def make_feature_examples(
    samples: list[Sample], features: list[torch.Tensor], vocab_to_head: torch.Tensor, max_len: int, prompt_weight: float
) -> list[FeatureExample]:
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
        tokens[row, :n], features[row, :n], labels[row, :n], weights[row, :n] = (
            e.tokens,
            e.features,
            e.labels,
            e.weights,
        )
        valid[row, :n] = True
    return FeatureBatch(tokens, features, labels, weights, valid)


def feature_loss(
    draft: FeatureDraft,
    batch: FeatureBatch,
    soft_weight: float = 0.5,
    rollout_weight: float = 0.5,
    noise: float = 0.05,
    steps: int = 2,
) -> tuple[torch.Tensor, int, int]:
    """Regression + argmax + distribution loss of one batch, plus the same after each rollout step up to
    ``steps`` (step s weighted ``rollout_weight ** s``); also (correct top-1 on first-step generated
    positions, their count)."""
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
    predicted = rollout_steps(draft, inputs, tokens, steps if rollout_weight > 0 else 1)
    keep = weights > 0  # [B, T-1]; the head, the costly part, runs on labelled positions only
    teacher = None
    if soft_weight > 0:
        with torch.no_grad():  # the target's own distribution over the head, from its true feature
            teacher = torch.softmax(nn.functional.linear(truth[keep], draft.head_weight), dim=-1)  # [M, N]
    loss, correct, count = _targets_loss(draft, predicted[0], truth, labels, weights, valid, soft_weight, teacher)
    for step, rolled in enumerate(predicted[1:], start=1):
        later = keep.clone()
        later[:, :step] = False  # step s predicts from position s on: its rows of the same teacher
        step_loss, _, _ = _targets_loss(
            draft,
            rolled,
            truth[:, step:],
            labels[:, step:],
            weights[:, step:],
            valid[:, step:],
            soft_weight,
            None if teacher is None else teacher[later[keep]],
        )
        loss = loss + rollout_weight**step * step_loss
    return loss, correct, count


def rollout_steps(
    draft: FeatureDraft, features: torch.Tensor, tokens: torch.Tensor, steps: int = 2
) -> list[torch.Tensor]:
    """The draft's first ``steps`` draft steps at every position of right-padded pairs.

    ``features [B, T, W]`` and ``tokens [B, T]`` are the pairs (f_i, t_{i+1}). Entry 0 is ``[B, T, D]``,
    the predicted f_{i+1} (``draft.predict`` on the pairs); entry s (``[B, T-s, D]``) predicts f_{i+1+s}
    for the chain started at pair i (row i) from the pair (entry s-1's row i, t_{i+1+s}) at position
    i + s. It attends to the pairs 0..i as the first step fed them (true features, as a served
    session's cache holds them), to the chain's own earlier rollout pairs and to itself: what the
    service's later draft steps compute after a round whose tokens the target all accepted (EAGLE-3's
    training-time test). Fewer entries where T is too short.
    """
    t = tokens.shape[1]
    x = draft._fc(tokens, features)  # [B, T, D]
    positions = torch.arange(t, device=tokens.device).unsqueeze(0)  # [1, T]
    causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()  # [T, T]
    h, kv = _decoder_layer(draft.layer, x, draft.rope(x, positions), causal)
    predicted = [draft.norm(h)]
    keys, values = [kv[0]], [kv[1]]
    for step in range(1, min(steps, t)):
        n = t - step  # chains that still have a true next token
        x = draft._fc(tokens[:, step:], predicted[-1][:, :n])  # [B, n, D]: the draft's own features
        own = torch.eye(n, dtype=torch.bool, device=tokens.device)
        seen = torch.cat([causal[:n, :n]] + [own] * step, dim=1)  # [n, (step + 1) n]
        context = (torch.cat([k[:, :, :n] for k in keys], 2), torch.cat([v[:, :, :n] for v in values], 2))
        h, kv = _decoder_layer(draft.layer, x, draft.rope(x, positions[:, step:]), seen, context)
        predicted.append(draft.norm(h))
        keys.append(kv[0])
        values.append(kv[1])
    return predicted


def _decoder_layer(
    layer,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    context: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """A decoder layer (of the target's family) over ``x [B, T, D]`` under a boolean ``mask [T, C + T]``,
    its own keys and values after ``context``'s (``[B, Hkv, C, hd]`` each); returns (output, its own keys and values).

    The padded-batch, masked counterpart of ``specdec.ragged.ragged_decoder_layer``, which serves a
    ragged block against per-session caches and cannot take keys from another pass."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    b, t, _ = h.shape
    q, k, v = (p.transpose(1, 2) for p in project_qkv(attn, h))  # [B, Hq or Hkv, T, hd]
    q, k = rotary_of(attn)(q, k, *rope)
    keys, values = (k, v) if context is None else (torch.cat([context[0], k], 2), torch.cat([context[1], v], 2))
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
    return finish_layer(layer, x, attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))), (k, v)  # [B, T, D]


def _targets_loss(
    draft: FeatureDraft,
    predicted: torch.Tensor,
    truth: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    valid: torch.Tensor,
    soft_weight: float,
    teacher: torch.Tensor | None,
) -> tuple[torch.Tensor, int, int]:
    """The loss at the labelled positions (``weights > 0``), ``teacher [M, N]`` the target's
    distribution over the head at each of them."""
    reg = nn.functional.smooth_l1_loss(predicted[valid], truth[valid])
    keep = weights > 0  # [B, T]
    logp = torch.log_softmax(draft.head_logits(predicted[keep]), dim=-1)  # [M, N]
    w = weights[keep]
    hard = -(logp.gather(1, labels[keep][:, None])[:, 0] * w).sum() / w.sum().clamp(min=1e-6)
    soft = hard * 0
    if soft_weight > 0 and bool(keep.any()):
        soft = -(teacher * logp).sum(-1).mean()
    generated = w == 1.0
    correct = int((logp.detach().argmax(-1)[generated] == labels[keep][generated]).sum())
    return reg + hard + soft_weight * soft, correct, int(generated.sum())
