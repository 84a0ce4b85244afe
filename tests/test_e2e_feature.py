"""The feature (EAGLE-style) draft end to end over real gRPC with the tiny target: the target's hidden
states travel target -> coordinator -> draft, and speculation stays exact (greedy and sampled)."""

from __future__ import annotations

import json

import pytest
import torch
from harness import InProcessStack
from test_e2e_tiny import PROMPTS, chi_square_passes, hf_greedy

from draft_service.distill.features import sample_features
from draft_service.engine import FeatureDrafter
from draft_service.feature_draft import (
    KIND,
    FeatureDraftArch,
    build_feature_draft,
    load_feature_draft,
    save_feature_draft,
)
from draft_service.token_draft import CARD_FILE, target_weights_hash
from specdec import Client
from specdec.sampling import Sampling
from target_service.engine import TargetEngine


@pytest.fixture(scope="module")
def feature_dir(tiny_target, tmp_path_factory):
    """A feature draft for the tiny target, written and read back as the draft service loads it."""
    torch.manual_seed(3)
    draft = build_feature_draft(tiny_target.model, torch.arange(4, 30), FeatureDraftArch(head_size=26))
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("feature")
    save_feature_draft(draft, folder)
    card = {
        "kind": KIND,
        "target": {"name": "tiny", "weights_sha256": target_weights_hash(tiny_target.model)},
        "architecture": draft.arch.to_json(),
    }
    (folder / CARD_FILE).write_text(json.dumps(card))
    return folder


@pytest.fixture(scope="module")
def stack(tiny_target, tiny_dir, feature_dir, redis_url):
    draft = load_feature_draft(feature_dir, tiny_target.model, target_weights_hash(tiny_target.model))
    engine = FeatureDrafter(draft, tiny_target.facts("target"), 64, 64)
    engine.warmup()
    s = InProcessStack(TargetEngine(tiny_target, 64), engine, tiny_dir / "target", redis_url).start()
    yield s
    s.close()


@pytest.fixture(scope="module")
def side_stack(tiny_target, tiny_dir, redis_url):
    """A stack whose feature draft also reads the target's first layer's output (a side layer)."""
    torch.manual_seed(4)
    arch = FeatureDraftArch(head_size=26, side_layers=(0,))
    draft = build_feature_draft(tiny_target.model, torch.arange(4, 30), arch)
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    engine = FeatureDrafter(draft.eval().requires_grad_(False), tiny_target.facts("target"), 64, 64)
    engine.warmup()
    s = InProcessStack(TargetEngine(tiny_target, 64), engine, tiny_dir / "target", redis_url).start()
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack.address, timeout=60) as c:
        yield c


def test_wrong_target_is_refused(tiny_target, feature_dir):
    with pytest.raises(ValueError, match="sha256"):
        load_feature_draft(feature_dir, tiny_target.model, "0" * 64)


@pytest.mark.parametrize("k", [1, 4, None], ids=["k1", "k4", "auto"])
def test_greedy_equals_target_only_and_drafts(client, tiny_target, k):
    """Fixed k drafts every round; k auto (the confidence cut-off on) may draft less, never differently."""
    drafted = 0
    for prompt in PROMPTS:
        result = client.complete(prompt, max_new_tokens=40, k=k)
        assert result.token_ids == hf_greedy(tiny_target, prompt, 40), prompt
        drafted += result.stats.drafted_tokens
    # A feature draft proposes nothing without the target's hidden states: these prove they arrive.
    assert drafted >= (len(PROMPTS) * 5 if k else 1)


def test_a_draft_with_side_layers_gets_them_and_output_stays_exact(side_stack, tiny_target):
    """The coordinator asks the target for the side layers the draft's card names; the rows the draft
    holds are the target's own [final-norm hidden; layer 0 output] at those positions."""
    with Client(side_stack.address, timeout=60) as client:
        drafted = 0
        for prompt in PROMPTS:
            result = client.complete(prompt, max_new_tokens=30, k=4)
            assert result.token_ids == hf_greedy(tiny_target, prompt, 30), prompt
            drafted += result.stats.drafted_tokens
    assert drafted >= len(PROMPTS) * 5
    sessions = list(side_stack.draft_engine._caches._caches.values())
    assert sessions
    for session in sessions:
        want = sample_features(tiny_target.model, [session.committed], (0,))[0].float()  # [T, 2D]
        got = session.features.float()
        assert got.shape[1] == 2 * tiny_target.model.config.hidden_size
        torch.testing.assert_close(got, want[session.window : session.feature_end], atol=2e-2, rtol=1e-2)


