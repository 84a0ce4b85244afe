"""End-to-end over real gRPC and a real redis-server, with tiny random models (fast, exact ids)."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis
import torch
from harness import InProcessStack
from opentelemetry import trace

from coordinator.replicas import BackendUnavailable
from coordinator.sessions import SessionRecord
from draft_service.engine import ModelDrafter, NgramDrafter
from specdec import Client, InvalidArgument, SessionNotFound, Unavailable
from specdec.chat_templates import resolve_chat_template
from specdec.models import load_model
from specdec.sampling import Sampling, warp_probs
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from target_service.engine import TargetEngine

PROMPTS = ["w1 w2 w3", "w7 w7 w8 w9 w10", "w20 w3 w3 w3", "w5", "w11 w12 w13 w11 w12"]


def hf_greedy(loaded, prompt: str, max_new_tokens: int) -> list[int]:
    """Target-only greedy decoding with HF generate, in process: the reference."""
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
    with torch.inference_mode():
        out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def stack(tiny_target, tiny_draft, tiny_dir, redis_url):
    """Tiny target plus a different tiny model draft, one coordinator, real Redis."""
    s = InProcessStack(TargetEngine(tiny_target, 64), ModelDrafter(tiny_draft, 64, 64), tiny_dir / "target", redis_url)
    s.start()
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack.address, timeout=60) as c:
        yield c


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_target_only(client, tiny_target, k):
    for prompt in PROMPTS:
        result = client.complete(prompt, max_new_tokens=40, k=k)
        assert result.token_ids == hf_greedy(tiny_target, prompt, 40), prompt
        assert result.stats.rounds < len(result.token_ids) or result.stats.accepted_tokens == 0


def test_target_only_k0_equals_target(client, tiny_target):
    result = client.complete(PROMPTS[0], max_new_tokens=30, k=0)
    assert result.token_ids == hf_greedy(tiny_target, PROMPTS[0], 30)
    assert result.stats.drafted_tokens == 0 and result.stats.rounds == len(result.token_ids)


def test_ngram_draft_greedy_equals_target(tiny_target, tiny_dir, redis_url):
    facts = tiny_target.facts("ngram")
    s = InProcessStack(
        TargetEngine(tiny_target, 8), NgramDrafter(facts, 8, 3, 1), tiny_dir / "target", redis_url
    ).start()
    try:
        with Client(s.address) as c:
            for prompt in PROMPTS:
                result = c.complete(prompt, max_new_tokens=40, k=4)
                assert result.token_ids == hf_greedy(tiny_target, prompt, 40)
    finally:
        s.close()


def test_draft_equal_to_target_accepts_everything(tiny_target, tiny_dir, redis_url):
    k = 4
    s = InProcessStack(TargetEngine(tiny_target, 8), ModelDrafter(tiny_target, 8, 64), tiny_dir / "target", redis_url)
    s.start()
    try:
        with Client(s.address) as c:
            result = c.complete("w7 w7 w8 w9 w10", max_new_tokens=4 * (k + 1), k=k)
    finally:
        s.close()
    assert result.finish_reason == "length"
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.rounds == 4 and result.stats.mean_accepted_length == k + 1


class OpenAIPenalties:
    """OpenAI's presence and frequency penalties over the tokens generated after ``prompt_len``, as a
    transformers logits processor: the reference, written apart from ``specdec.sampling``."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids.tolist()):
            output = ids[self.prompt_len :]
            for token in set(output):
                scores[row, token] -= self.frequency * output.count(token) + self.presence
        return scores


PENALTIES = dict(presence_penalty=0.9, frequency_penalty=0.6, repetition_penalty=1.3, logit_bias={5: 2.5, 1: -100.0})


