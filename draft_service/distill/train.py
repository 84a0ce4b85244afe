"""Training a token draft on the target's own continuations, with resumable checkpoints.

Loss: cross-entropy of the draft's reduced-vocabulary logits against the target's argmax at every
generated position (positions whose target token lies outside the head are skipped; they count as
misses in evaluation). The embedding and the head rows stay frozen (they are the target's).
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draft_service.distill.collect import Sample
from draft_service.distill.placement import Placement, to_device
from draft_service.distill.progress import Progress
from draft_service.token_draft import TokenDraft

IGNORE = -100


def top_tokens(samples: list[Sample], n: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The ``n`` most frequent target tokens (labels and continuations), ``always`` first; ties by id."""
    counts: Counter[int] = Counter()
    for s in samples:
        counts.update(s.labels)
        counts.update(s.tokens[s.prompt_len :])
    ranked = [t for t in always] + [
        t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t not in always
    ]
    return torch.tensor(ranked[:n], dtype=torch.long)


@dataclass(frozen=True)
class Example:
    """One training sequence: draft inputs and what the draft should predict after each of them.

    ``targets[t]`` is the target's argmax in head coordinates (IGNORE where none or outside the
    head), ``weights[t]`` its loss weight, and ``soft_ids`` / ``soft_logits`` ``[T, K]`` the target's
    top-K logits in head coordinates (-1 where absent) for distillation on its distribution.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor
    soft_ids: torch.Tensor
    soft_logits: torch.Tensor


def head_labels(
    s: Sample, length: int, vocab_to_head: torch.Tensor, prompt_weight: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's argmax at positions ``0 .. length - 1`` in head coordinates (IGNORE where unknown
    or outside the head) and their loss weights: 1 on generated positions, ``prompt_weight`` on
    prompt positions (where the prompt's argmax was collected), 0 elsewhere."""
    start = s.prompt_len - 1
    argmax = torch.full((length,), IGNORE, dtype=torch.long)
    weights = torch.zeros(length)
    argmax[start : start + len(s.labels)] = torch.tensor(s.labels, dtype=torch.long)
    weights[start : start + len(s.labels)] = 1.0
    if prompt_weight > 0 and s.prompt_labels:
        argmax[:start] = torch.tensor(s.prompt_labels[:start], dtype=torch.long)
        weights[:start] = prompt_weight
    head = torch.where(argmax >= 0, vocab_to_head[argmax.clamp(min=0)], -1)
    labels = torch.where(head >= 0, head, IGNORE)
    return labels, torch.where(labels != IGNORE, weights, 0.0)


def make_examples(
    samples: list[Sample], vocab_to_head: torch.Tensor, max_len: int, prompt_weight: float = 0.0, topk: int = 16
) -> list[Example]:
    """One example per sample: inputs are all tokens but the last.

    Generated positions get weight 1; prompt positions (the target's argmax teacher-forced over the
    prompt, where collected) get ``prompt_weight``.
    """
    examples = []
    for s in samples:
        if s.generated == 0:
            continue
        tokens = torch.tensor(s.tokens[:-1], dtype=torch.long)  # [T]
        start = s.prompt_len - 1
        targets, weights = head_labels(s, len(tokens), vocab_to_head, prompt_weight)
        soft_ids = torch.full((len(tokens), topk), -1, dtype=torch.long)  # [T, K]
        soft_logits = torch.zeros((len(tokens), topk))  # [T, K]
        if s.topk_ids is not None:
            k = min(topk, s.topk_ids.shape[1])
            soft_ids[start:, :k] = vocab_to_head[s.topk_ids[:, :k].long()]
            soft_logits[start:, :k] = s.topk_logits[:, :k].float()
        if len(tokens) > max_len:  # keep the end: drop the start of a long prompt
            tokens, targets, weights = tokens[-max_len:], targets[-max_len:], weights[-max_len:]
            soft_ids, soft_logits = soft_ids[-max_len:], soft_logits[-max_len:]
        if bool((weights > 0).any()):
            examples.append(Example(tokens, targets, weights, soft_ids, soft_logits))
    return examples


