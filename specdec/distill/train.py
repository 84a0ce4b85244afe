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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from draft_service.token_draft import TokenDraft
from specdec.distill.collect import Sample

IGNORE = -100


def top_tokens(samples: list[Sample], n: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The ``n`` most frequent target tokens (labels and continuations), ``always`` first; ties by id."""
    counts: Counter[int] = Counter()
    for s in samples:
        counts.update(s.labels)
        counts.update(s.tokens[s.prompt_len:])
    ranked = [t for t in always] + [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t not in always]
    return torch.tensor(ranked[:n], dtype=torch.long)


@dataclass(frozen=True)
class Example:
    """Draft inputs ``[T]`` and reduced-vocabulary targets ``[T]`` (IGNORE where none)."""

    inputs: torch.Tensor
    targets: torch.Tensor


def make_examples(samples: list[Sample], vocab_to_head: torch.Tensor, max_len: int) -> list[Example]:
    """One example per sample: inputs are all tokens but the last, targets the target's argmax."""
    examples = []
    for s in samples:
        if s.generated == 0:
            continue
        tokens = torch.tensor(s.tokens[:-1], dtype=torch.long)  # [T]
        targets = torch.full_like(tokens, IGNORE)
        head = vocab_to_head[torch.tensor(s.labels, dtype=torch.long)]  # [C]
        targets[s.prompt_len - 1:] = torch.where(head >= 0, head, IGNORE)
        if len(tokens) > max_len:  # keep the end: drop the start of a long prompt
            tokens, targets = tokens[-max_len:], targets[-max_len:]
        if bool((targets != IGNORE).any()):
            examples.append(Example(tokens, targets))
    return examples


def make_batches(examples: list[Example], batch_tokens: int, rng: random.Random) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Length-bucketed, right-padded batches of at most ``batch_tokens`` (padded) tokens, shuffled."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].inputs), rng.random()))
    batches, current = [], []
    for i in order:
        longest = max([len(examples[j].inputs) for j in current] + [len(examples[i].inputs)])
        if current and longest * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    out = []
    for members in batches:
        width = max(len(examples[i].inputs) for i in members)
        inputs = torch.zeros((len(members), width), dtype=torch.long)  # [B, T]
        targets = torch.full((len(members), width), IGNORE, dtype=torch.long)  # [B, T]
        for row, i in enumerate(members):
            n = len(examples[i].inputs)
            inputs[row, :n] = examples[i].inputs
            targets[row, :n] = examples[i].targets
        out.append((inputs, targets))
    return out


def draft_loss(draft: TokenDraft, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Mean cross-entropy over labelled positions; also (correct top-1, labelled positions)."""
    hidden = draft.hidden(inputs)  # [B, T, D]; right padding needs no mask under causal attention
    keep = targets != IGNORE  # [B, T]
    logits = draft.head_logits(hidden[keep])  # [M, N]
    labels = targets[keep]  # [M]
    loss = torch.nn.functional.cross_entropy(logits, labels)
    correct = int((logits.detach().argmax(-1) == labels).sum())
    return loss, correct, int(labels.numel())


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
    seed: int = 0


def _lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train(draft: TokenDraft, examples: list[Example], config: TrainConfig, ckpt: Path, deadline: float | None,
          resume: bool, checkpoint_every_s: float = 60.0) -> dict:
    """Trains ``draft`` in place, checkpointing to ``ckpt``; returns a summary for the card.

    The schedule's length is fixed on the first run: ``epochs`` passes, or fewer if the steps that fit
    before ``deadline`` (measured on the first steps) are fewer. ``resume`` continues from ``ckpt``.
    """
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98))
    rng = random.Random(config.seed)
    per_epoch = len(make_batches(examples, config.batch_tokens, random.Random(0)))
    state = {"step": 0, "total_steps": None, "seconds": 0.0, "seen_tokens": 0, "history": []}
    if resume and ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(saved["draft"])
        optimizer.load_state_dict(saved["optimizer"])
        state = saved["state"]
        rng.setstate(saved["rng"])
    planned = int(config.epochs * per_epoch)

    def save() -> None:
        partial = ckpt.with_suffix(".partial")
        torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(), "state": state,
                    "rng": rng.getstate(), "config": asdict(config)}, partial)
        partial.rename(ckpt)

    draft.train()
    last_save = time.monotonic()
    bar = tqdm(total=state["total_steps"] or planned, initial=state["step"], desc="train", unit="step", dynamic_ncols=True)
    window: list[tuple[float, int, int]] = []
    batches: list = []
    try:
        while state["total_steps"] is None or state["step"] < state["total_steps"]:
            if not batches:
                batches = make_batches(examples, config.batch_tokens, rng)
            inputs, targets = batches.pop()
            started = time.monotonic()
            for group in optimizer.param_groups:
                group["lr"] = config.lr * _lr_factor(state["step"], state["total_steps"] or planned, config.warmup_steps)
            loss, correct, count = draft_loss(draft, inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            elapsed = time.monotonic() - started
            state["step"] += 1
            state["seconds"] += elapsed
            state["seen_tokens"] += count
            window.append((float(loss), correct, count))
            if state["total_steps"] is None and state["step"] == 5:
                # Fix the schedule's length from the measured step time and the time left.
                fits = planned if deadline is None else int(max(0.0, deadline - time.monotonic()) / (state["seconds"] / 5)) + 5
                state["total_steps"] = max(10, min(planned, fits))
                bar.total = state["total_steps"]
                bar.refresh()
            bar.update(1)
            if len(window) == 20:
                mean_loss = sum(w[0] for w in window) / len(window)
                acc = sum(w[1] for w in window) / max(1, sum(w[2] for w in window))
                state["history"].append({"step": state["step"], "loss": round(mean_loss, 4), "train_top1": round(acc, 4)})
                bar.set_postfix(loss=f"{mean_loss:.3f}", top1=f"{acc:.3f}")
                window = []
            if time.monotonic() - last_save > checkpoint_every_s:
                save()
                last_save = time.monotonic()
            if deadline is not None and time.monotonic() > deadline and state["step"] >= 5:
                break
    finally:
        bar.close()
        save()
        draft.eval()
    return {"steps": state["step"], "planned_steps": state["total_steps"], "seconds": round(state["seconds"], 1),
            "labelled_tokens_seen": state["seen_tokens"], "steps_per_epoch": per_epoch, "config": asdict(config),
            "history": state["history"][-10:]}