def hf_penalised_greedy(loaded, prompt: str, max_new_tokens: int) -> list[int]:
    """Target-only greedy decoding with HF generate and the equivalent logits processors, in the order
    specdec applies them: logit bias, repetition penalty, then presence and frequency penalties."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
    processors = LogitsProcessorList(
        [
            SequenceBiasLogitsProcessor({(t,): b for t, b in PENALTIES["logit_bias"].items()}),
            RepetitionPenaltyLogitsProcessor(PENALTIES["repetition_penalty"]),
            OpenAIPenalties(len(ids), PENALTIES["presence_penalty"], PENALTIES["frequency_penalty"]),
        ]
    )
    with torch.inference_mode():
        out = loaded.model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, logits_processor=processors
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("k,tree_nodes", [(0, 0), (3, 0), (6, 0), (3, 6)], ids=["k0", "k3", "k6", "tree6"])
def test_penalised_greedy_equals_penalised_target_only(client, tiny_target, k, tree_nodes):
    """Greedy speculation with penalties and a logit bias gives the penalised target's own greedy
    tokens (HF generate with the same logits processors), chains and trees alike."""
    for prompt in PROMPTS:
        want = hf_penalised_greedy(tiny_target, prompt, 30)
        got = client.complete(prompt, max_new_tokens=30, k=k, tree_nodes=tree_nodes, **PENALTIES)
        assert got.token_ids == want, prompt
        # The penalties change the answer (EOS is banned, so it runs the whole length).
        assert want != hf_greedy(tiny_target, prompt, 30) and len(want) == 30


def test_penalties_count_only_this_turns_output(client, tiny_target):
    """A session's second turn counts its own output only: its answer equals a fresh request's over
    the whole history, whose prompt is what the first turn committed."""
    first = client.complete("w1 w2 w3", max_new_tokens=8, k=3, presence_penalty=1.5, frequency_penalty=1.0)
    second = client.complete(
        " w4", max_new_tokens=12, k=3, presence_penalty=1.5, frequency_penalty=1.0, session_id=first.session_id
    )
    history = tiny_target.tokenizer.encode("w1 w2 w3", add_special_tokens=False) + first.token_ids
    history += tiny_target.tokenizer.encode(" w4", add_special_tokens=False)
    fresh = client.complete(
        tiny_target.tokenizer.decode(history), max_new_tokens=12, k=0, presence_penalty=1.5, frequency_penalty=1.0
    )
    assert tiny_target.tokenizer.encode(tiny_target.tokenizer.decode(history), add_special_tokens=False) == history
    assert second.token_ids == fresh.token_ids


def test_stream_chunks_add_up_to_complete(client):
    chunks = list(client.stream(PROMPTS[1], max_new_tokens=25, k=3))
    final = chunks[-1]
    assert final.finish_reason in ("length", "stop") and final.stats is not None
    assert all(c.stats is None for c in chunks[:-1])
    done = client.complete(PROMPTS[1], max_new_tokens=25, k=3)
    assert [t for c in chunks for t in c.token_ids] == done.token_ids
    assert "".join(c.text for c in chunks) == done.text


def test_seeded_sampling_repeats(client):
    runs = [client.complete(PROMPTS[0], max_new_tokens=30, temperature=1.0, seed=1234, k=3) for _ in range(3)]
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
    other = [client.complete(PROMPTS[0], max_new_tokens=30, temperature=1.0, seed=s, k=3).token_ids for s in range(5)]
    assert len({tuple(o) for o in other}) > 1, "different seeds should give different samples"


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper critical value of chi-square at p = 0.001 (Wilson-Hilferty approximation)."""
    a = 2.0 / (9.0 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi_square_passes(client, loaded, sampling: Sampling, n: int, k: int = 3) -> tuple[int, int]:
    """Samples the first token after a prompt ``n`` times through the stack, checks it against the
    target's own distribution (chi-square, p = 0.001), and returns (accepted, drafted) tokens."""
    prompt = "w1 w2 w3"
    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids])).logits[0, -1:]
    p = warp_probs(logits, sampling)[0]
    counts = torch.zeros_like(p)
    accepted = drafted = 0

    def draw(seed: int):
        return client.complete(
            prompt,
            max_new_tokens=2,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=seed,
            k=k,
        )

    # A few requests in flight at once: each is mostly round trips, so they overlap well.
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(draw, range(n)))
    for result in results:
        counts[result.token_ids[0]] += 1
        accepted += result.stats.accepted_tokens
        drafted += result.stats.drafted_tokens
    assert counts[p == 0].sum() == 0, "sampled a token outside the target's support"
    expected = p * n
    # Pool bins with fewer than 5 expected draws so the chi-square approximation holds.
    big = expected >= 5
    observed_bins = torch.cat([counts[big], counts[~big].sum().view(1)])
    expected_bins = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = expected_bins > 0
    chi2 = float(((observed_bins[keep] - expected_bins[keep]) ** 2 / expected_bins[keep]).sum())
    assert chi2 < _chi_square_critical(int(keep.sum()) - 1), f"chi2={chi2:.1f}"
    return accepted, drafted


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.8, top_k=10, top_p=0.9)], ids=["plain", "warped"])
def test_sampled_tokens_follow_target_distribution(client, tiny_target, sampling):
    # 700 draws over the 32-token vocabulary (bins expecting fewer than 5 are pooled): the rule's
    # statistical power lives in tests/test_sampling.py and tests/test_picking.py; this checks the wiring.
    accepted, drafted = chi_square_passes(client, tiny_target, sampling, n=700)
    # Both acceptance and resampling were exercised.
    assert 0 < accepted < drafted


