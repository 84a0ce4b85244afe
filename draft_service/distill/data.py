"""``specdec distill-data``: the broad corpus and the target's answers to it, resumable, kept in git.

A data folder (``data/distill/<target>/`` for the shipped drafts) holds:

- ``corpus.jsonl.gz``: the composed training requests (``draft_service.distill.corpus``);
  ``held-out.jsonl.gz``: the held-out requests of every category, split before anything is collected;
  ``meta.jsonl.gz``: the self-instruct requests to the target.
- ``meta/``, ``answers/``, ``follow-ups/``: shards of the target's answers (``stream_collect``), one
  folder per stage; ``self-instruct.jsonl.gz`` and ``follow-ups.jsonl.gz``: the requests made from
  the target's own earlier answers (their held-out share joins ``held-out.jsonl.gz`` then).

Every stage is deterministic in the seed and resumes where its shards end, so a later run on another
machine (with a clone of the folder) continues the same collection.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

from draft_service.distill import corpus
from draft_service.distill.collect import Sample
from draft_service.distill.config import DataConfig
from draft_service.distill.prompts import Prompt
from draft_service.distill.stream_collect import Answerer, Job, collect_stage, load_folder

log = logging.getLogger(__name__)

HELD_OUT_SHARE = 0.02
HELD_OUT_CAP = 60
SAMPLED_EVERY = 3
"""Every third answer is sampled (the rest greedy): the draft sees the target's text at temperature too."""
SAMPLED_TEMPERATURE = 0.8
SAMPLED_TOP_P = 0.95
ANSWERS_FIRST = 0.4
"""Share of the token budget answered before the follow-ups are made from those answers."""
FOLLOW_UPS = 0.2
"""Share of the token budget spent on follow-ups; the answers take the rest."""


@dataclass(frozen=True)
class Paths:
    """The files and folders of one data folder."""

    root: Path

    @property
    def corpus(self) -> Path:
        """The composed training requests."""
        return self.root / "corpus.jsonl.gz"

    @property
    def held_out(self) -> Path:
        """Held-out requests of every category, never trained on."""
        return self.root / "held-out.jsonl.gz"

    @property
    def meta(self) -> Path:
        """The requests asking the target to write a user's request."""
        return self.root / "meta.jsonl.gz"

    @property
    def self_instruct(self) -> Path:
        """The requests the target wrote (their training part)."""
        return self.root / "self-instruct.jsonl.gz"

    @property
    def follow_ups(self) -> Path:
        """Second user turns after the target's answers (their training part)."""
        return self.root / "follow-ups.jsonl.gz"

    def shards(self, stage: str) -> Path:
        """The shard folder of a stage: ``meta``, ``answers`` or ``follow-ups``."""
        return self.root / stage


def prepare_corpus(config: DataConfig, paths: Paths) -> None:
    """Composes the corpus and its held-out split once; a folder that has them keeps them."""
    if paths.corpus.exists():
        return
    composed = corpus.compose(config.composed, config.seed)
    train, held = corpus.split_held_out(composed, HELD_OUT_SHARE, HELD_OUT_CAP, config.seed)
    corpus.save_prompts(paths.held_out, held)
    corpus.save_prompts(paths.meta, corpus.meta_prompts(config.meta, config.seed))
    corpus.save_prompts(paths.corpus, train)
    log.info("corpus: %d training requests, %d held out", len(train), len(held))


def jobs_for(prompts: list[Prompt], tokenizer, config: DataConfig, max_new: int, offset: int = 0) -> list[Job]:
    """One job per prompt that fits ``longest_prompt``; index ``offset + i``; every
    ``SAMPLED_EVERY``-th sampled."""
    jobs = []
    for i, prompt in enumerate(prompts):
        tokens = prompt.render(tokenizer)
        if not tokens or len(tokens) > config.longest_prompt:
            continue
        sampled = (offset + i) % SAMPLED_EVERY == SAMPLED_EVERY - 1
        temperature, top_p = (SAMPLED_TEMPERATURE, SAMPLED_TOP_P) if sampled else (0.0, 1.0)
        jobs.append(Job(offset + i, tokens, max_new, temperature, top_p))
    return jobs


def _add_held_out(paths: Paths, prompts: list[Prompt], seed: int) -> list[Prompt]:
    """Splits requests made from the target's answers; their held-out share joins the held-out file.
    Returns the training part."""
    train, held = corpus.split_held_out(prompts, HELD_OUT_SHARE, HELD_OUT_CAP, seed)
    existing = corpus.load_prompts(paths.held_out)
    category = {p.category for p in prompts}
    kept = [p for p in existing if p.category not in category]
    corpus.save_prompts(paths.held_out, kept + held)
    return train


