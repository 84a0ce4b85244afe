"""The broad corpus and its collection (``specdec distill-data``): requests composed, split and stored;
answers continuously batched on the serving pass, each independent of its batch; shards that resume;
and ``specdec distill --data`` training on what was collected (tiny models)."""

from __future__ import annotations

import json
from collections import Counter
from functools import partial

import pytest
import torch

from draft_service.distill import cli as distill_cli
from draft_service.distill import corpus, data_cli
from draft_service.distill.data import Paths, training_pairs
from draft_service.distill.stream_collect import (
    Job,
    answer,
    collect_stage,
    load_folder,
    next_token,
    shard_paths,
)
from draft_service.distill.wave_collect import wave_answer
from draft_service.token_draft import CARD_FILE
from specdec.ragged import ragged_forward
from tests.tiny import EOS_ID


def _forward(loaded):
    return lambda items: ragged_forward(loaded.model, items)


def _jobs(n: int, max_new: int = 12) -> list[Job]:
    g = torch.Generator().manual_seed(0)
    jobs = []
    for i in range(n):
        tokens = torch.randint(2, 32, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        jobs.append(Job(i, tokens, max_new, temperature=0.9 if i % 3 == 2 else 0.0, top_p=0.9))
    return jobs


def _answers(loaded, jobs: list[Job], width: int) -> dict[int, list[int]]:
    out = {}
    for job, sample in answer(_forward(loaded), jobs, width, (EOS_ID,), seed=5, max_context=256):
        out[job.index] = sample.tokens
    return out


def test_an_answer_does_not_depend_on_the_sessions_beside_it(tiny_target):
    """Continuous batching (sessions joining as others finish, prompts fed beside decode rows) gives
    every prompt, greedy or sampled, the answer it gets alone."""
    jobs = _jobs(10)
    alone = _answers(tiny_target, jobs, width=1)
    assert _answers(tiny_target, jobs, width=4) == alone
    assert _answers(tiny_target, list(reversed(jobs)), width=7) == alone
    assert set(alone) == set(range(10))


def test_greedy_answers_are_the_targets_argmax_chain(tiny_target):
    """A greedy answer's tokens are its labels, and they are what the target's own greedy decoding
    (a fresh full forward per step) gives."""
    job = _jobs(1)[0]
    [(_, sample)] = list(answer(_forward(tiny_target), [job], 1, (EOS_ID,), 0, 256))
    assert sample.tokens[sample.prompt_len :] == sample.labels
    tokens = list(job.tokens)
    with torch.inference_mode():
        for _ in range(sample.generated):
            logits = tiny_target.model(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    assert tokens == sample.tokens


def test_top_p_samples_only_inside_the_nucleus():
    logits = torch.tensor([5.0, 4.0, 0.0, -1.0, -2.0])
    job = Job(0, [1], 1, temperature=1.0, top_p=0.8)
    g = torch.Generator().manual_seed(0)
    picks = Counter(next_token(logits, job, g)[0] for _ in range(400))
    assert set(picks) == {0, 1}  # p = .72, .27: the nucleus reaching 0.8 holds the first two
    assert next_token(logits, Job(0, [1], 1), None) == (0, 0)


def test_a_stopped_collection_resumes_to_what_an_unbroken_one_writes(tiny_target, tmp_path):
    jobs = _jobs(12, max_new=10)
    answers = partial(answer, _forward(tiny_target), width=3, eos_ids=(EOS_ID,), seed=1, max_context=256)
    common = dict(per_shard=4, vocab_size=32)
    whole = collect_stage(answers, jobs, tmp_path / "whole", **common)
    first = collect_stage(answers, jobs, tmp_path / "split", token_budget=20, **common)
    assert 20 <= first < whole
    assert len(load_folder(tmp_path / "split")) < len(jobs)
    again = collect_stage(answers, jobs, tmp_path / "split", **common)
    assert again == whole
    assert sorted(load_folder(tmp_path / "split"), key=lambda p: p[0]) == sorted(
        load_folder(tmp_path / "whole"), key=lambda p: p[0]
    )
    assert all(p.suffix == ".npz" for p in shard_paths(tmp_path / "split"))


def _waves(loaded, jobs: list[Job], width: int, seed: int = 5) -> dict[int, tuple[list[int], list[int]]]:
    answers = wave_answer(loaded.model, jobs, width, (EOS_ID,), seed, max_context=256, pad_id=EOS_ID)
    return {job.index: (sample.tokens, sample.labels) for job, sample in answers}


def test_wave_answers_are_the_targets_own_greedy_and_sampled_answers(tiny_target):
    """GPU collection's padded waves (prompts of many lengths left-padded together) give each greedy
    prompt the target's own argmax chain, label every position with the argmax there, and sample
    the others (within a vanishing nucleus a draw is the argmax)."""
    jobs = _jobs(10, max_new=9)
    waves = _waves(tiny_target, jobs, width=4)
    assert set(waves) == {job.index for job in jobs}
    for job in jobs:
        tokens, labels = waves[job.index]
        assert tokens[: len(job.tokens)] == job.tokens and 1 <= len(labels) <= job.max_new
        with torch.inference_mode():  # the argmax at every answer position, the answer fed alone
            logits = tiny_target.model(torch.tensor([tokens])).logits[0]
        assert labels == logits[len(job.tokens) - 1 : -1].argmax(-1).tolist()
        if job.temperature == 0:
            assert tokens[len(job.tokens) :] == labels
    assert _waves(tiny_target, jobs, width=3) != waves  # the waves' composition seeds their draws...
    assert _waves(tiny_target, jobs, width=4) == waves  # ...and the same waves draw the same
    narrow = [Job(j.index, j.tokens, j.max_new, temperature=1.5, top_p=1e-6) for j in jobs]
    assert all(tokens[-len(labels) :] == labels for tokens, labels in _waves(tiny_target, narrow, 4).values())
    wide = [Job(j.index, j.tokens, j.max_new, temperature=3.0, top_p=1.0) for j in jobs]
    assert any(tokens[-len(labels) :] != labels for tokens, labels in _waves(tiny_target, wide, 4).values())


def test_wave_answers_fill_shards_that_resume(tiny_target, tmp_path):
    jobs = _jobs(9, max_new=6)
    answers = partial(wave_answer, tiny_target.model, width=2, eos_ids=(EOS_ID,), seed=0, max_context=256, pad_id=1)
    first = collect_stage(answers, jobs, tmp_path, per_shard=4, vocab_size=32, token_budget=10)
    assert 10 <= first and len(load_folder(tmp_path)) < len(jobs)
    total = collect_stage(answers, jobs, tmp_path, per_shard=4, vocab_size=32)
    assert sorted(i for i, _ in load_folder(tmp_path)) == list(range(9))
    assert total == sum(s.generated for _, s in load_folder(tmp_path))


@pytest.mark.parametrize(
    "written, wanted",
    [
        ('A nurse might ask: "How do I keep my hands from drying out?"', "How do I keep my hands from drying out?"),
        ("Question: How do I compost kitchen scraps at home?\nMore text", "How do I compost kitchen scraps at home?"),
        ("I'm ready to assist. What's the task?", None),
        ("Sure!", None),
        ("", None),
    ],
)
def test_parse_request_keeps_only_a_request(written, wanted):
    assert corpus.parse_request(written) == wanted


def test_the_corpus_is_broad_distinct_seeded_and_held_out_per_category():
    passages = [
        ("docs", f"Passage {i} explains how feature {i} works in several careful sentences.") for i in range(50)
    ]
    prompts = corpus.compose(1500, 0, passages)
    assert prompts == corpus.compose(1500, 0, passages)
    assert len({" ".join(p.key.lower().split()) for p in prompts}) == len(prompts) == 1500
    categories = Counter(p.category for p in prompts)
    assert {"ask", "writing", "advice", "code", "passage", "translation", "maths"} <= set(categories)
    train, held = corpus.split_held_out(prompts, 0.02, 60, 0)
    assert len(train) + len(held) == len(prompts) and not {p.key for p in train} & {p.key for p in held}
    assert {p.category for p in held} == {c for c, n in categories.items() if n >= 2}


def test_corpus_files_round_trip(tmp_path):
    prompts = corpus.compose(40, 3, [("docs", "A passage about the tool and how it works for users.")])
    prompts.append(corpus.Prompt("code-stdlib", text="def f(x):\n    'doc'\n"))
    corpus.save_prompts(tmp_path / "p.jsonl.gz", prompts)
    assert corpus.load_prompts(tmp_path / "p.jsonl.gz") == prompts


def test_distill_data_then_distill_trains_on_its_answers(tiny_dir, tmp_path):
    """The whole path on the tiny target: a corpus, self-instruct requests, answers and follow-ups
    collected into a data folder; resumed without redoing anything; then a draft trained on it and
    evaluated on its held-out requests by category."""
    folder = tmp_path / "data"
    argv = ["--target", str(tiny_dir / "target"), "--data", str(folder), "--cache-dir", str(tiny_dir)]
    argv += ["--composed", "80", "--meta", "12", "--tokens", "600", "--max-new", "8", "--width", "6"]
    argv += ["--no-compile", "--threads", "1", "--no-progress"]
    assert data_cli.main(argv) == 0
    paths = Paths(folder)
    for stage in ("meta", "answers", "follow-ups"):
        assert shard_paths(paths.shards(stage)), stage
    pairs = training_pairs(folder)

    def stamps() -> dict:
        stages = ("meta", "answers", "follow-ups")
        return {p: p.stat().st_mtime_ns for stage in stages for p in shard_paths(paths.shards(stage))}

    before = stamps()
    assert data_cli.main(argv) == 0  # everything asked for is there: nothing is collected again
    assert stamps() == before and training_pairs(folder) == pairs
    assert {p.category for p, _ in pairs} >= {"meta", "multi-turn"}

    out = tmp_path / "draft"
    args = ["--target", str(tiny_dir / "target"), "--out", str(out), "--work", str(tmp_path / "work")]
    args += ["--cache-dir", str(tiny_dir), "--data", str(folder), "--tokens", "300", "--minutes", "0.5"]
    args += ["--eval-max-new", "8", "--layers", "1", "--init-from", "1", "--head-size", "24", "--epochs", "1"]
    args += ["--batch-tokens", "512", "--threads", "1", "--held-out-cap", "3"]
    assert distill_cli.main(args) == 0
    card = json.loads((out / CARD_FILE).read_text())
    data = card["recipe"]["data"]
    assert data["prompt_source"] == {"kind": "data folder", "path": str(folder)}
    assert 300 - 8 <= data["train_generated_tokens"] <= 300
    held = Counter(p.category for p in corpus.load_prompts(paths.held_out))
    assert data["held_out_prompts"] == sum(min(3, n) for n in held.values())
    assert set(card["metrics"]["held_out_by_category"]) <= set(held)


def test_distill_refuses_a_folder_that_is_not_a_data_folder(tmp_path):
    with pytest.raises(SystemExit, match="not a `specdec distill-data` folder"):
        distill_cli.config_from_args(["--target", "default", "--out", str(tmp_path), "--data", str(tmp_path)])


def test_self_instructed_requests_are_distinct_and_never_empty():
    made = corpus.self_instructed(["How do I bake bread?", "how do i  bake bread?", "", "  ", "What is DNA?"], 0)
    assert [p.messages[-1][1] for p in made] == ["How do I bake bread?", "What is DNA?"]
    assert {p.category for p in made} == {"self-instruct"}


def test_distill_refuses_prompt_weight_with_a_data_folder(tmp_path):
    corpus.save_prompts(tmp_path / "held-out.jsonl.gz", [])
    argv = ["--target", "default", "--out", str(tmp_path), "--data", str(tmp_path), "--prompt-weight", "0.1"]
    with pytest.raises(SystemExit, match="no argmax over prompts"):
        distill_cli.config_from_args(argv)
