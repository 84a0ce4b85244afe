"""``specdec distill --prompts-file``: the user's prompts (OpenAI ``messages`` JSONL, ShareGPT JSON) read,
validated line by line, deduplicated and split per category by conversation; end to end on the tiny
target (the card's data record and held-out figures by category); ``--device``/``--dtype``; progress."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path

import pytest
import torch

from draft_service.distill import cli as distill_cli
from draft_service.distill import pipeline
from draft_service.distill.config import DistillConfig
from draft_service.distill.placement import Placement, resolve_placement
from draft_service.distill.progress import Progress
from draft_service.distill.user_prompts import (
    Conversation,
    PromptFileError,
    load_user_prompts,
    parse_prompts_file,
    split_conversations,
)
from draft_service.token_draft import CARD_FILE
from specdec.models import native_bf16


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _words(r: random.Random, n: int) -> str:
    """Text in the tiny tokenizer's 30 words (anything else would all map to <unk> there)."""
    return " ".join(f"w{r.randrange(30)}" for _ in range(n))


# ---------------------------------------------------------------- reading and validating


def test_jsonl_reads_messages_prompts_and_content_parts(tmp_path):
    path = _write(
        tmp_path / "p.jsonl",
        [
            {"messages": [{"role": "user", "content": "hi"}]},
            "",  # blank lines are skipped
            {"category": "code", "prompt": "def f():"},
            {
                "messages": [
                    {"role": "developer", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                ]
            },
        ],
    )
    records, fmt = parse_prompts_file(path.read_bytes(), str(path))
    assert fmt == "jsonl"
    assert records == [
        Conversation("user", messages=(("user", "hi"),)),
        Conversation("code", text="def f():"),
        Conversation("user", messages=(("system", "be brief"), ("user", "a\nb"))),
    ]


def test_sharegpt_maps_roles_and_gives_one_prompt_per_human_turn(tmp_path):
    data = [
        {
            "id": "x",
            "conversations": [
                {"from": "system", "value": "S"},
                {"from": "human", "value": "Q1"},
                {"from": "gpt", "value": "A1"},
                {"from": "human", "value": "Q2"},
                {"from": "gpt", "value": "A2"},
            ],
        },
        {"category": "maths", "conversations": [{"from": "human", "value": "2+2?"}]},
    ]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data, indent=2))
    records, fmt = parse_prompts_file(path.read_bytes(), str(path))
    assert fmt == "sharegpt"
    first = records[0]
    assert first.messages == (("system", "S"), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A2"))
    # The target writes each assistant turn itself: the logged answers are context, never a prompt's end.
    assert [p.messages for p in first.prompts()] == [
        (("system", "S"), ("user", "Q1")),
        (("system", "S"), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2")),
    ]
    assert records[1].category == "maths" and len(records[1].prompts()) == 1


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "line 3: not JSON"),
        ('{"messages": [{"role": "tool", "content": "x"}]}', "line 3: messages[1]: role 'tool' is not one of"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "line 3: no user turn"),
        ('{"messages": [{"role": "user", "content": "  "}]}', "line 3: messages[1]: empty 'content'"),
        ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "line 3: messages[1]: 'content'"),
        ('{"text": "x"}', "line 3: expected a 'messages' list"),
        ('{"prompt": "x", "category": 3}', "line 3: 'category' must be"),
        ("[1]", "line 3: expected a JSON object"),
    ],
)
def test_a_bad_jsonl_line_is_named_by_its_number(tmp_path, line, says):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}, line, {"prompt": "c"}])
    with pytest.raises(PromptFileError) as e:
        parse_prompts_file(path.read_bytes(), str(path))
    assert str(e.value).startswith(f"{path}: ") and says in str(e.value), str(e.value)


def test_every_bad_line_is_listed_up_to_five(tmp_path):
    path = _write(tmp_path / "p.jsonl", ["{bad"] * 8 + [{"prompt": "ok"}])
    message = str(pytest.raises(PromptFileError, parse_prompts_file, path.read_bytes(), str(path)).value)
    assert all(f"line {n}:" in message for n in range(1, 6)) and "line 6:" not in message
    assert "(and 3 more)" in message


