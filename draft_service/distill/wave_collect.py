"""Collecting the target's answers on a GPU: prompts in padded waves over transformers' own forward.

The serving pass (``stream_collect.answer``) keeps a cache per session and lets sessions join as
others finish, which suits a CPU's few dozen sessions; with hundreds of sessions on a GPU its
per-session bookkeeping, not the arithmetic, would bound every step. Here a wave of up to ``width``
prompts is left-padded into one batch, prefilled once (logits of the last position only) and decoded
together until every answer in it has ended; a finished row idles to the end of its wave. A wave's
prompts are taken only as it starts, so a deadline stops the collection after the running wave.

Answers are what ``stream_collect.answer`` records (token ids, the target's argmax at every
generated position, the temperature), in the same shards. They are not bit-for-bit the serving
pass's: a GPU's kernels round differently, and a wave's sampled answers share one generator seeded
by the seed and the wave's first prompt index, so a resumed run draws other samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice

import torch

from draft_service.distill.collect import Sample
from draft_service.distill.stream_collect import Job


def wave_answer(
    model,
    jobs: Iterable[Job],
    width: int,
    eos_ids: tuple[int, ...],
    seed: int,
    max_context: int,
    pad_id: int,
) -> Iterator[tuple[Job, Sample]]:
    """Answers ``jobs`` in waves of up to ``width`` prompts; yields each answer as it finishes."""
    pending = iter(jobs)
    while wave := list(islice(pending, width)):
        yield from _wave(model, wave, eos_ids, seed, max_context, pad_id)


@torch.inference_mode()
def _wave(
    model, wave: list[Job], eos_ids: tuple[int, ...], seed: int, max_context: int, pad_id: int
) -> Iterator[tuple[Job, Sample]]:
    """One wave: left-padded prefill, then one decode step for all rows until every row is done."""
    device = model.get_output_embeddings().weight.device
    b, width = len(wave), max(len(job.tokens) for job in wave)
    ids = torch.full((b, width), pad_id, dtype=torch.long)  # [B, P]
    mask = torch.zeros((b, width), dtype=torch.long)  # [B, P]: 1 on real prompt tokens
    for row, job in enumerate(wave):
        ids[row, width - len(job.tokens) :] = torch.tensor(job.tokens)
        mask[row, width - len(job.tokens) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]: each row counts from its first real token
    temperature = torch.tensor([job.temperature for job in wave], device=device)  # [B]
    top_p = torch.tensor([job.top_p for job in wave], device=device)  # [B]
    generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + wave[0].index)
    # As ``stream_collect.answer``: an answer ends at max_new or one short of the context, after one token at least.
    limits = [max(1, min(job.max_new, max_context - 1 - len(job.tokens))) for job in wave]

    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    cache, last = out.cache, positions[:, -1:]  # [B, 1]
    answers: list[list[int]] = [[] for _ in wave]
    labels: list[list[int]] = [[] for _ in wave]
    done = [False] * b
    eos = set(eos_ids)
    while not all(done):
        chosen, greedy = _next_tokens(out.logits[:, -1], temperature, top_p, generator)  # [B] each
        # One copy to the host a step: the rows' tokens, and from them which rows stop.
        for row, (token, best) in enumerate(zip(chosen.tolist(), greedy.tolist())):
            if done[row]:
                continue
            answers[row].append(token)
            labels[row].append(best)
            if token in eos or len(answers[row]) >= limits[row]:
                done[row] = True
                job = wave[row]
                yield job, Sample(job.tokens + answers[row], len(job.tokens), labels[row], job.temperature)
        if all(done):
            return
        mask = torch.cat([mask, mask.new_ones((b, 1))], dim=1)  # [B, P + steps]
        last = last + 1
        out = model(input_ids=chosen[:, None], attention_mask=mask, position_ids=last, cache=cache)
        cache = out.cache


def _next_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen, argmax)`` per row of ``logits [B, V]``: the argmax where a row's temperature is 0, else a
    draw at its temperature within its top-p nucleus (``stream_collect.next_token``'s rule, batched)."""
    greedy = logits.argmax(-1)  # [B]
    sampled = temperature > 0
    if not bool(sampled.any()):
        return greedy, greedy
    scaled = logits[sampled].float() / temperature[sampled, None]  # [S, V]
    probs, order = torch.softmax(scaled, dim=-1).sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (the first token always).
    outside = probs.cumsum(-1) - probs >= top_p[sampled, None]
    picks = torch.multinomial(probs.masked_fill(outside, 0.0), 1, generator=generator)  # [S, 1]
    chosen = greedy.clone()
    chosen[sampled] = order.gather(1, picks)[:, 0]
    return chosen, greedy