def derive_self_instruct(paths: Paths, tokenizer, seed: int) -> list[Prompt]:
    """The requests the target wrote in the meta stage (once all its answers are in)."""
    if paths.self_instruct.exists():
        return corpus.load_prompts(paths.self_instruct)
    answers = sorted(load_folder(paths.shards("meta")), key=lambda pair: pair[0])
    written = [tokenizer.decode(s.tokens[s.prompt_len :], skip_special_tokens=True) for _, s in answers]
    texts = [corpus.parse_request(text) for text in written]
    train = _add_held_out(paths, corpus.self_instructed([t for t in texts if t], seed), seed)
    corpus.save_prompts(paths.self_instruct, train)
    log.info("self-instruct: %d requests from %d meta answers", len(train), len(answers))
    return train


def derive_follow_ups(paths: Paths, prompts: list[Prompt], tokenizer, config: DataConfig) -> list[Prompt]:
    """Second user turns after a share of the target's greedy chat answers."""
    if paths.follow_ups.exists():
        return corpus.load_prompts(paths.follow_ups)
    r = random.Random(config.seed + 13)
    pool = [p for p in prompts if p.messages is not None and len(p.messages) <= 2]
    made = []
    for index, sample in sorted(load_folder(paths.shards("answers")), key=lambda pair: pair[0]):
        prompt = prompts[index]
        if prompt.messages is None or sample.temperature > 0 or r.random() >= config.follow_up_share:
            continue
        text = tokenizer.decode(sample.tokens[sample.prompt_len :], skip_special_tokens=True)
        if text.strip():
            made.append(corpus.follow_up(r, prompt, text, pool))
    train = _add_held_out(paths, made, config.seed)
    corpus.save_prompts(paths.follow_ups, train)
    log.info("follow-ups: %d requests", len(train))
    return train


def run_data(config: DataConfig, answerer: Answerer, loaded) -> dict[str, int]:
    """Runs the stages in order within ``config.minutes``, answering with ``answerer``; returns the
    generated tokens per stage."""
    paths = Paths(config.data)
    deadline = time.monotonic() + 60 * config.minutes
    prepare_corpus(config, paths)
    tokenizer = loaded.tokenizer
    common = dict(
        per_shard=config.per_shard,
        vocab_size=loaded.vocab_size,
        deadline=deadline,
        bar=config.progress,
    )
    meta = corpus.load_prompts(paths.meta)
    meta_jobs = jobs_for(meta, tokenizer, config, config.meta_max_new)
    made = {"meta": collect_stage(answerer, meta_jobs, paths.shards("meta"), desc="meta", **common)}
    if len({i for i, _ in load_folder(paths.shards("meta"))}) < len(meta_jobs):
        return made
    train = corpus.load_prompts(paths.corpus) + derive_self_instruct(paths, tokenizer, config.seed)
    answers_jobs = jobs_for(train, tokenizer, config, config.max_new)
    answers, follow_ups = paths.shards("answers"), paths.shards("follow-ups")
    first = int(config.tokens * ANSWERS_FIRST)
    made["answers"] = collect_stage(answerer, answers_jobs, answers, desc="answers", token_budget=first, **common)
    if made["answers"] < first:
        log.info("answers hold %d of the %d tokens after which follow-ups are made", made["answers"], first)
        return made
    follow = derive_follow_ups(paths, train, tokenizer, config)
    follow_jobs = jobs_for(follow, tokenizer, config, config.max_new, offset=len(train))
    made["follow-ups"] = collect_stage(
        answerer, follow_jobs, follow_ups, desc="follow-ups", token_budget=int(config.tokens * FOLLOW_UPS), **common
    )
    rest = config.tokens - made["follow-ups"]
    made["answers"] = collect_stage(answerer, answers_jobs, answers, desc="answers", token_budget=rest, **common)
    return made


def training_pairs(root: Path, seed: int = 0) -> list[tuple[Prompt, Sample]]:
    """Every answer a data folder holds beside the request it answers, in a seeded order that mixes
    the stages (a token cap then takes from each)."""
    paths = Paths(root)
    pairs: list[tuple[Prompt, Sample]] = []
    train = corpus.load_prompts(paths.corpus) if paths.corpus.exists() else []
    if paths.self_instruct.exists():
        train += corpus.load_prompts(paths.self_instruct)
    stages = [("meta", corpus.load_prompts(paths.meta) if paths.meta.exists() else [], 0), ("answers", train, 0)]
    if paths.follow_ups.exists():
        stages.append(("follow-ups", corpus.load_prompts(paths.follow_ups), len(train)))
    for stage, prompts, offset in stages:
        for index, sample in load_folder(paths.shards(stage)):
            pairs.append((prompts[index - offset], sample))
    random.Random(seed).shuffle(pairs)
    return pairs
