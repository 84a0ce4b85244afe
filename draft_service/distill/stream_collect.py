"""Collecting the target's answers with the serving engine's pass, continuously batched, into small
shards that live in git.

The pass is the one the target service runs (``specdec.ragged`` eager, or ``specdec.compiled`` once
built), in the serving dtype, so the draft learns the bits it will be verified against. Sessions
join and leave the batch as they finish: a pass holds the newest token of every running session
and the whole prompt of each session that starts. The pass is batch-invariant, so an answer does
not depend on what ran beside it, and each sampled answer draws from a generator seeded by its
prompt's index: a resumed collection writes what an unbroken one would.

A shard (``shard-NNNNN.npz``) holds finished answers only: token ids (``uint16`` where the vocabulary
fits), each answer's prompt length, the target's argmax at every generated position, its
temperature and its prompt's index in the corpus. A feature draft's training recomputes the hidden
states (and from them the target's distribution), so a million tokens take a few megabytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from draft_service.distill.collect import Sample
from draft_service.distill.progress import Progress
from specdec.kvcache import GrowableCache
from specdec.ragged import RaggedItem

Forward = Callable[[list[RaggedItem]], tuple[list[torch.Tensor], list[torch.Tensor]]]
"""A ragged pass: ``specdec.ragged.ragged_forward`` over a model, or ``CompiledPass.forward``."""
Answerer = Callable[[Iterable["Job"]], Iterator[tuple["Job", Sample]]]
"""Answers jobs, yielding each as it finishes: ``answer`` on a ragged pass, or
``wave_collect.wave_answer`` on a GPU."""


@dataclass(frozen=True)
class Job:
    """One prompt to answer: its corpus index, token ids, length limit and sampling."""

    index: int
    tokens: list[int]
    max_new: int
    temperature: float = 0.0
    top_p: float = 1.0


@dataclass
class _Running:
    job: Job
    cache: GrowableCache
    generator: torch.Generator | None
    fed: bool = False
    tokens: list[int] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)

    def item(self) -> RaggedItem:
        return RaggedItem(self.cache, self.job.tokens if not self.fed else self.tokens[-1:], 1)


def job_generator(seed: int, index: int) -> torch.Generator:
    """The sampling generator of the answer to prompt ``index``: the same whatever ran beside it."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def next_token(logits: torch.Tensor, job: Job, generator: torch.Generator | None) -> tuple[int, int]:
    """``(chosen, argmax)`` from one position's logits ``[V]``: greedy, or sampled at the job's
    temperature within its top-p nucleus."""
    greedy = int(logits.argmax())
    if job.temperature <= 0:
        return greedy, greedy
    probs = torch.softmax(logits.float() / job.temperature, dim=-1)  # [V]
    if job.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        outside = sorted_probs.cumsum(-1) - sorted_probs >= job.top_p
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs.masked_fill(outside, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator)), greedy


def answer(
    forward: Forward,
    jobs: Iterable[Job],
    width: int,
    eos_ids: tuple[int, ...],
    seed: int,
    max_context: int,
) -> Iterator[tuple[Job, Sample]]:
    """Answers ``jobs`` with up to ``width`` sessions in each pass; yields each as it finishes."""
    pending = iter(jobs)
    running: list[_Running] = []
    exhausted = False
    eos = set(eos_ids)
    while True:
        while not exhausted and len(running) < width:
            job = next(pending, None)
            if job is None:
                exhausted = True
                break
            generator = job_generator(seed, job.index) if job.temperature > 0 else None
            running.append(_Running(job, GrowableCache(), generator))
        if not running:
            return
        logits, _ = forward([r.item() for r in running])
        still: list[_Running] = []
        for r, rows in zip(running, logits):
            r.fed = True
            chosen, greedy = next_token(rows[-1], r.job, r.generator)
            r.tokens.append(chosen)
            r.labels.append(greedy)
            length = len(r.job.tokens) + len(r.tokens)
            if chosen in eos or len(r.tokens) >= r.job.max_new or length >= max_context - 1:
                yield r.job, Sample(r.job.tokens + r.tokens, len(r.job.tokens), r.labels, r.job.temperature)
            else:
                still.append(r)
        running = still


