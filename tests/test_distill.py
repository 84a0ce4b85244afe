"""`specdec distill` and the token draft: pipeline end to end on the tiny target, what it refuses (a
target family it makes no draft for, a collection with nothing to train on), the draft's contract
with ModelDrafter (drop-in forward, cache semantics, exact zeros outside its head), the target
identity check, and the shipped default draft."""

from __future__ import annotations

import copy
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tiny import make_family_model

from bench.single import PROMPTS
from draft_service.distill import cli as distill_cli
from draft_service.distill import pipeline
from draft_service.distill.collect import Sample
from draft_service.distill.evaluate import evaluate, rounds_from_matches
from draft_service.distill.prompts import Prompt, build_prompts, harvest_stdlib, split_prompts
from draft_service.engine import ModelDrafter
from draft_service.token_draft import (
    CARD_FILE,
    WEIGHTS_FILE,
    TokenDraftArch,
    build_token_draft,
    load_token_draft,
    save_token_draft,
    target_weights_hash,
    wrap_token_draft,
)
from specdec.config import shipped_draft
from specdec.kvcache import SessionCache
from specdec.models import LoadedModel
from specdec.sampling import Sampling

SHIPPED = shipped_draft("smollm2-135m-token")
MAX_BYTES = 25 * 1024 * 1024


def _tiny_prompts(n: int, seed: int, stdlib=None) -> list[Prompt]:
    """Prompts in the tiny tokenizer's 30 words (the real templates would all map to <unk> there)."""
    r = random.Random(seed)
    return [Prompt("tiny", text=" ".join(f"w{r.randrange(30)}" for _ in range(r.randint(3, 10)))) for _ in range(n)]


def _card_for(draft, target: LoadedModel) -> dict:
    return {
        "kind": "token",
        "target": {"name": target.name, "weights_sha256": target_weights_hash(target.model)},
        "architecture": draft.arch.to_json(),
    }


def _write_draft(folder: Path, draft, target: LoadedModel) -> Path:
    save_token_draft(draft, folder)
    (folder / CARD_FILE).write_text(json.dumps(_card_for(draft, target)))
    return folder


@pytest.fixture(scope="module")
def distilled(tiny_dir, tmp_path_factory):
    """A short distillation of the tiny target, run through the CLI entry point (then resumed once)."""
    orig_build, orig_harvest = pipeline.build_prompts, pipeline.harvest_stdlib
    pipeline.build_prompts, pipeline.harvest_stdlib = _tiny_prompts, lambda: []
    root = tmp_path_factory.mktemp("distill")
    argv = [
        "--target",
        str(tiny_dir / "target"),
        "--out",
        str(root / "draft"),
        "--work",
        str(root / "work"),
        "--cache-dir",
        str(tiny_dir),
        "--minutes",
        "1",
        "--tokens",
        "1500",
        "--prompts",
        "400",
        "--held-out",
        "24",
        "--batch-size",
        "32",
        "--max-new",
        "24",
        "--eval-max-new",
        "32",
        "--layers",
        "1",
        "--init-from",
        "1",
        "--head-size",
        "24",
        "--lr",
        "3e-3",
        "--epochs",
        "30",
        "--batch-tokens",
        "2048",
        "--threads",
        "1",
    ]
    try:
        assert distill_cli.main(argv[:-2] + ["--threads", "1", "--collect-only", "--tokens", "600"]) == 0
        assert distill_cli.main(argv + ["--resume"]) == 0
    finally:
        pipeline.build_prompts, pipeline.harvest_stdlib = orig_build, orig_harvest
    return root


def test_distilled_draft_beats_random_drafts(distilled, tiny_target):
    card = json.loads((distilled / "draft" / CARD_FILE).read_text())
    held = card["metrics"]["held_out"]
    untrained = card["metrics"]["held_out_untrained"]
    assert held["positions"] > 200
    assert held["top1_agreement"] > untrained["top1_agreement"] + 0.1, (held, untrained)
    # A draft with randomly initialised layers over the same head, scored on the same references.
    loaded = load_token_draft(distilled / "draft", tiny_target)
    random_draft = build_token_draft(tiny_target.model, loaded.model.head_ids, TokenDraftArch(1, (1,), 24))
    torch.manual_seed(0)
    for p in random_draft.layers.parameters():
        torch.nn.init.normal_(p, std=0.05)
    references = pipeline.load_shards(distilled / "work" / "eval-held-out")
    assert evaluate(loaded.model, references)["top1_agreement"] == held["top1_agreement"]
    assert held["top1_agreement"] > evaluate(random_draft, references)["top1_agreement"] + 0.1
    assert held["mean_accepted_length"] > untrained["mean_accepted_length"]