def test_a_bad_sharegpt_entry_is_named_by_its_index(tmp_path):
    path = tmp_path / "s.json"
    good = {"conversations": [{"from": "human", "value": "q"}]}
    path.write_text(json.dumps([good, {"conversations": [{"from": "bing", "value": "q"}]}, {"messages": []}]))
    message = str(pytest.raises(PromptFileError, parse_prompts_file, path.read_bytes(), str(path)).value)
    assert "entry 2: conversations[1]: from 'bing'" in message and "entry 3: expected an object" in message
    path.write_text('[{"conversations": [}]')
    assert "not JSON" in str(pytest.raises(PromptFileError, parse_prompts_file, path.read_bytes(), str(path)).value)
    path.write_text("")
    assert "no prompts" in str(pytest.raises(PromptFileError, parse_prompts_file, b"\n\n", str(path)).value)


# ---------------------------------------------------------------- deduplicating and splitting


def _conversations(counts: dict[str, int]) -> list[Conversation]:
    return [
        Conversation(category, messages=(("user", f"{category} {i}"),))
        for category, n in counts.items()
        for i in range(n)
    ]


def test_split_holds_out_a_share_of_each_category_seeded():
    conversations = _conversations({"big": 200, "mid": 30, "small": 3, "pair": 2, "solo": 1})
    train, held = split_conversations(conversations, share=0.05, cap=6, seed=0)
    count = {c: sum(1 for x in held if x.category == c) for c in ("big", "mid", "small", "pair", "solo")}
    # 5% rounded, at least one where a category can spare it, at most the cap, none of a lone one.
    assert count == {"big": 6, "mid": 2, "small": 1, "pair": 1, "solo": 0}
    assert len(train) + len(held) == len(conversations) and not {c.key for c in train} & {c.key for c in held}
    assert split_conversations(conversations, 0.05, 6, 0) == (train, held)
    assert split_conversations(conversations, 0.05, 6, 1)[1] != held
    # One category's split does not move when another category is added to the file.
    more = split_conversations(conversations + _conversations({"new": 40}), 0.05, 6, 0)[1]
    assert [c for c in more if c.category == "mid"] == [c for c in held if c.category == "mid"]


def test_load_dedupes_and_splits_by_conversation(tmp_path):
    r = random.Random(0)
    lines = []
    for i in range(40):
        opening = {"role": "user", "content": f"hello {i % 20}"}  # pairs of conversations share an opening turn
        lines.append(
            {
                "category": "chat",
                "messages": [
                    opening,
                    {"role": "assistant", "content": _words(r, 3)},
                    {"role": "user", "content": str(i)},
                ],
            }
        )
    lines.append(lines[0])  # an identical conversation
    path = _write(tmp_path / "p.jsonl", lines)
    loaded = load_user_prompts(path, held_out_share=0.1, held_out_cap=10, seed=0)
    assert loaded.conversations == 40 and loaded.duplicate_conversations == 1
    assert loaded.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    keys = [p.key for p in loaded.train + loaded.held_out]
    assert len(keys) == len(set(keys))  # no prompt twice, none both trained on and held out
    # 4 held-out conversations give their 4 second turns and their openings (2 each, as all share one).
    assert sum(1 for p in loaded.held_out if len(p.messages) == 3) == 4
    # 40 conversations give 80 prompts; 20 openings are shared by two: 20 duplicates.
    assert loaded.duplicate_prompts == 20 and len(loaded.train) + len(loaded.held_out) == 60
    assert loaded.record()["duplicate_conversations_dropped"] == 1


# ---------------------------------------------------------------- end to end on the tiny target


