"""Decoder families beyond Llama: the ragged pass, the target engine and the whole stack stay exact.

Each family's tiny random model (``tiny.make_family_model``: 2 layers, hidden 32, the shared 32-word
tokenizer) carries the traits the ragged pass must reproduce: projection biases, per-head q/k norms,
Gemma's scaled embedding and ``1 + w`` norms, Gemma 3's four norms a layer, ``query_pre_attn_scalar``
and RoPE table per layer type, Phi-3's fused projections and partial rotary embedding, and sliding
windows of 8 tokens, shorter than every context here.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from harness import InProcessStack
from test_distill import _tiny_prompts
from test_e2e_tiny import PROMPTS, hf_greedy
from tiny import FAMILY_TRAITS, make_family_model

from draft_service.distill import cli as distill_cli
from draft_service.distill import pipeline
from draft_service.engine import ModelDrafter
from draft_service.feature_draft import KIND as FEATURE_KIND
from draft_service.server import build_drafter
from draft_service.token_draft import CARD_FILE
from specdec import Client
from specdec.compiled import CompiledPass
from specdec.config import DraftConfig, ModelConfig
from specdec.kvcache import SessionCache
from specdec.models import LoadedModel, load_model
from specdec.ragged import RAGGED_FAMILIES, RaggedItem, layer_windows, ragged_forward, supports_ragged
from specdec.sampling import Sampling
from target_service.engine import TargetEngine, VerifyCall

FAMILIES = sorted(FAMILY_TRAITS)
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory) -> Path:
    """Where this module's tiny models are saved, one folder per family and role."""
    return tmp_path_factory.mktemp("families")


@pytest.fixture(scope="module")
def family_models(family_dir):
    """``models(family, role)``: the tiny target (2 layers) or draft (1 layer, another seed), loaded once."""
    loaded: dict[tuple[str, str], LoadedModel] = {}

    def models(family: str, role: str = "target") -> LoadedModel:
        if (family, role) not in loaded:
            seed, layers = (0, 2) if role == "target" else (1, 1)
            path = make_family_model(family_dir / f"{family}-{role}", family, seed=seed, layers=layers)
            loaded[family, role] = load_model(str(path), family_dir)
        return loaded[family, role]

    return models


def _sessions(model, lengths: list[int], seed: int) -> list[SessionCache]:
    """Session caches over random prompts, prefilled through transformers' forward as the services do."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        cache = SessionCache(committed=torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist())
        cache.prefill(model)
        out.append(cache)
    return out


def test_every_tested_family_runs_ragged_and_the_list_is_the_supported_one():
    assert set(FAMILIES) == set(RAGGED_FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_pass_equals_a_plain_forward_per_session(family, family_models):
    """Logits of the sessions' last positions, fed together over their own caches, equal a plain
    transformers forward over each whole sequence (no cache); hidden rows equal the session path's."""
    model = family_models(family).model
    assert supports_ragged(model)
    if family in ("mistral", "qwen2", "phi3", "gemma3_text"):
        assert 8 in layer_windows(model.config)  # the window is shorter than the 40-token session
    lengths, extras = [1, 5, 17, 40], [[3], [4, 5, 6], [], [7, 8]]
    batched, alone = _sessions(model, lengths, 0), _sessions(model, lengths, 0)
    logits, hidden = ragged_forward(
        model, [RaggedItem(c.kv, c.pending() + e, len(e) + 1) for c, e in zip(batched, extras)]
    )
    for cache, solo, extra, got_logits, got_hidden in zip(batched, alone, extras, logits, hidden):
        with torch.inference_mode():
            want = model(torch.tensor([cache.committed + extra])).logits[0, -(len(extra) + 1) :].float()  # [k + 1, V]
        torch.testing.assert_close(got_logits, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got_logits.argmax(-1), want.argmax(-1))
        _, rows = solo.forward_with_hidden(model, extra, len(extra) + 1)
        torch.testing.assert_close(got_hidden, rows.rows, atol=1e-4, rtol=1e-4)