@dataclass(frozen=True)
class Batch:
    """Right-padded examples: ``inputs`` / ``targets`` / ``weights`` ``[B, T]``, soft targets ``[B, T, K]``."""

    inputs: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor
    soft_ids: torch.Tensor
    soft_logits: torch.Tensor


def make_batches(examples: list[Example], batch_tokens: int, rng: random.Random) -> list[Batch]:
    """Length-bucketed, right-padded batches of at most ``batch_tokens`` (padded) tokens, shuffled."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].inputs), rng.random()))
    groups, current = [], []
    for i in order:
        longest = max([len(examples[j].inputs) for j in current] + [len(examples[i].inputs)])
        if current and longest * (len(current) + 1) > batch_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    rng.shuffle(groups)
    out = []
    for members in groups:
        width = max(len(examples[i].inputs) for i in members)
        k = examples[members[0]].soft_ids.shape[1]
        inputs = torch.zeros((len(members), width), dtype=torch.long)  # [B, T]
        targets = torch.full((len(members), width), IGNORE, dtype=torch.long)  # [B, T]
        weights = torch.zeros((len(members), width))  # [B, T]
        soft_ids = torch.full((len(members), width, k), -1, dtype=torch.long)  # [B, T, K]
        soft_logits = torch.zeros((len(members), width, k))  # [B, T, K]
        for row, i in enumerate(members):
            e = examples[i]
            n = len(e.inputs)
            inputs[row, :n], targets[row, :n], weights[row, :n] = e.inputs, e.targets, e.weights
            soft_ids[row, :n], soft_logits[row, :n] = e.soft_ids, e.soft_logits
        out.append(Batch(inputs, targets, weights, soft_ids, soft_logits))
    return out


def draft_loss(draft: TokenDraft, batch: Batch, soft_weight: float = 0.0) -> tuple[torch.Tensor, int, int]:
    """Weighted cross-entropy against the target's argmax, plus ``soft_weight`` × cross-entropy against
    the target's top-K distribution (restricted to the head, renormalised); also (correct top-1,
    labelled generated positions)."""
    hidden = draft.hidden(batch.inputs)  # [B, T, D]; right padding needs no mask under causal attention
    keep = batch.weights > 0  # [B, T]
    logp = torch.log_softmax(draft.head_logits(hidden[keep]), dim=-1)  # [M, N]
    labels, weights = batch.targets[keep], batch.weights[keep]  # [M]
    hard = -(logp.gather(1, labels[:, None])[:, 0] * weights).sum() / weights.sum()
    loss = hard
    if soft_weight > 0:
        ids, logits = batch.soft_ids[keep], batch.soft_logits[keep]  # [M, K]
        valid = ids >= 0
        p = torch.softmax(logits.masked_fill(~valid, float("-inf")), dim=-1).nan_to_num(0.0)  # [M, K]
        rows = valid.any(-1)
        soft = -(p * logp.gather(1, ids.clamp(min=0)).masked_fill(~valid, 0.0)).sum(-1)  # [M]
        loss = hard + soft_weight * (soft[rows].sum() / max(1, int(rows.sum())))
    generated = weights == 1.0
    correct = int((logp.detach().argmax(-1)[generated] == labels[generated]).sum())
    return loss, correct, int(generated.sum())


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser and schedule of one training run."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 30
    batch_tokens: int = 6144
    max_len: int = 512
    epochs: float = 4.0
    """Upper bound on passes over the data; the time budget may end training sooner."""
    soft_weight: float = 0.0
    """Weight of distillation on the target's top-K distribution (0: argmax labels only)."""
    seed: int = 0


def _lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def token_batcher(examples: list[Example], config: TrainConfig) -> Callable[[random.Random], list]:
    """Epochs of token-draft batches (``make_batches``)."""
    return lambda rng: make_batches(examples, config.batch_tokens, rng)


def token_loss(config: TrainConfig) -> Callable:
    """The token draft's loss (``draft_loss``) with the configured soft weight."""
    return lambda draft, batch: draft_loss(draft, batch, config.soft_weight)


