"""Grouped-query SDPA for masked passes computes exactly what transformers' sdpa attention does."""

from __future__ import annotations

import pytest
import torch

from specdec.gqa_attention import GQA_SDPA, use_gqa_sdpa
from specdec.kvcache import SessionCache
from specdec.models import load_model


@pytest.fixture(scope="module")
def pair(tiny_dir):
    """The tiny target twice: as transformers loads it, and switched to grouped-query SDPA."""
    plain = load_model(str(tiny_dir / "target"), tiny_dir).model
    grouped = load_model(str(tiny_dir / "target"), tiny_dir).model
    assert plain.config.num_key_value_heads < plain.config.num_attention_heads  # the case that matters
    assert use_gqa_sdpa(grouped)
    assert grouped.config._attn_implementation == GQA_SDPA and plain.config._attn_implementation == "sdpa"
    return plain, grouped


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_verify_pass_logits_are_bit_identical(pair, rows):
    context = [3, 4, 5, 9, 10, 11, 12, 7, 8]
    logits = []
    for model in pair:
        cache = SessionCache(committed=list(context))
        cache.prefill(model)
        logits.append(cache.forward(model, [6, 13, 14, 15][: rows - 1], rows))  # [rows, V]
    assert torch.equal(logits[0], logits[1])


def test_greedy_generation_is_unchanged(pair):
    plain, grouped = pair
    ids = torch.tensor([[3, 4, 5, 9, 10]])
    with torch.inference_mode():
        assert torch.equal(plain.generate(ids, max_new_tokens=20, do_sample=False),
                           grouped.generate(ids, max_new_tokens=20, do_sample=False))


def test_models_on_other_attention_are_left_alone(tiny_dir):
    model = load_model(str(tiny_dir / "target"), tiny_dir).model
    model.set_attn_implementation("eager")
    assert not use_gqa_sdpa(model)
    assert model.config._attn_implementation == "eager"