def test_card_records_recipe_and_resume(distilled):
    card = json.loads((distilled / "draft" / CARD_FILE).read_text())
    assert card["kind"] == "token"
    assert card["recipe"]["command"].startswith("specdec distill --target ")
    assert "--resume" in card["recipe"]["command"]
    data = card["recipe"]["data"]
    # The resumed run kept the 600 collected tokens' shards and collected up to the larger budget.
    assert 1500 <= data["train_generated_tokens"] < 1500 + 32 * 24
    assert card["training"]["steps"] >= 10
    assert len(card["metrics"]["held_out"]["acceptance_by_position"]) == 4
    assert (distilled / "work" / "checkpoint-token.pt").exists()


def test_logits_are_minus_inf_outside_head(tiny_target):
    head = torch.tensor([1, 3, 5, 7, 11, 13, 17, 19, 23, 29])
    draft = build_token_draft(tiny_target.model, head, TokenDraftArch(1, (0,), len(head))).eval()
    with torch.inference_mode():
        logits = draft(input_ids=torch.tensor([[2, 4, 6, 8, 10]])).logits  # [1, 5, V]
    assert logits.shape == (1, 5, tiny_target.vocab_size)
    finite = torch.isfinite(logits[0])
    outside = torch.ones(tiny_target.vocab_size, dtype=torch.bool)
    outside[head] = False
    assert finite[:, head].all()
    assert not finite[:, outside].any()
    assert torch.all(torch.softmax(logits[0], -1)[:, outside] == 0)


def test_cached_steps_equal_uncached_forward(tiny_target):
    draft = build_token_draft(tiny_target.model, torch.arange(20), TokenDraftArch(2, (1, 0), 20)).eval()
    tokens = [int(t) for t in torch.randint(0, 32, (30,), generator=torch.Generator().manual_seed(3))]
    with torch.inference_mode():
        full = draft(input_ids=torch.tensor([tokens])).logits[0]  # [30, V]
    cache = SessionCache(committed=tokens[:12])
    cache.prefill(draft)
    steps = [cache.forward(draft, [], logits_to_keep=1)]  # position 11
    steps.append(cache.forward(draft, tokens[12:15], logits_to_keep=3))  # positions 12..14 in one pass
    cache.sync(12, tokens[12:16])
    for i in range(15, 30):
        steps.append(cache.forward(draft, [], logits_to_keep=1))  # position i
        if i + 1 < 30:
            cache.sync(i + 1, [tokens[i + 1]])
    # Speculative tokens, then a crop back (SessionCache.trim uses crop(-n)).
    cache.forward(draft, [0, 0, 0], logits_to_keep=1)
    cache.sync(20, [])
    steps.append(cache.forward(draft, [], logits_to_keep=1))  # position 19 again
    stepped = torch.cat(steps)  # [1 + 3 + 15 + 1, V]
    expected = torch.cat([full[11:30], full[19:20]])
    assert torch.equal(torch.isfinite(stepped), torch.isfinite(expected))
    mask = torch.isfinite(expected)
    assert torch.allclose(stepped[mask], expected[mask], atol=1e-4, rtol=1e-4)
    assert cache.kv.get_seq_length() == 20