def test_trace_has_one_trace_across_services(stack, client):
    stack.exporter.clear()
    result = client.complete(PROMPTS[2], max_new_tokens=12, k=3)
    spans = stack.exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "specdec.generate"]
    assert len(roots) == 1
    trace_id = roots[0].context.trace_id
    assert {s.context.trace_id for s in spans} == {trace_id}
    rounds = [s for s in spans if s.name == "specdec.round"]
    assert len(rounds) == result.stats.rounds
    assert all(r.parent.span_id == roots[0].context.span_id for r in rounds)
    for r in rounds:
        assert {"specdec.k", "specdec.accepted", "specdec.draft_ms", "specdec.verify_ms"} <= set(r.attributes)
    round_ids = {r.context.span_id for r in rounds}
    verifies = [s for s in spans if s.name == "TargetService/Verify"]
    proposes = [s for s in spans if s.name == "DraftService/Propose"]
    assert len(verifies) == result.stats.rounds and proposes
    assert all(s.parent.span_id in round_ids for s in verifies + proposes)
    assert roots[0].attributes["gen_ai.usage.output_tokens"] == len(result.token_ids)
    assert roots[0].attributes["gen_ai.usage.input_tokens"] == 4
    assert sum(r.attributes["specdec.accepted"] for r in rounds) == result.stats.accepted_tokens


def test_second_coordinator_continues_session(stack, client, tiny_target):
    other = stack.add_coordinator()
    first = client.complete("w1 w2", max_new_tokens=10, k=3)
    with Client(other) as c2:
        second = c2.complete("w9 w4", max_new_tokens=10, k=3, session_id=first.session_id)
    assert second.session_id == first.session_id
    assert second.stats.prompt_tokens == 2 + len(first.token_ids) + 2
    # One coordinator, same conversation, fresh session: the same answer.
    again = client.complete("w1 w2", max_new_tokens=10, k=3)
    again2 = client.complete("w9 w4", max_new_tokens=10, k=3, session_id=again.session_id)
    assert again2.token_ids == second.token_ids
    full = "w1 w2 " + tiny_target.tokenizer.decode(first.token_ids) + " w9 w4"
    assert second.token_ids == hf_greedy(tiny_target, full, 10)


def _record(redis_url: str, session_id: str) -> SessionRecord:
    raw = redis.Redis.from_url(redis_url).get(f"specdec:session:{session_id}")
    return SessionRecord.from_json(raw)


def test_session_record_in_redis(client, redis_url):
    result = client.complete("w3 w4", max_new_tokens=8, k=2)
    record = _record(redis_url, result.session_id)
    assert record.tokens[-len(result.token_ids) :] == result.token_ids
    assert record.target is not None and record.draft is not None
    ttl = redis.Redis.from_url(redis_url).ttl(f"specdec:session:{result.session_id}")
    assert 0 < ttl <= 3600