def _user_file(tmp_path: Path, sharegpt: bool) -> tuple[Path, dict[str, int]]:
    """A small chat log in the tiny vocabulary: categories of 30, 12 and 1 conversations, some of them
    multi-turn, one duplicated; returns the file and each category's conversation count."""
    r = random.Random(1 if sharegpt else 0)
    counts = {"support": 30, "smalltalk": 12, "lonely": 1}
    records = []
    for category, n in counts.items():
        for i in range(n):
            turns = [("user", f"{_words(r, r.randint(3, 8))} w{i % 30}")]
            if i % 3 == 0:
                turns += [("assistant", _words(r, 4)), ("user", _words(r, 5))]
            records.append((category, turns))
    records.append(records[0])
    if sharegpt:
        who = {"user": "human", "assistant": "gpt"}
        data = [
            {"category": c, "conversations": [{"from": who[role], "value": text} for role, text in turns]}
            for c, turns in records
        ]
        path = tmp_path / "log.json"
        path.write_text(json.dumps(data))
    else:
        path = _write(
            tmp_path / "log.jsonl",
            [{"category": c, "messages": [{"role": role, "content": text} for role, text in t]} for c, t in records],
        )
    return path, counts


def _run_args(tiny_dir: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--target",
        str(tiny_dir / "target"),
        "--out",
        str(tmp_path / "draft"),
        "--work",
        str(tmp_path / "work"),
        "--cache-dir",
        str(tiny_dir),
        "--minutes",
        "0.5",
        "--tokens",
        "600",
        "--batch-size",
        "16",
        "--max-new",
        "16",
        "--eval-max-new",
        "16",
        "--layers",
        "1",
        "--init-from",
        "1",
        "--head-size",
        "24",
        "--epochs",
        "3",
        "--batch-tokens",
        "1024",
        "--threads",
        "1",
        *extra,
    ]