def test_model_drafter_drop_in(tiny_target, tmp_path):
    head = torch.arange(2, 26)
    draft = build_token_draft(tiny_target.model, head, TokenDraftArch(1, (0,), len(head)))
    loaded = load_token_draft(_write_draft(tmp_path / "d", draft, tiny_target), tiny_target)
    assert loaded.facts("model").fingerprint == tiny_target.fingerprint
    assert (loaded.vocab_size, loaded.eos_token_ids, loaded.name) == (
        tiny_target.vocab_size,
        tiny_target.eos_token_ids,
        str(tmp_path / "d"),
    )
    drafter = ModelDrafter(loaded, 8, 64)
    drafter.warmup()
    cache_id, committed = drafter.prefill([3, 4, 5, 6, 7])
    greedy = drafter.propose(cache_id, committed, [], 4, Sampling(), 0)
    assert len(greedy.tokens) == 4 and greedy.q == []
    assert all(2 <= t < 26 for t in greedy.tokens)
    with torch.inference_mode():  # greedy proposals are the draft's own argmax chain
        ids, expect = [3, 4, 5, 6, 7], []
        for _ in range(4):
            expect.append(int(loaded.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            ids.append(expect[-1])
    assert greedy.tokens == expect
    sampling = Sampling(temperature=1.0, seed=5)
    sampled = drafter.propose(cache_id, committed, [greedy.tokens[0]], 4, sampling, 1)
    again = drafter.propose(cache_id, committed, [greedy.tokens[0]], 4, sampling, 1)
    assert sampled.tokens == again.tokens and len(sampled.q) == 4
    for token, (ids_, probs) in zip(sampled.tokens, sampled.q):
        assert token in ids_ and all(2 <= t < 26 for t in ids_)
        assert abs(sum(probs) - 1) < 1e-4


def test_int8_draft_keeps_the_contract(tiny_target, tmp_path):
    head = torch.arange(4, 28)
    draft = build_token_draft(tiny_target.model, head, TokenDraftArch(2, (0, 1), len(head)))
    folder = _write_draft(tmp_path / "d", draft, tiny_target)
    fp32 = load_token_draft(folder, tiny_target)
    int8 = load_token_draft(folder, tiny_target, int8=True)
    ids = torch.tensor([[3, 9, 14, 22, 5, 7]])
    with torch.inference_mode():
        a, b = fp32.model(input_ids=ids).logits, int8.model(input_ids=ids).logits  # [1, 6, V]
    assert torch.equal(torch.isfinite(a), torch.isfinite(b))
    assert torch.isfinite(b[0, :, head]).all()
    assert (a[torch.isfinite(a)] - b[torch.isfinite(b)]).abs().max() < 0.5  # close, not equal
    drafter = ModelDrafter(int8, 4, 64)
    cache_id, committed = drafter.prefill([3, 9, 14])
    assert all(4 <= t < 28 for t in drafter.propose(cache_id, committed, [], 4, Sampling(), 0).tokens)


def test_target_hash_mismatch_raises(tiny_target, tmp_path):
    draft = build_token_draft(tiny_target.model, torch.arange(32), TokenDraftArch(1, (0,), 32))
    folder = _write_draft(tmp_path / "d", draft, tiny_target)
    other_model = copy.deepcopy(tiny_target.model)
    with torch.no_grad():
        other_model.model.layers[1].mlp.up_proj.weight[0, 0] += 1e-3
    other = replace(tiny_target, model=other_model)
    expected, actual = target_weights_hash(tiny_target.model), target_weights_hash(other_model)
    assert expected != actual
    with pytest.raises(ValueError) as err:
        load_token_draft(folder, other)
    assert expected in str(err.value) and actual in str(err.value)
    assert target_weights_hash(tiny_target.model) == expected  # stable


def test_rounds_from_matches():
    # k=4: round 1 accepts 2 (T T F), round 2 from token 3 accepts 4 (T T T T), round 3 at token 8 has no room.
    m = [True, True, False, True, True, True, True, False, True]
    assert rounds_from_matches(m, 4) == [2, 4]
    assert rounds_from_matches([False] * 6, 4) == [0, 0]
    assert rounds_from_matches([True] * 4, 4) == []


def test_evaluate_counts_a_perfect_draft(tiny_target):
    # The draft equal to the target (both its layers, its whole vocabulary) agrees everywhere.
    draft = build_token_draft(tiny_target.model, torch.arange(32), TokenDraftArch(2, (0, 1), 32)).eval()
    prompt = [3, 4, 5]
    with torch.inference_mode():
        out = tiny_target.model.generate(
            torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=1
        )[0].tolist()
    sample = Sample(out, len(prompt), out[len(prompt) :], 0.0)
    result = evaluate(draft, [sample])
    assert result["top1_agreement"] == 1.0
    assert result["acceptance_by_position"] == [1.0] * 4 and result["mean_accepted_length"] == 5.0


def test_prompt_set_is_broad_seeded_and_split():
    stdlib = harvest_stdlib(max_files=60)
    assert len(stdlib) > 50 and all(f.doc and f.signature.startswith(("def ", "async def ")) for f in stdlib)
    prompts = build_prompts(600, seed=7, stdlib=stdlib)
    assert prompts == build_prompts(600, seed=7, stdlib=stdlib)
    assert len({p.key for p in prompts}) == 600
    categories = {p.category for p in prompts}
    assert {"code", "code-stdlib", "chat", "summarisation", "qa", "maths", "translation"} <= categories
    assert any(p.text and p.text.startswith("def ") for p in prompts)  # raw stdlib completions
    train, held = split_prompts(prompts, 40, seed=7)
    assert len(held) == 40 and not {p.key for p in train} & {p.key for p in held}
    bench = pipeline.read_prompt_file(PROMPTS)  # the benchmark never leaks into the training prompts
    texts = [m for p in bench for m in ([p.text] if p.text else [c for _, c in p.messages])]
    assert not {p.key for p in bench} & {p.key for p in prompts}
    assert not any(t in p.key for t in texts if len(t) > 40 for p in prompts)


# The default draft is not trained yet (issue 3 stays open); these run once it ships.
needs_shipped = pytest.mark.skipif(not SHIPPED.is_dir(), reason="drafts/smollm2-135m-token is not shipped yet")


@needs_shipped
def test_shipped_draft_artifact():
    size = sum(f.stat().st_size for f in SHIPPED.rglob("*") if f.is_file())
    assert size < MAX_BYTES
    card = json.loads((SHIPPED / CARD_FILE).read_text())
    assert card["kind"] == "token"
    assert len(card["target"]["weights_sha256"]) == 64
    recipe = card["recipe"]
    assert (
        recipe["command"].startswith("specdec distill ")
        and "seed" in recipe
        and recipe["data"]["train_generated_tokens"] > 0
    )
    assert card["training"]["seconds"] > 0
    held = card["metrics"]["held_out"]
    assert 0 < held["top1_agreement"] <= 1 and held["k"] == 4
    assert len(held["acceptance_by_position"]) == 4 and held["mean_accepted_length"] >= 1
    with safe_open(str(SHIPPED / WEIGHTS_FILE), "pt") as f:
        for name in f.keys():
            t = f.get_slice(name)
            shape = t.get_shape()
            assert 49152 not in shape, f"{name} {shape} looks like target vocabulary weights"
            if t.get_dtype() not in ("I32", "I64"):
                assert t.get_dtype() in ("F16", "BF16")


@needs_shipped
def test_shipped_draft_loads_for_default_target(default_model):
    loaded = load_token_draft(SHIPPED, default_model)
    drafter = ModelDrafter(loaded, 4, 64)
    ids = default_model.tokenizer.encode("def add(a, b):\n    return", add_special_tokens=False)
    cache_id, committed = drafter.prefill(ids)
    proposal = drafter.propose(cache_id, committed, [], 4, Sampling(), 0)
    head = set(loaded.model.head_ids.tolist())
    assert len(proposal.tokens) == 4 and all(t in head for t in proposal.tokens)
    wrapped = wrap_token_draft(loaded.model, default_model, "x")
    assert wrapped.tokenizer is default_model.tokenizer


def test_a_feature_distillation_can_start_from_a_draft_and_skip_its_prompts(tiny_target, tiny_dir, tmp_path):
    """``--init-draft`` starts the run from a distilled feature draft (its head kept, the card naming
    it and scoring the start) and ``--prompt-offset`` collects from later training prompts only."""
    from draft_service.feature_draft import FeatureDraftArch, build_feature_draft, save_feature_draft

    source = tmp_path / "source"
    draft = build_feature_draft(tiny_target.model, torch.arange(5, 29), FeatureDraftArch(head_size=24))
    save_feature_draft(draft, source)
    card = {
        "kind": "feature",
        "target": {"name": "tiny", "weights_sha256": target_weights_hash(tiny_target.model)},
        "architecture": draft.arch.to_json(),
        "recipe": {"command": "specdec distill --kind feature", "seed": 0},
    }
    (source / CARD_FILE).write_text(json.dumps(card))
    orig_build, orig_harvest = pipeline.build_prompts, pipeline.harvest_stdlib
    pipeline.build_prompts, pipeline.harvest_stdlib = _tiny_prompts, lambda: []
    argv = [
        "--target",
        str(tiny_dir / "target"),
        "--kind",
        "feature",
        "--out",
        str(tmp_path / "draft"),
        "--work",
        str(tmp_path / "work"),
        "--cache-dir",
        str(tiny_dir),
        "--minutes",
        "0.5",
        "--tokens",
        "300",
        "--prompts",
        "200",
        "--held-out",
        "12",
        "--batch-size",
        "16",
        "--max-new",
        "12",
        "--eval-max-new",
        "12",
        "--epochs",
        "2",
        "--batch-tokens",
        "1024",
        "--threads",
        "1",
        "--side-layers",
        "0",
        "--init-draft",
        str(source),
        "--prompt-offset",
        "40",
    ]
    try:
        assert distill_cli.main(argv) == 0
    finally:
        pipeline.build_prompts, pipeline.harvest_stdlib = orig_build, orig_harvest
    made = json.loads((tmp_path / "draft" / CARD_FILE).read_text())
    assert made["training"]["started_from"]["path"] == str(source)
    assert made["recipe"]["settings"]["prompt_offset"] == 40
    assert "held_out_start" in made["metrics"] and "held_out_untrained" not in made["metrics"]
    train_prompts, _ = split_prompts(_tiny_prompts(200, 0), 12, 0)
    first = pipeline.load_shards(tmp_path / "work" / "data")[0]
    tokenizer = tiny_target.tokenizer
    assert first.tokens[: first.prompt_len] == train_prompts[40].render(tokenizer)
    with safe_open(str(tmp_path / "draft" / WEIGHTS_FILE), "pt") as f:
        assert f.get_tensor("head_ids").tolist() == list(range(5, 29))


def _small_run(target: Path, tmp_path: Path, cache_dir: Path, *extra: str) -> list[str]:
    """``specdec distill`` flags of a run of a few seconds on a tiny ``target``, then ``extra``."""
    return [
        "--target",
        str(target),
        "--out",
        str(tmp_path / "draft"),
        "--work",
        str(tmp_path / "work"),
        "--cache-dir",
        str(cache_dir),
        "--minutes",
        "0.3",
        "--tokens",
        "200",
        "--prompts",
        "40",
        "--held-out",
        "4",
        "--batch-size",
        "8",
        "--max-new",
        "8",
        "--eval-max-new",
        "8",
        "--layers",
        "1",
        "--init-from",
        "1",
        "--head-size",
        "24",
        "--threads",
        "1",
        *extra,
    ]


def test_distill_refuses_an_unsupported_family_before_any_work(tmp_path, monkeypatch, capsys):
    """A GPT-2 target (no draft is made of its layers) is refused from its config alone: no model
    loaded, no prompt built, no folder made; the message names the target's family and every
    supported one."""
    target = make_family_model(tmp_path / "gpt2", "gpt2", seed=0)

    def no_work(*args, **kwargs):
        raise AssertionError("distill started work for a target it refuses")

    monkeypatch.setattr(pipeline, "load_model", no_work)
    monkeypatch.setattr(pipeline, "build_prompts", no_work)
    monkeypatch.setattr(pipeline, "harvest_stdlib", no_work)
    assert distill_cli.main(_small_run(target, tmp_path, tmp_path)) == 1
    err = capsys.readouterr().err
    assert "'gpt2'" in err and "not supported" in err
    assert all(family in err for family in pipeline.DISTILL_FAMILIES)
    assert not (tmp_path / "work").exists() and not (tmp_path / "draft").exists()


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ((), "raise --minutes"),  # the held-out references alone outlast the collection's budget
        (("--prompt-offset", "100"), "no training prompt is left"),
    ],
)
def test_distill_stops_when_collection_produced_no_training_token(tiny_dir, tmp_path, monkeypatch, capsys, extra, why):
    """With nothing collected, the run stops with a message saying why, and writes no draft."""
    monkeypatch.setattr(pipeline, "build_prompts", _tiny_prompts)
    monkeypatch.setattr(pipeline, "harvest_stdlib", lambda: [])
    argv = _small_run(tiny_dir / "target", tmp_path, tiny_dir, *extra)
    if not extra:
        argv[argv.index("--minutes") + 1] = "0.000001"
    assert distill_cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "0 training tokens" in err and why in err, err
    assert pipeline.load_shards(tmp_path / "work" / "data") == []
    assert not (tmp_path / "draft" / CARD_FILE).exists() and not (tmp_path / "draft" / WEIGHTS_FILE).exists()