def engine_greedy(
    engine: TargetEngine, prompts: list[list[int]], references: list[list[int]], k: int = 3
) -> list[list[int]]:
    """Decodes every prompt at once through ``verify_batch`` (one ragged pass a round for all of them).

    Each round proposes the reference's next ``k`` tokens with the last one changed, so rounds accept
    some tokens and reject one: both the accepted path and the bonus token are checked.
    """
    ids = [engine.prefill(p)[0] for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    while True:
        live = [i for i, ref in enumerate(references) if len(out[i]) < len(ref)]
        if not live:
            return out
        calls = []
        for i in live:
            drafts = references[i][len(out[i]) : len(out[i]) + k]
            if len(drafts) == k:
                drafts = [*drafts[:-1], (drafts[-1] + 1) % engine.facts.vocab_size]
            calls.append(VerifyCall(ids[i], len(prompts[i]) + len(out[i]), [], drafts, [], Sampling(), 0))
        for i, outcome in zip(live, engine.verify_batch(calls)):
            assert not isinstance(outcome, Exception), outcome
            out[i].extend(outcome.tokens)
            out[i] = out[i][: len(references[i])]


@pytest.mark.parametrize("family", FAMILIES)
def test_target_engine_greedy_equals_generate(family, family_models):
    loaded = family_models(family)
    engine = TargetEngine(loaded, 16)
    assert engine.batches
    prompts = [loaded.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    references = [hf_greedy(loaded, p, NEW_TOKENS) for p in PROMPTS]
    assert engine_greedy(engine, prompts, references) == references
    assert engine.largest_pass == len(PROMPTS)


@pytest.mark.parametrize("family", FAMILIES)
def test_stack_greedy_equals_generate_at_concurrency_1_and_4(family, family_models, family_dir, redis_url):
    """Through coordinator, draft (a 1-layer model of the same family) and target over gRPC."""
    target, draft = family_models(family), family_models(family, "draft")
    references = [hf_greedy(target, p, NEW_TOKENS) for p in PROMPTS]
    stack = InProcessStack(
        TargetEngine(target, 16), ModelDrafter(draft, 16, 64), family_dir / f"{family}-target", redis_url
    ).start()
    try:
        with Client(stack.address, timeout=120) as client:
            alone = [client.complete(p, max_new_tokens=NEW_TOKENS, k=3).token_ids for p in PROMPTS]
            with ThreadPoolExecutor(4) as pool:
                together = list(
                    pool.map(lambda p: client.complete(p, max_new_tokens=NEW_TOKENS, k=3).token_ids, PROMPTS)
                )
    finally:
        stack.close()
    assert alone == references
    assert together == references


def test_an_unsupported_family_falls_back_to_one_pass_per_session_and_says_so(family_dir, caplog):
    """Gemma 2 (soft-capped attention logits) has no ragged pass: the engine says so at start-up and
    still decodes exactly, one pass per session."""
    path = make_family_model(
        family_dir / "gemma2", "gemma2", seed=0, head_dim=8, sliding_window=8, hidden_activation="gelu_pytorch_tanh"
    )
    loaded = load_model(str(path), family_dir)
    with caplog.at_level(logging.WARNING, logger="specdec.target"):
        engine = TargetEngine(loaded, 8)
    assert not engine.batches
    assert any("'gemma2'" in r.message and "one pass per session" in r.message for r in caplog.records)
    prompts = [loaded.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS[:2]]
    references = [hf_greedy(loaded, p, NEW_TOKENS) for p in PROMPTS[:2]]
    assert engine_greedy(engine, prompts, references) == references


@pytest.mark.parametrize("family", FAMILIES)
def test_prepacked_linears_keep_the_ragged_pass(family, family_models, family_dir):
    """The services prepack linear layers on a CPU (fused q/k/v with their biases, Phi-3's own fused
    ones): the pass over them gives the plain model's logits up to float rounding."""
    plain = family_models(family).model
    packed = load_model(str(family_dir / f"{family}-target"), family_dir, pack=True).model
    assert any(type(m).__name__ == "PackedLinear" for m in packed.modules())
    logits = []
    for model in (plain, packed):
        cache = _sessions(model, [30], 2)[0]
        logits.append(ragged_forward(model, [RaggedItem(cache.kv, cache.pending() + [3, 4], 3)])[0][0])
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))