@pytest.mark.parametrize("sharegpt", [False, True], ids=["jsonl", "sharegpt"])
def test_distill_from_a_prompts_file_records_its_data_and_held_out_by_category(
    tiny_dir, tiny_target, tmp_path, monkeypatch, sharegpt
):
    """The file replaces the built-in set (never built), each category holds out 10% of its
    conversations (at least one, none of a lone one), the references are exactly the held-out
    prompts' continuations, and the card records the file, counts and figures by category."""

    def no_builtin(*args, **kwargs):
        raise AssertionError("the built-in prompt set was built for a --prompts-file run")

    monkeypatch.setattr(pipeline, "build_prompts", no_builtin)
    monkeypatch.setattr(pipeline, "harvest_stdlib", no_builtin)
    path, counts = _user_file(tmp_path, sharegpt)
    dtype = "bfloat16" if sharegpt else "float32"  # one run computes under bf16 autocast
    argv = _run_args(tiny_dir, tmp_path, "--prompts-file", str(path), "--held-out-share", "0.1", "--dtype", dtype)
    assert distill_cli.main(argv) == 0

    card = json.loads((tmp_path / "draft" / CARD_FILE).read_text())
    data = card["recipe"]["data"]
    source = data["prompt_source"]
    assert source["kind"] == "file" and source["path"] == str(path)
    assert source["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert source["format"] == ("sharegpt" if sharegpt else "jsonl")
    assert source["conversations"] == sum(counts.values()) and source["duplicate_conversations_dropped"] == 1
    assert card["recipe"]["settings"]["prompts_file"] == str(path)
    assert card["target"]["dtype"] == dtype and card["timing"]["dtype"] == dtype
    assert card["timing"]["train_autocast"] == dtype

    loaded = load_user_prompts(path, 0.1, DistillConfig.held_out_cap, 0)
    held_conversations = {"support": 3, "smalltalk": 1, "lonely": 0}  # round(0.1 n), at least 1 of 2+
    categories = data["categories"]
    assert set(categories) == {"support", "smalltalk", "lonely"}
    for category, n in held_conversations.items():
        held = [p for p in loaded.held_out if p.category == category]
        opened = {p.messages[:1] for p in held}  # each held-out conversation's opening turn
        assert len(opened) == n and categories[category]["held_out_prompts"] == len(held)
    assert categories["lonely"]["train_prompts"] == 1 and categories["lonely"]["held_out_prompts"] == 0
    assert sum(c["train_generated_tokens"] for c in categories.values()) == data["train_generated_tokens"] > 0
    assert sum(c["held_out_generated_tokens"] for c in categories.values()) == data["held_out_generated_tokens"]
    assert data["held_out_prompts"] == len(loaded.held_out)

    # The references are the target's continuations of exactly the held-out prompts, in order.
    references = pipeline.load_shards(tmp_path / "work" / "eval-held-out")
    assert [s.tokens[: s.prompt_len] for s in references] == [p.render(tiny_target.tokenizer) for p in loaded.held_out]
    by_category = card["metrics"]["held_out_by_category"]
    assert set(by_category) == {"support", "smalltalk"}  # nothing of the lone category is held out
    overall = card["metrics"]["held_out"]
    assert sum(m["positions"] for m in by_category.values()) == overall["positions"] > 0
    correct = sum(m["top1_agreement"] * m["positions"] for m in by_category.values())
    assert correct / overall["positions"] == pytest.approx(overall["top1_agreement"], abs=2e-4)


def test_a_bad_prompts_file_is_refused_before_the_target_loads(tiny_dir, tmp_path, monkeypatch, capsys):
    def no_load(*args, **kwargs):
        raise AssertionError("the target loaded for a bad prompts file")

    monkeypatch.setattr(pipeline, "load_model", no_load)
    path = _write(tmp_path / "p.jsonl", [{"prompt": "w1 w2"}, '{"messages": "w1"}'])
    assert distill_cli.main(_run_args(tiny_dir, tmp_path, "--prompts-file", str(path))) == 1
    assert f"{path}: line 2: 'messages' must be a non-empty list" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no such file"):
        distill_cli.config_from_args(_run_args(tiny_dir, tmp_path, "--prompts-file", str(tmp_path / "missing")))


# ---------------------------------------------------------------- device, dtype, progress


def test_device_cuda_is_refused_cleanly_without_cuda(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        distill_cli.config_from_args(_run_args(tiny_dir, tmp_path, "--device", "cuda"))
    assert str(e.value).startswith("specdec distill: --device cuda: no CUDA device is available")
    # With a device present the flag reaches the config (wired, not just parsed).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = distill_cli.config_from_args(_run_args(tiny_dir, tmp_path, "--device", "cuda", "--dtype", "bfloat16"))
    assert (config.device, config.dtype) == ("cuda", "bfloat16")
    assert resolve_placement("cuda", "auto") == Placement("cuda", torch.bfloat16, torch.bfloat16)


def test_dtype_auto_is_bf16_only_where_the_cpu_computes_it():
    expected = torch.bfloat16 if native_bf16("cpu") else torch.float32
    # On a CPU, auto trains in float32 (bf16 autocast steps measured slower there).
    assert resolve_placement("cpu", "auto") == Placement("cpu", expected, torch.float32)
    assert resolve_placement("cpu", "float32") == Placement("cpu", torch.float32, torch.float32)
    assert resolve_placement("cpu", "bfloat16") == Placement("cpu", torch.bfloat16, torch.bfloat16)
    with pytest.raises(SystemExit):
        distill_cli.parser().parse_args(["--target", "x", "--out", "y", "--dtype", "float16"])


def test_progress_bars_only_on_a_terminal_else_log_lines(tiny_dir, tmp_path, caplog):
    # Under pytest stderr is captured, not a terminal: no bar.
    assert distill_cli.config_from_args(_run_args(tiny_dir, tmp_path)).progress is False
    with caplog.at_level(logging.INFO, logger="draft_service.distill.progress"):
        progress = Progress("collect", "tok", 100, bar=False, log_every_s=0.0)
        progress.update(40)
        progress.set_postfix(loss="1.000")
        progress.update(60)
        progress.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("collect: 40/100 tok") and lines[1].startswith("collect: 100/100 tok")
    assert lines[1].endswith("loss=1.000") and len(lines) == 2  # closing logs no repeat of the last count
