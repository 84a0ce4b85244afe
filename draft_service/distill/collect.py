"""Collecting the target's own continuations: batched, left-padded, greedy or sampled.

For every generated position we also keep the target's argmax (its greedy choice there), so sampled
continuations teach the draft the target's greedy next token on more varied text. Only token ids
are stored: one ``.pt`` shard per batch, so a stopped collection resumes at the next batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draft_service.distill.progress import Progress
from specdec.kvcache import GrowableCache


@dataclass(frozen=True)
class Sample:
    """One prompt and the target's continuation of it.

    ``tokens`` is prompt + continuation; ``labels[i]`` is the target's argmax at position
    ``prompt_len - 1 + i`` (equal to ``tokens[prompt_len + i]`` when the continuation is greedy).
    """

    tokens: list[int]
    prompt_len: int
    labels: list[int]
    temperature: float
    prompt_labels: list[int] | None = None
    """The target's argmax at prompt positions ``0 .. prompt_len - 2`` (teacher-forced on the prompt)."""
    topk_ids: torch.Tensor | None = None
    """``[C, K]`` the target's top-K token ids at each generated position, best first."""
    topk_logits: torch.Tensor | None = None
    """``[C, K]`` their logits (fp16), for distillation on the target's distribution."""

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@torch.inference_mode()
def generate_batch(
    model,
    prompts: list[list[int]],
    max_new: int,
    temperature: float,
    eos_ids: tuple[int, ...],
    pad_id: int,
    generator: torch.Generator | None = None,
    topk: int = 16,
) -> list[Sample]:
    """Continues ``prompts`` together (left padding); greedy when ``temperature == 0``.

    Besides the tokens, records the target's argmax over the prompt and its top-``topk`` logits at
    every generated position.
    """
    batch = len(prompts)
    width = max(len(p) for p in prompts)
    device = model.get_output_embeddings().weight.device
    ids = torch.full((batch, width), pad_id, dtype=torch.long)  # [B, W]
    mask = torch.zeros((batch, width), dtype=torch.long)  # [B, W]
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, W]
    cache = GrowableCache()
    hidden = model.get_decoder()(
        input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
    ).last_hidden_state  # [B, W, D]
    head = model.get_output_embeddings()
    logits = head(hidden[:, -1]).float()  # [B, V]
    prompt_labels = _prompt_argmax(head, hidden[:, :-1], mask[:, :-1], prompts)
    eos = torch.tensor(list(eos_ids) or [-1], device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    conts: list[list[int]] = [[] for _ in range(batch)]
    labels: list[list[int]] = [[] for _ in range(batch)]
    top_ids: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    top_vals: list[list[torch.Tensor]] = [[] for _ in range(batch)]
    next_pos = positions[:, -1] + 1  # [B]
    for _ in range(max_new):
        values, indices = torch.topk(logits, topk, dim=-1)  # [B, K]
        greedy = indices[:, 0]  # [B]
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)  # [B, V]
            chosen = torch.multinomial(probs, 1, generator=generator)[:, 0]  # [B]
        else:
            chosen = greedy
        # One copy to the host per step (a no-op on a CPU), not one per row and token.
        host_chosen, host_greedy, host_done = chosen.tolist(), greedy.tolist(), done.tolist()
        host_ids, host_vals = indices.to(torch.int32).cpu(), values.to(torch.float16).cpu()  # [B, K]
        for row in range(batch):
            if not host_done[row]:
                conts[row].append(host_chosen[row])
                labels[row].append(host_greedy[row])
                top_ids[row].append(host_ids[row])
                top_vals[row].append(host_vals[row])
        done |= torch.isin(chosen, eos)
        if bool(done.all()):
            break
        chosen = chosen.masked_fill(done, pad_id)
        mask = torch.cat([mask, (~done).long()[:, None]], dim=1)  # [B, W + t]
        logits = (
            model(
                input_ids=chosen[:, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
                cache=cache,
                use_cache=True,
            )
            .logits[:, -1]
            .float()
        )  # [B, V]
        next_pos = next_pos + 1
    return [
        Sample(list(p) + c, len(p), lab, temperature, pl, torch.stack(ti), torch.stack(tv))
        for p, c, lab, pl, ti, tv in zip(prompts, conts, labels, prompt_labels, top_ids, top_vals)
    ]


def _prompt_argmax(
    head, hidden: torch.Tensor, mask: torch.Tensor, prompts: list[list[int]], chunk: int = 512
) -> list[list[int]]:
    """The target's argmax at every real prompt position but the last, computed in row chunks."""
    rows = hidden[mask.bool()]  # [M, D], left-padded rows in order
    picks = (
        torch.cat([head(rows[i : i + chunk]).argmax(-1) for i in range(0, len(rows), chunk)])
        if len(rows)
        else rows.new_zeros(0, dtype=torch.long)
    )
    host = picks.tolist()  # one copy off the device
    out, start = [], 0
    for p in prompts:
        out.append(host[start : start + len(p) - 1])
        start += len(p) - 1
    return out


def save_shard(path: Path, samples: list[Sample]) -> None:
    """Writes samples as int32 token-id tensors (written beside, then renamed: never half a shard)."""
    data = {
        "tokens": [torch.tensor(s.tokens, dtype=torch.int32) for s in samples],
        "labels": [torch.tensor(s.labels, dtype=torch.int32) for s in samples],
        "prompt_len": [s.prompt_len for s in samples],
        "temperature": [s.temperature for s in samples],
        "prompt_labels": [torch.tensor(s.prompt_labels or [], dtype=torch.int32) for s in samples],
        "topk_ids": [s.topk_ids for s in samples],
        "topk_logits": [s.topk_logits for s in samples],
    }
    partial = path.with_suffix(".partial")
    torch.save(data, partial)
    partial.rename(path)


def load_shards(folder: Path) -> list[Sample]:
    """Every sample of every shard in ``folder``, in shard order."""
    samples: list[Sample] = []
    for path in sorted(folder.glob("shard-*.pt")):
        data = torch.load(path)
        n = len(data["tokens"])
        for i in range(n):
            samples.append(
                Sample(
                    data["tokens"][i].tolist(),
                    int(data["prompt_len"][i]),
                    data["labels"][i].tolist(),
                    float(data["temperature"][i]),
                    data.get("prompt_labels", [None] * n)[i].tolist() if "prompt_labels" in data else None,
                    data.get("topk_ids", [None] * n)[i],
                    data.get("topk_logits", [None] * n)[i],
                )
            )
    return samples


@dataclass(frozen=True)
class CollectPlan:
    """How to continue a list of prompts: batch size, length, and which batches are sampled."""

    batch_size: int
    max_new: int
    temperatures: tuple[float, ...]
    """Cycled over batches: 0.0 is greedy."""
    seed: int


def collect(
    model,
    prompts: list[list[int]],
    folder: Path,
    plan: CollectPlan,
    eos_ids: tuple[int, ...],
    pad_id: int,
    token_budget: int | None = None,
    deadline: float | None = None,
    desc: str = "collect",
    bar: bool = False,
) -> int:
    """Continues ``prompts`` batch by batch into shards under ``folder``; returns generated tokens.

    Batches whose shard exists are skipped (resume). Stops early once ``token_budget`` generated
    tokens are on disk or ``time.monotonic()`` passes ``deadline``. ``bar`` draws a progress bar
    (else a log line now and then, ``Progress``).
    """
    folder.mkdir(parents=True, exist_ok=True)
    batches = [prompts[i : i + plan.batch_size] for i in range(0, len(prompts), plan.batch_size)]
    have = sum(len(s.tokens) - s.prompt_len for s in load_shards(folder))
    device = model.get_output_embeddings().weight.device
    total = token_budget or sum(len(b) for b in batches) * plan.max_new  # the budget, or at most every token
    progress = Progress(desc, "tok", total, bar, initial=have)
    try:
        for index, batch in enumerate(batches):
            path = folder / f"shard-{index:05d}.pt"
            if path.exists():
                continue
            if (token_budget is not None and have >= token_budget) or (
                deadline is not None and time.monotonic() > deadline
            ):
                break
            temperature = plan.temperatures[index % len(plan.temperatures)]
            # Seeded per batch, so a resumed collection samples what an unbroken one would.
            generator = torch.Generator(device=device).manual_seed(plan.seed * 100_003 + index)
            samples = generate_batch(model, batch, plan.max_new, temperature, eos_ids, pad_id, generator)
            save_shard(path, samples)
            made = sum(s.generated for s in samples)
            have += made
            progress.update(made)
    finally:
        progress.close()
    return have