def test_dropped_draft_cache_still_exact(stack, client, redis_url, tiny_target):
    first = client.complete("w1 w2", max_new_tokens=10, k=3)
    record = _record(redis_url, first.session_id)
    with grpc.insecure_channel(stack.draft_address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        assert stub.Release(common_pb2.ReleaseRequest(cache_id=record.draft.cache_id)).released
        second = client.complete("w9 w4", max_new_tokens=10, k=3, session_id=first.session_id)
        # Mid-stream: drop the draft cache after the first chunk.
        stream = client.stream("w5 w6 w7", max_new_tokens=30, k=3)
        chunks = [next(stream)]
        rec = _record(redis_url, chunks[0].session_id)
        stub.Release(common_pb2.ReleaseRequest(cache_id=rec.draft.cache_id))
        chunks += list(stream)
    full = "w1 w2 " + tiny_target.tokenizer.decode(first.token_ids) + " w9 w4"
    assert second.token_ids == hf_greedy(tiny_target, full, 10)
    assert [t for c in chunks for t in c.token_ids] == hf_greedy(tiny_target, "w5 w6 w7", 30)


def test_a_release_that_keeps_the_cache_only_says_the_turn_ended(stack, client, redis_url, tiny_target):
    """``keep_cache``: the replicas keep the session's caches (its next turn reuses them, exactly)."""
    first = client.complete("w1 w2", max_new_tokens=10, k=3)
    record = _record(redis_url, first.session_id)
    keep = common_pb2.ReleaseRequest(keep_cache=True)
    with grpc.insecure_channel(stack.target_address) as target, grpc.insecure_channel(stack.draft_address) as draft:
        keep.cache_id = record.target.cache_id
        assert not target_pb2_grpc.TargetServiceStub(target).Release(keep).released
        keep.cache_id = record.draft.cache_id
        assert not draft_pb2_grpc.DraftServiceStub(draft).Release(keep).released
    second = client.complete("w9 w4", max_new_tokens=10, k=3, session_id=first.session_id)
    again = _record(redis_url, first.session_id)
    assert (again.target.cache_id, again.draft.cache_id) == (record.target.cache_id, record.draft.cache_id)
    full = "w1 w2 " + tiny_target.tokenizer.decode(first.token_ids) + " w9 w4"
    assert second.token_ids == hf_greedy(tiny_target, full, 10)


def test_stop_string_is_never_streamed(client, tiny_target):
    reference = client.complete(PROMPTS[0], max_new_tokens=30, k=3)
    words = reference.text.split()
    stop = words[3]
    chunks = list(client.stream(PROMPTS[0], max_new_tokens=30, k=3, stop=[stop]))
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop"
    assert stop not in text
    assert reference.text.startswith(text)


BAD = [
    (dict(prompt=""), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=10_000), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=1e-40), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(stop=["w2"] * 17), "stop"),
    (dict(stop=["w2 " * 100]), "stop"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.1), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(k=33), "k"),
    (dict(k=-1), "k"),
    (dict(prompt="w1 " * 300), "prompt"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={32: 1.0}), "logit_bias"),  # the tiny vocabulary has 32 tokens
    (dict(logit_bias={3: 101.0}), "logit_bias"),
]


@pytest.mark.parametrize("overrides,field", BAD, ids=[f for _, f in BAD])
def test_bad_input_is_invalid_argument(client, overrides, field):
    options = dict(prompt="w1 w2", max_new_tokens=5) | overrides
    prompt = options.pop("prompt")
    with pytest.raises(InvalidArgument) as err:
        client.complete(prompt, **options)
    assert field in err.value.details
    # The service is still up.
    assert client.complete("w1 w2", max_new_tokens=3).token_ids


def test_unknown_session_is_not_found(client):
    with pytest.raises(SessionNotFound, match="session_id"):
        client.complete("w1", max_new_tokens=3, session_id="no-such-session")
    # Beside a session's record, Redis holds its fence counter under the id plus ":fence".
    session = client.complete("w1", max_new_tokens=2).session_id
    with pytest.raises(SessionNotFound, match="session_id"):
        client.complete("w1", max_new_tokens=3, session_id=session + ":fence")
    assert client.complete("w2", max_new_tokens=2, session_id=session).session_id == session


