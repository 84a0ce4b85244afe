"""Prefix reuse: a new session copies the state another cache holds for its first tokens.

A session whose prompt starts like another's (a shared system prompt, a template, the same prompt
again) copies that cache's KV, or a feature draft's features, instead of computing them. The copy is
what feeding the tokens computes, bit for bit, so the next pass scores as a fresh prefill's would;
only a prefix of at least the configured length is copied, the longest one held; a scored prompt
(prompt logprobs) computes every position; and the scheduler feeds only what the copy lacks.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_fork import (  # noqa: F401 - feature_draft: a fixture shared with the fork tests
    DRAFT,
    PROMPT_IDS,
    feature_draft,
    kv_equal,
    logits_after,
    round_call,
)

from draft_service.distill.features import sample_features
from draft_service.engine import FeatureDrafter
from specdec.kvcache import CacheTable, HiddenRows
from specdec.sampling import Sampling
from target_service.engine import TargetEngine
from target_service.scheduler import PrefillPlan, TargetScheduler

# Shares its first 100 tokens with PROMPT_IDS, then goes its own way.
OTHER_IDS = PROMPT_IDS[:100] + [9] * 20


@pytest.mark.parametrize("defer", [False, True], ids=["fed", "deferred"])
def test_a_reused_prefix_scores_as_a_fresh_prefill(tiny_target, defer):
    """The copy holds the KV a prefill computes; the rest is fed (now, or by the first round); the
    next pass's logits and the round's verdict are a fresh engine's, bit for bit; the hidden states
    start where the copy ends."""
    engine = TargetEngine(tiny_target, 16, reuse_min=16)
    engine.prefill(PROMPT_IDS)
    reused, length, hidden = engine.prefill(OTHER_IDS, with_hidden=True, defer=defer)
    assert length == 120 and (engine.reused_rows, engine.prefill_rows) == (100, 119 + (0 if defer else 19))
    assert hidden is None if defer else hidden.start == 100 and len(hidden.rows) == 19
    alone = TargetEngine(tiny_target, 16)  # no other cache to copy: computes every position
    fresh, _, want = alone.prefill(OTHER_IDS, with_hidden=True)
    assert kv_equal(engine.caches.get(reused), alone.caches.get(fresh), 100)
    if not defer:
        assert torch.equal(hidden.rows, want.rows[100:])
    assert torch.equal(logits_after(engine, reused, DRAFT), logits_after(alone, fresh, DRAFT))
    got = engine.verify_batch([round_call(reused, 120, 0)])[0]
    expected = alone.verify_batch([round_call(fresh, 120, 0)])[0]
    assert got.tokens == expected.tokens and got.logprobs == expected.logprobs


def test_only_a_long_enough_prefix_is_copied_and_never_for_a_scored_prompt(tiny_target):
    engine = TargetEngine(tiny_target, 16, reuse_min=101)
    engine.prefill(PROMPT_IDS)
    engine.prefill(OTHER_IDS)  # 100 shared tokens: one short of the minimum
    assert engine.reused_rows == 0
    engine.prefill_scored(PROMPT_IDS, 2)  # a scored prompt computes every position
    assert engine.reused_rows == 0
    engine.prefill(PROMPT_IDS)
    assert engine.reused_rows == 119  # all but the last token, which a round feeds
    off = TargetEngine(tiny_target, 16)
    off.prefill(PROMPT_IDS)
    off.prefill(PROMPT_IDS)
    assert off.reused_rows == 0


def test_the_table_copies_the_longest_prefix_held():
    table = CacheTable(8, reuse_min=2)
    short, _ = table.create([1, 2, 3, 4])
    table.get(short).kv_tokens = [1, 2]  # state for two positions
    long_, _ = table.create([1, 2, 3, 9])
    table.get(long_).kv_tokens = [1, 2, 3]
    assert table.prefix_source([1, 2, 3, 4, 5]) == long_
    assert table.prefix_source([1, 5, 6]) is None  # one shared token: under the minimum
    assert table.prefix_source([7, 2, 3]) is None
    assert CacheTable(8).prefix_source([1, 2, 3, 4, 5]) is None  # reuse off


def test_a_feature_draft_copies_the_features_it_holds_for_the_prefix(feature_draft, tiny_target):  # noqa: F811
    """A feature draft's new session copies another's target features for their shared prefix, so
    given only the rows after it, it proposes what a fresh session given every row proposes."""
    engine = FeatureDrafter(feature_draft, tiny_target.facts("target"), 8, 64, lookup_min=0, reuse_min=16)
    source, committed = engine.prefill(PROMPT_IDS)
    prompt_rows = sample_features(tiny_target.model, [PROMPT_IDS])[0].float()[:-1]  # [119, D]
    engine.propose(source, committed, [], 3, Sampling(), 0, HiddenRows(0, prompt_rows))
    assert engine.caches.get(source).reusable(OTHER_IDS) == 100
    feats = sample_features(tiny_target.model, [OTHER_IDS])[0].float()[:-1]
    reused, _ = engine.prefill(OTHER_IDS)
    assert engine.caches.get(reused).copied_end == 100
    got = engine.propose(reused, 120, [], 3, Sampling(), 0, HiddenRows(100, feats[100:]))
    alone = FeatureDrafter(feature_draft, tiny_target.facts("target"), 8, 64, lookup_min=0)
    fresh, _ = alone.prefill(OTHER_IDS)
    assert got.tokens == alone.propose(fresh, 120, [], 3, Sampling(), 0, HiddenRows(0, feats)).tokens
    assert len(got.tokens) == 3


def test_the_scheduler_feeds_only_what_the_copy_lacks(tiny_target):
    """A chunked prompt whose first 100 tokens were copied is fed from there, a chunk a pass."""
    engine = TargetEngine(tiny_target, 16, reuse_min=16)
    engine.prefill(PROMPT_IDS)
    before = engine.prompt_rows

    async def main() -> tuple[str, int, HiddenRows | None]:
        with ThreadPoolExecutor(1) as executor:
            scheduler = TargetScheduler(engine, executor, 64, prefill_chunk=8)
            return await scheduler.prefill(OTHER_IDS, True, 0, PrefillPlan(True, False))

    cache_id, committed, hidden = asyncio.run(main())
    assert committed == 120 and engine.prompt_rows - before == 19
    assert hidden is not None and hidden.start == 100 and len(hidden.rows) == 19
    assert engine.caches.get(cache_id).kv_tokens == OTHER_IDS[:119]  # copied, then fed up to the last token