# ---------------------------------------------------------------- shards


def save_shard(path: Path, samples: list[tuple[int, Sample]], vocab_size: int) -> None:
    """Writes ``(corpus index, sample)`` pairs as one compressed ``.npz``, atomically."""
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.stem + ".partial.npz")
    np.savez_compressed(
        partial,
        tokens=np.concatenate([np.asarray(s.tokens, dtype=dtype) for _, s in samples]),
        lengths=np.asarray([len(s.tokens) for _, s in samples], dtype=np.int32),
        prompt_lens=np.asarray([s.prompt_len for _, s in samples], dtype=np.int32),
        labels=np.concatenate([np.asarray(s.labels, dtype=dtype) for _, s in samples]),
        temperatures=np.asarray([s.temperature for _, s in samples], dtype=np.float32),
        index=np.asarray([i for i, _ in samples], dtype=np.int64),
    )
    partial.rename(path)


def load_shard(path: Path) -> list[tuple[int, Sample]]:
    """What ``save_shard`` wrote."""
    with np.load(path) as data:
        tokens, labels = data["tokens"].astype(np.int64), data["labels"].astype(np.int64)
        out = []
        t = lab = 0
        for i, length, prompt_len, temperature in zip(
            data["index"], data["lengths"], data["prompt_lens"], data["temperatures"]
        ):
            generated = int(length) - int(prompt_len)
            answer_labels = labels[lab : lab + generated].tolist()
            sample = Sample(tokens[t : t + length].tolist(), int(prompt_len), answer_labels, float(temperature))
            out.append((int(i), sample))
            t += int(length)
            lab += generated
    return out


def shard_paths(folder: Path) -> list[Path]:
    """A folder's finished shards, in order."""
    return sorted(p for p in folder.glob("shard-*.npz") if not p.name.endswith(".partial.npz"))


def load_folder(folder: Path) -> list[tuple[int, Sample]]:
    """Every ``(corpus index, sample)`` of every shard in ``folder``."""
    return [pair for path in shard_paths(folder) for pair in load_shard(path)]


def collect_stage(
    answers: Answerer,
    jobs: list[Job],
    folder: Path,
    *,
    per_shard: int,
    vocab_size: int,
    deadline: float | None = None,
    token_budget: int | None = None,
    desc: str = "collect",
    bar: bool = False,
) -> int:
    """Answers the ``jobs`` no shard in ``folder`` holds yet, ``per_shard`` answers a shard; returns
    the generated tokens the folder holds. Stops (after writing what finished) once past
    ``deadline`` (``time.monotonic()``) or ``token_budget`` generated tokens."""
    done = load_folder(folder)
    have = sum(s.generated for _, s in done)
    finished = {i for i, _ in done}
    todo = [j for j in jobs if j.index not in finished]
    paths = shard_paths(folder)
    next_shard = int(paths[-1].stem.removeprefix("shard-")) + 1 if paths else 0
    progress = Progress(desc, "tok", token_budget or have + sum(j.max_new for j in todo), bar, initial=have)

    def over() -> bool:
        return (deadline is not None and time.monotonic() > deadline) or (
            token_budget is not None and have >= token_budget
        )

    stop = over()

    def feed() -> Iterator[Job]:
        for job in todo:
            if stop:
                return
            yield job

    buffer: list[tuple[int, Sample]] = []
    try:
        for job, sample in answers(feed()):
            buffer.append((job.index, sample))
            have += sample.generated
            progress.update(sample.generated)
            if len(buffer) >= per_shard:
                save_shard(folder / f"shard-{next_shard:05d}.npz", buffer, vocab_size)
                next_shard, buffer = next_shard + 1, []
            # Stop taking new prompts; the running ones finish into the last shard.
            stop = over()
    finally:
        if buffer:
            save_shard(folder / f"shard-{next_shard:05d}.npz", buffer, vocab_size)
        progress.close()
    return have