def test_garbled_and_oversized_messages(stack, client):
    with grpc.insecure_channel(stack.address) as channel:
        call = channel.unary_unary("/specdec.v1.Coordinator/Complete")
        with pytest.raises(grpc.RpcError) as err:
            call(b"\xff\xff\xff\xff\x0f garbage", timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            call(b"\x0a" + b"\x80\x80\x80\x08" + b"x" * (9 * 1024 * 1024), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.complete("w1 w2", max_new_tokens=3).token_ids


def test_unreachable_target_is_unavailable(tiny_target, tiny_draft, tiny_dir, redis_url):
    s = InProcessStack(TargetEngine(tiny_target, 8), ModelDrafter(tiny_draft, 8, 64), tiny_dir / "target", redis_url)
    s.start()
    try:
        s.run(s._servers[0].stop(0))
        with Client(s.address) as c:
            with pytest.raises(Unavailable, match="target"):
                c.complete("w1 w2", max_new_tokens=5, k=2, timeout=20)
    finally:
        s.close()


def test_a_clients_spent_deadline_rests_no_replica(tiny_target, tiny_draft, tiny_dir, redis_url):
    """A call that fails because the request's own deadline has passed says nothing about the replica:
    it must not rest, or every session on it would fail for the rest period. Whether the client's
    cancellation or the target's DEADLINE_EXCEEDED arrives first is a race, so the loop is driven
    directly with the deadline already spent, as on a retry after the first attempt used it up."""

    class SlowPrefill(TargetEngine):
        def prefill(self, *args, **kwargs):
            time.sleep(0.05)  # far beyond the 1 ms a spent deadline leaves a call
            return super().prefill(*args, **kwargs)

    s = InProcessStack(SlowPrefill(tiny_target, 8), ModelDrafter(tiny_draft, 8, 64), tiny_dir / "target", redis_url)
    s.start()
    try:
        loop = s.round_loops[0]
        with pytest.raises(BackendUnavailable, match="DEADLINE_EXCEEDED"):
            s.run(loop.router.place_target([3, 4, 5], lambda: 0.0, trace.INVALID_SPAN, 0))
        assert loop.router.members()[1] == {s.target_address} and loop.router.targets.usable(s.target_address)
        with Client(s.address) as c:
            assert c.complete("w1 w2", max_new_tokens=5, timeout=20).token_ids == hf_greedy(tiny_target, "w1 w2", 5)
    finally:
        s.close()


def test_a_resting_lone_target_is_tried_rather_than_failing_every_stream(tiny_target, tiny_draft, tiny_dir, redis_url):
    """One failed call rests a replica. With no other target to go to, new and running sessions try
    the resting one (here it is fine) instead of all failing UNAVAILABLE for the rest period."""
    s = InProcessStack(TargetEngine(tiny_target, 8), ModelDrafter(tiny_draft, 8, 64), tiny_dir / "target", redis_url)
    s.start()
    try:
        loop = s.round_loops[0]
        with Client(s.address) as c:
            first = c.complete("w1 w2", max_new_tokens=3)
            loop.router.targets.failed(s.target_address)  # another session's call failed once
            assert not loop.router.targets.usable(s.target_address)
            assert c.complete("w1 w2", max_new_tokens=5).token_ids == hf_greedy(tiny_target, "w1 w2", 5)
            loop.router.targets.failed(s.target_address)
            assert c.complete("w3", max_new_tokens=3, session_id=first.session_id).session_id == first.session_id
    finally:
        s.close()


def test_a_draft_call_that_took_in_a_prompt_is_not_priced_as_a_draft(tiny_target, tiny_draft, tiny_dir, redis_url):
    """A session's first draft call first prefills the draft with the whole prompt. Priced as a draft
    of its k, that one slow call kept that k (and, through the per-token average, longer ones) from
    being chosen again; only the rounds' own calls may price drafting."""

    class SlowPrefill(ModelDrafter):
        def prefill(self, *args, **kwargs):
            time.sleep(0.5)
            return super().prefill(*args, **kwargs)

    s = InProcessStack(TargetEngine(tiny_target, 8), SlowPrefill(tiny_draft, 8, 64), tiny_dir / "target", redis_url)
    s.start()
    try:
        costs = s.round_loops[0].policy.costs
        with Client(s.address) as c:
            result = c.complete("w1 w2 w3", max_new_tokens=12, k=2, timeout=20)
        assert result.token_ids == hf_greedy(tiny_target, "w1 w2 w3", 12)
        calls = result.stats.drafted_at_position[0]
        assert calls >= 3 and sum(costs._draft_counts.values()) == calls - 1  # all but the first
        assert costs._draft_calls[2] < 250 and costs.draft_ms_per_token < 125
    finally:
        s.close()


def test_unreachable_draft_costs_speed_not_the_request(tiny_target, tiny_draft, tiny_dir, redis_url):
    s = InProcessStack(TargetEngine(tiny_target, 8), ModelDrafter(tiny_draft, 8, 64), tiny_dir / "target", redis_url)
    s.start()
    try:
        s.run(s._servers[1].stop(0))
        with Client(s.address) as c:
            for prompt in PROMPTS[:2]:
                result = c.complete(prompt, max_new_tokens=20, k=2, timeout=20)
                assert result.token_ids == hf_greedy(tiny_target, prompt, 20)
                assert result.stats.drafted_tokens == 0
        spans = [sp for sp in s.exporter.get_finished_spans() if sp.name == "specdec.round"]
        assert any(e.name == "specdec.draft_failed" for sp in spans for e in sp.events)
    finally:
        s.close()


def test_context_limit_ends_generation(client, tiny_target):
    prompt = " ".join(["w4"] * 250)  # the tiny model's context is 256
    result = client.complete(prompt, max_new_tokens=50, k=3)
    if result.finish_reason != "stop":  # EOS can come first; otherwise the context must end it
        assert result.finish_reason == "context"
        assert result.stats.prompt_tokens + len(result.token_ids) == tiny_target.max_context


def test_health_and_reflection(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for address, service in (
        (stack.address, "specdec.v1.Coordinator"),
        (stack.draft_address, "specdec.v1.DraftService"),
        (stack.target_address, "specdec.v1.TargetService"),
    ):
        with grpc.insecure_channel(address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            names = {s.name for reply in replies for s in reply.list_services_response.service}
            assert service in names and "grpc.health.v1.Health" in names


def test_async_client(stack, tiny_target):
    import asyncio

    from specdec import AsyncClient

    async def scenario():
        async with AsyncClient(stack.address) as c:
            done = await c.complete(PROMPTS[0], max_new_tokens=12, k=2)
            streamed = [chunk async for chunk in c.stream(PROMPTS[0], max_new_tokens=12, k=2)]
            with pytest.raises(InvalidArgument):
                await c.complete("", max_new_tokens=3)
        return done, streamed

    done, streamed = asyncio.run(scenario())
    assert done.token_ids == hf_greedy(tiny_target, PROMPTS[0], 12)
    assert [t for c in streamed for t in c.token_ids] == done.token_ids


def test_mismatched_tokenizer_is_refused(tiny_target, tiny_dir, redis_url, tmp_path):
    from tiny import make_model

    from coordinator.server import IncompatibleReplicas
    from specdec.models import load_model

    other = load_model(str(make_model(tmp_path / "other", seed=3, words=[f"v{i}" for i in range(30)])), tmp_path)
    s = InProcessStack(
        TargetEngine(tiny_target, 8), NgramDrafter(other.facts("ngram"), 8, 3, 1), tiny_dir / "target", redis_url
    )
    try:
        with pytest.raises(IncompatibleReplicas, match="tokenizer"):
            s.start()
    finally:
        s.close()


def test_targets_serving_different_models_are_refused(tiny_target, tiny_draft, tiny_dir, redis_url):
    """The tiny draft shares the target's tokenizer, vocabulary, context and end tokens, but is another
    model: a session moved onto it would go on with other output."""
    from coordinator.server import IncompatibleReplicas

    s = InProcessStack(TargetEngine(tiny_target, 8), ModelDrafter(tiny_draft, 8, 64), tiny_dir / "target", redis_url)
    try:
        s.start()
        other = s.add_target(TargetEngine(tiny_draft, 8))
        with pytest.raises(IncompatibleReplicas, match="every target must serve the same model"):
            s.add_coordinator(target_addresses=(s.target_address, other))
        assert s.add_coordinator(target_addresses=(s.target_address, s.add_target(TargetEngine(tiny_target, 8))))
    finally:
        s.close()


def test_random_requests_get_only_documented_statuses(stack, client):
    import random

    from specdec.client import build_request
    from specdec.v1 import coordinator_pb2_grpc

    rng = random.Random(0)
    words = ["w1", "w2", "w30", "zz", "", " ", "\u00e9\u00e8", "<eos>"]
    allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
    seen = set()
    with grpc.insecure_channel(stack.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        for i in range(300):
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(0, 6)))
            if rng.random() < 0.2:
                prompt = [{"role": rng.choice(["user", "assistant", "system", "robot"]), "content": prompt}]
            request = build_request(
                prompt,
                max_new_tokens=rng.choice([-1, 0, 1, 3, 300, 2**31 - 1]) % 2**32,
                temperature=rng.choice([0.0, 0.7, -1.0, float("nan"), 1e9]),
                top_k=rng.choice([0, 1, 5, -3, 2**31 - 1]),
                top_p=rng.choice([1.0, 0.5, 0.0, 1.5, -0.1]),
                seed=rng.choice([None, 0, 2**64 - 1]),
                stop=rng.choice([(), ("w2",), ("",)]),
                session_id=rng.choice([None, "nope", ""]),
                k=rng.choice([None, 0, 3, 32, 33, -5]),
            )
            try:
                stub.Complete(request, timeout=30)
                seen.add("OK")
            except grpc.RpcError as err:
                assert err.code() in allowed, (i, request, err.code(), err.details())
                seen.add(err.code())
    assert "OK" in seen and grpc.StatusCode.INVALID_ARGUMENT in seen
    assert client.complete("w1 w2", max_new_tokens=3).token_ids


def test_chat_needs_a_template_and_takes_a_named_one(stack, client, tiny_target):
    # The tiny tokenizer, like Gemma 3's GGUF, ships no chat template: chat is refused, the rest served.
    messages = [{"role": "user", "content": "w1 w2"}]
    with pytest.raises(InvalidArgument, match="no chat template.*--chat-template"):
        client.complete(messages, max_new_tokens=4)
    assert client.complete(PROMPTS[0], max_new_tokens=8).token_ids == hf_greedy(tiny_target, PROMPTS[0], 8)
    with Client(stack.add_coordinator(chat_template=resolve_chat_template("chatml")), timeout=60) as named:
        result = named.complete(messages, max_new_tokens=12)
    rendered = tiny_target.tokenizer.apply_chat_template(
        messages, chat_template=resolve_chat_template("chatml"), add_generation_prompt=True, tokenize=False
    )
    assert result.token_ids == hf_greedy(tiny_target, rendered, 12)


def test_logprobs_come_from_the_target_and_ignore_speculation(tiny_dir, redis_url):
    # Each token's entry is the target's own: its top alternative is the greedy token, and drafting
    # (any k, chains or trees; a draft equal to the target, so drafts are accepted) changes nothing,
    # streamed or whole. The packed kernels keep a row's bits whatever the pass's rows.
    target = load_model(str(tiny_dir / "target"), tiny_dir, pack=True)
    s = InProcessStack(TargetEngine(target, 8), ModelDrafter(target, 8, 64), tiny_dir / "target", redis_url).start()
    try:
        with Client(s.address, timeout=60) as client:
            alone = client.complete(PROMPTS[1], max_new_tokens=24, k=0, top_logprobs=3)
            assert alone.logprobs is not None and len(alone.logprobs) == len(alone.token_ids)
            for token, entry in zip(alone.token_ids, alone.logprobs):
                assert entry.token == token and entry.top[0][0] == token and len(entry.top) == 3
                assert entry.logprob == entry.top[0][1] <= 0
            for options in ({"k": 4}, {"k": 3, "tree_nodes": 6}):
                drafted = client.complete(PROMPTS[1], max_new_tokens=24, top_logprobs=3, **options)
                assert drafted.stats.accepted_tokens > 0 and drafted.logprobs == alone.logprobs
            chunks = client.stream(PROMPTS[1], max_new_tokens=24, k=4, top_logprobs=3)
            assert [e for c in chunks for e in c.logprobs or ()] == alone.logprobs
            assert client.complete(PROMPTS[1], max_new_tokens=4).logprobs is None
            with pytest.raises(InvalidArgument, match="top_logprobs"):
                client.complete(PROMPTS[1], max_new_tokens=4, top_logprobs=21)
    finally:
        s.close()