def test_lost_draft_cache_and_next_turn(stack, client, tiny_target):
    first = client.complete(PROMPTS[1], max_new_tokens=20, k=3)
    draft_cache = stack.draft_engine._caches
    for cache_id in list(draft_cache._caches):
        draft_cache.release(cache_id)  # the draft forgets everything, features included
    second = client.complete(" w3 w4", max_new_tokens=20, k=3, session_id=first.session_id)
    ids = tiny_target.tokenizer.encode(PROMPTS[1], add_special_tokens=False) + first.token_ids
    ids += tiny_target.tokenizer.encode(" w3 w4", add_special_tokens=False)
    with torch.inference_mode():
        out = tiny_target.model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids) :]
    assert second.token_ids == out.tolist()
    assert second.stats.drafted_tokens > 0


def test_sampled_tokens_follow_target_distribution(stack, client, tiny_target):
    """k auto, so the draft's confidence cut-off is on: sampled proposals stay exact.

    The requests go four at a time, so the target is busy as prompts arrive; but a seeded sampled
    request's prompt is never deferred (its draws would then depend on load), so every first round
    has its features and drafts, and the first sampled token is a drafted one."""
    stack.exporter.clear()
    accepted, drafted = chi_square_passes(client, tiny_target, Sampling(1.0), n=900, k=None)
    assert 0 < accepted < drafted
    deferred = [
        s.attributes["specdec.deferred"]
        for s in stack.exporter.get_finished_spans()
        if s.name == "TargetService/Prefill"
    ]
    assert len(deferred) == 900 and not any(deferred)


def test_drafting_ahead_keeps_greedy_output_and_serves_rounds(stack, tiny_target):
    """A coordinator that asks the draft to draft ahead: greedy output still equals target-only
    decoding, and some rounds get their proposal from the tokens drafted ahead. A sampled request
    never drafts ahead: whether a round does depends on the load, and its tokens must not."""
    address = stack.add_coordinator(draft_ahead=4)
    ahead_rounds = rounds = sampled_ahead_rounds = 0
    with Client(address, timeout=60) as client:
        for prompt in PROMPTS:
            for k in (1, 2, 3):
                result = client.complete(prompt, max_new_tokens=80, k=k)
                assert result.token_ids == hf_greedy(tiny_target, prompt, 80), (prompt, k)
                ahead_rounds += result.stats.ahead_rounds
                rounds += result.stats.rounds
                # Nearly greedy, so its rounds would take the guessed path about as often.
                sampled = client.complete(prompt, max_new_tokens=80, k=k, temperature=0.05)
                sampled_ahead_rounds += sampled.stats.ahead_rounds
    assert 0 < ahead_rounds < rounds
    assert sampled_ahead_rounds == 0


def test_the_reply_says_when_prompt_lookup_answered_in_place_of_the_model(stack, tiny_target):
    """Over gRPC: a context whose tail occurred before is answered by prompt lookup (the coordinator
    must not price the draft model by that call), one without a repeat by the model."""
    import grpc

    from specdec.hidden_wire import hidden_to_pb
    from specdec.kvcache import HiddenRows
    from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

    stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(stack.draft_address))
    greedy = common_pb2.SamplingParams(temperature=0.0, top_p=1.0)
    for context, looked_up in [([5, 6, 7, 8, 9, 10, 11, 5, 6], True), ([5, 6, 7, 8, 9, 10, 11, 12, 13], False)]:
        cache_id = stub.Prefill(common_pb2.PrefillRequest(tokens=context)).cache_id
        feats = sample_features(tiny_target.model, [context])[0].float()
        reply = stub.Propose(
            draft_pb2.ProposeRequest(
                sync=common_pb2.CacheSync(cache_id=cache_id, start=len(context)),
                k=3,
                sampling=greedy,
                hidden=hidden_to_pb(HiddenRows(0, feats[:-1])),
            )
        )
        assert len(reply.tokens) == 3 and reply.looked_up == looked_up, context
        if looked_up:
            assert list(reply.tokens) == [7, 8, 9]