@pytest.mark.parametrize("family", ["gemma3_text", "phi3"])
def test_the_compiled_pass_computes_the_familys_layers(family, family_models, family_dir):
    """The families whose layers differ most from Llama's (Gemma 3's four norms, q/k norms, windows and
    RoPE per layer type; Phi-3's fused products): the compiled pass's logits are the eager
    pass's up to float rounding, batch-invariantly (row 0 alone and in a chain of 8)."""
    family_models(family)  # writes the family's tiny target
    packed = load_model(str(family_dir / f"{family}-target"), family_dir, pack=True).model
    runner = CompiledPass(packed, buckets=(2, 8))
    runner.compile()
    cache = _sessions(packed, [30], 2)[0]
    fed = cache.pending() + [3, 4, 5, 6, 7, 8, 9]
    want = ragged_forward(packed, [RaggedItem(cache.kv, fed, 8)])[0][0]
    cache.kv.crop(-8)
    got = runner.forward([RaggedItem(cache.kv, fed, 8)])[0][0]
    cache.kv.crop(-8)
    alone = runner.forward([RaggedItem(cache.kv, fed[:1], 1)])[0][0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1)) and torch.equal(alone[0], got[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_distill_makes_drafts_for_the_family_that_the_stack_serves_exactly(
    family, family_models, family_dir, tmp_path, monkeypatch, redis_url
):
    """``specdec distill`` (a few seconds' worth) makes a token and a feature draft of the family's own
    layers, their cards name its family and dtype, and the draft service serves them from the
    target's files: greedy output through the stack is target-only generate's."""
    monkeypatch.setattr(pipeline, "build_prompts", _tiny_prompts)
    monkeypatch.setattr(pipeline, "harvest_stdlib", lambda: [])
    target_folder = family_dir / f"{family}-target"
    target = family_models(family)
    references = [hf_greedy(target, p, 24) for p in PROMPTS]
    for kind, served_as in (("token", "model"), (FEATURE_KIND, FEATURE_KIND)):
        out = tmp_path / kind
        argv = [
            "--target",
            str(target_folder),
            "--kind",
            kind,
            "--out",
            str(out),
            "--work",
            str(tmp_path / f"w-{kind}"),
            "--cache-dir",
            str(family_dir),
            "--minutes",
            "0.3",
            "--tokens",
            "300",
            "--prompts",
            "60",
            "--held-out",
            "6",
            "--batch-size",
            "16",
            "--max-new",
            "12",
            "--eval-max-new",
            "12",
            "--layers",
            "1",
            "--init-from",
            "1",
            "--head-size",
            "24",
            "--epochs",
            "2",
            "--batch-tokens",
            "512",
            "--threads",
            "1",
            "--dtype",
            "float32",  # what the stack below serves in, on any CPU
        ]
        assert distill_cli.main(argv) == 0
        card = json.loads((out / CARD_FILE).read_text())
        assert (card["target"]["family"], card["target"]["dtype"]) == (family, "float32")
        drafter = build_drafter(
            DraftConfig(
                kind=served_as, target_model=str(target_folder), model=ModelConfig(model=str(out), cache_dir=family_dir)
            )
        )
        layer = drafter._loaded.model.layers[0] if served_as == "model" else drafter._draft_model.layer
        assert type(layer) is type(target.model.get_decoder().layers[0])
        stack = InProcessStack(TargetEngine(target, 8), drafter, target_folder, redis_url).start()
        try:
            with Client(stack.address, timeout=120) as client:
                results = [client.complete(p, max_new_tokens=24, k=3) for p in PROMPTS]
        finally:
            stack.close()
        assert [r.token_ids for r in results] == references, kind
        assert sum(r.stats.accepted_tokens for r in results) > 0, kind
