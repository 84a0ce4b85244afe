"""The target's last hidden states over collected samples, for training a feature-level draft.

A feature draft (``draft_service.feature_draft``) reads the target's final-norm hidden state at
position i, the vector the LM head turns into the distribution of token i + 1. Serving gets these
from the target service; training gets them here, teacher-forced over each sample in one pass.
With side layers (``FeatureDraftArch.side_layers``) each row also holds the residual stream after
those layers: ``[T, D * (1 + S)]``. Stored as fp16 per sample, one shard per group of samples, so a
stopped run resumes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draft_service.distill.collect import Sample
from draft_service.distill.progress import Progress
from specdec.side_layers import layer_outputs, with_sides

FEATURE_DTYPE = torch.float16


@torch.inference_mode()
def sample_features(model, tokens: list[list[int]], side_layers: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """Final-norm hidden states ``[T_i, D]`` of each token list, then the outputs of ``side_layers``
    (``[T_i, D * (1 + S)]``), computed in one right-padded batch.

    Right padding needs no mask under causal attention: a real position never sees a later pad.
    """
    width = max(len(t) for t in tokens)
    ids = torch.zeros((len(tokens), width), dtype=torch.long)  # [B, W]
    for row, t in enumerate(tokens):
        ids[row, : len(t)] = torch.tensor(t)
    ids = ids.to(model.get_output_embeddings().weight.device)
    decoder = model.get_decoder()
    with layer_outputs(decoder.layers, side_layers) as sides:
        hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state  # [B, W, D]
    hidden = with_sides(hidden, sides, side_layers)  # [B, W, D * (1 + S)]
    hidden = hidden.to(FEATURE_DTYPE).cpu()  # features are stored and trained from on the host
    return [hidden[row, : len(t)].clone() for row, t in enumerate(tokens)]


def extract_features(
    model,
    samples: list[Sample],
    folder: Path,
    batch_tokens: int = 4096,
    shard_samples: int = 64,
    side_layers: tuple[int, ...] = (),
    bar: bool = False,
) -> list[torch.Tensor]:
    """Features of every sample (in order), computing only the shards not yet on disk; ``bar`` draws
    a progress bar (else a log line now and then)."""
    folder.mkdir(parents=True, exist_ok=True)
    out: list[torch.Tensor] = []
    progress = Progress("features", "tok", sum(len(s.tokens) for s in samples), bar)
    try:
        for index, first in enumerate(range(0, len(samples), shard_samples)):
            group = samples[first : first + shard_samples]
            path = folder / f"features-{index:05d}.pt"
            feats = torch.load(path) if path.exists() else None
            # A shard written when fewer samples were collected holds a shorter group: redo it.
            # So is one of another width (other side layers).
            width = model.config.hidden_size * (1 + len(side_layers))
            if feats is None or len(feats) != len(group) or feats[0].shape[-1] != width:
                feats = _group_features(model, [s.tokens for s in group], batch_tokens, side_layers)
                partial = path.with_suffix(".partial")
                torch.save(feats, partial)
                partial.rename(path)
            out.extend(feats)
            progress.update(sum(len(s.tokens) for s in group))
    finally:
        progress.close()
    return out


def _group_features(
    model, tokens: list[list[int]], batch_tokens: int, side_layers: tuple[int, ...]
) -> list[torch.Tensor]:
    """Features of a group, batched by length so padding stays small; returned in input order."""
    order = sorted(range(len(tokens)), key=lambda i: len(tokens[i]))
    feats: dict[int, torch.Tensor] = {}
    batch: list[int] = []
    for i in order + [None]:
        if i is not None and (not batch or len(tokens[i]) * (len(batch) + 1) <= batch_tokens):
            batch.append(i)
            continue
        if batch:
            for j, f in zip(batch, sample_features(model, [tokens[j] for j in batch], side_layers)):
                feats[j] = f
        batch = [i] if i is not None else []
    return [feats[i] for i in range(len(tokens))]