def train(
    draft: torch.nn.Module,
    batcher: Callable[[random.Random], list],
    loss_fn: Callable,
    config: TrainConfig,
    ckpt: Path,
    deadline: float | None,
    resume: bool,
    checkpoint_every_s: float = 60.0,
    placement: Placement | None = None,
    bar: bool = False,
) -> dict:
    """Trains ``draft`` in place, checkpointing to ``ckpt``; returns a summary for the card.

    ``batcher(rng)`` gives one shuffled epoch of batches; ``loss_fn(draft, batch)`` gives
    (loss, correct top-1, labelled positions). The schedule's length is fixed on the first run:
    ``epochs`` passes, or fewer if the steps that fit before ``deadline`` (measured on the first
    steps) are fewer. ``resume`` continues from ``ckpt``. With ``placement``, batches move to its
    device (where the draft must be) and the loss is computed under its autocast; the backward pass
    and the optimiser stay in the weights' float32. ``bar`` draws a progress bar (else a log line
    now and then).
    """
    place = placement or Placement("cpu", torch.float32)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98))
    rng = random.Random(config.seed)
    per_epoch = len(batcher(random.Random(0)))
    state = {"step": 0, "total_steps": None, "seconds": 0.0, "seen_tokens": 0, "history": []}
    if resume and ckpt.exists():
        saved = torch.load(ckpt, weights_only=False, map_location="cpu")  # resumable on another device
        draft.load_state_dict(saved["draft"])
        optimizer.load_state_dict(saved["optimizer"])
        state = saved["state"]
        rng.setstate(saved["rng"])
    planned = int(config.epochs * per_epoch)

    def save() -> None:
        partial = ckpt.with_suffix(".partial")
        torch.save(
            {
                "draft": draft.state_dict(),
                "optimizer": optimizer.state_dict(),
                "state": state,
                "rng": rng.getstate(),
                "config": asdict(config),
            },
            partial,
        )
        partial.rename(ckpt)

    draft.train()
    last_save = time.monotonic()
    progress = Progress("train", "step", state["total_steps"] or planned, bar, initial=state["step"])
    window: list[tuple[float, int, int]] = []
    batches: list = []
    try:
        while state["total_steps"] is None or state["step"] < state["total_steps"]:
            if not batches:
                batches = batcher(rng)
            batch = to_device(batches.pop(), place.device)
            started = time.monotonic()
            for group in optimizer.param_groups:
                total = state["total_steps"] or planned
                group["lr"] = config.lr * _lr_factor(state["step"], total, min(config.warmup_steps, total // 10 + 1))
            with place.autocast():
                loss, correct, count = loss_fn(draft, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            elapsed = time.monotonic() - started
            state["step"] += 1
            state["seconds"] += elapsed
            state["seen_tokens"] += count
            window.append((float(loss.detach()), correct, count))
            if state["total_steps"] is None and state["step"] == 5:
                # Fix the schedule's length from the measured step time and the time left.
                fits = (
                    planned
                    if deadline is None
                    else int(max(0.0, deadline - time.monotonic()) / (state["seconds"] / 5)) + 5
                )
                state["total_steps"] = max(10, min(planned, fits))
                progress.set_total(state["total_steps"])
            progress.update(1)
            if len(window) == 20:
                mean_loss = sum(w[0] for w in window) / len(window)
                acc = sum(w[1] for w in window) / max(1, sum(w[2] for w in window))
                state["history"].append(
                    {"step": state["step"], "loss": round(mean_loss, 4), "train_top1": round(acc, 4)}
                )
                progress.set_postfix(loss=f"{mean_loss:.3f}", top1=f"{acc:.3f}")
                window = []
            if time.monotonic() - last_save > checkpoint_every_s:
                save()
                last_save = time.monotonic()
            if deadline is not None and time.monotonic() > deadline and state["step"] >= 5:
                break
    finally:
        progress.close()
        save()
        draft.eval()
    return {
        "steps": state["step"],
        "planned_steps": state["total_steps"],
        "seconds": round(state["seconds"], 1),
        "labelled_tokens_seen": state["seen_tokens"],
        "steps_per_epoch": per_epoch,
        "config": asdict(config),
        "history": state["history"][-10:],
    }
