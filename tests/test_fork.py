"""n > 1 sharing one prefill: a fork copies another session's cache (``PrefillRequest.fork_of``).

The engines' forks hold bit for bit what a prefill computes (the logits that follow are equal); the
services answer a bad fork with NOT_FOUND, RESOURCE_EXHAUSTED or INVALID_ARGUMENT and serve on; the
coordinator prefills a request's prompt once for all its choices, forks the rest on the replica that
holds the source, records each forked session's caches in Redis, and every choice's output is what it
is alone (seeded: choice i equals the request with seed + i; greedy: the single answer).
"""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request
from dataclasses import replace

import grpc
import pytest
import redis
import torch
from harness import InProcessStack
from test_round_loop import make_loop

from coordinator.choices import ChoiceRuns, FirstOfMany, PromptForks, SharedPrefill, choice_requests
from coordinator.hidden_backlog import HiddenBacklog
from coordinator.replicas import CacheRef, HiddenChunk
from coordinator.sessions import SessionRecord
from coordinator.turns import Chunk, GenerationRequest, Stats
from draft_service.distill.features import sample_features
from draft_service.engine import FeatureDrafter, ModelDrafter, NgramDrafter
from draft_service.feature_draft import FeatureDraftArch, build_feature_draft
from draft_service.inprocess import InProcessDraft
from specdec import AsyncClient, Client, InvalidArgument
from specdec.cli import main
from specdec.errors import CacheBudgetExceeded, CacheNotFound
from specdec.kvcache import HiddenRows, kv_buffer_bytes
from specdec.ragged import RaggedItem
from specdec.sampling import Sampling
from specdec.stack import Process, child_env, free_port, wait_for_line
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service.engine import TargetEngine, VerifyCall

# A prompt of 120 tokens over the tiny vocabulary (ids 2..31), with no repeats that prompt lookup
# would take up: long enough that a prefill is most of a short request's target work.
PROMPT_IDS = [2 + (i * 7 + i // 30) % 30 for i in range(120)]
PROMPT = " ".join(f"w{t - 2}" for t in PROMPT_IDS)
DRAFT = [3, 4, 5, 6]


def logits_after(engine: TargetEngine, cache_id: str, extra: list[int]) -> torch.Tensor:
    """The target's logits ``[len(extra) + 1, V]`` of a pass over the cache's pending tokens and
    ``extra``, run on a throwaway copy so the cache is left as it was."""
    cache = engine.caches.get(cache_id).fork(engine.caches.get(cache_id).committed)
    logits, _ = engine.forward([RaggedItem(cache.kv, cache.pending() + extra, len(extra) + 1)])
    return logits[0]


def kv_equal(a, b, rows: int) -> bool:
    """Whether two caches' first ``rows`` KV entries are bit for bit equal, in every layer."""
    return rows == 0 or all(
        torch.equal(x.keys[:, :, :rows], y.keys[:, :, :rows])
        and torch.equal(x.values[:, :, :rows], y.values[:, :, :rows])
        for x, y in zip(a.kv.layers, b.kv.layers, strict=True)
    )


# --- the engines ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def feature_draft(tiny_target):
    """A tiny feature draft over the tiny target, off its pass-through start (as test_feature_draft's)."""
    torch.manual_seed(0)
    d = build_feature_draft(tiny_target.model, torch.arange(4, 28), FeatureDraftArch(head_size=24))
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return d.eval()


@pytest.mark.parametrize("source_state", ["fresh", "after rounds", "deferred", "diverging"])
def test_a_forked_target_cache_equals_a_fresh_prefill(tiny_target, source_state):
    """Whatever the source did after its prefill (rounds that grew and cropped its cache, a deferred
    prompt, a prompt that diverges from the fork's), the fork holds exactly the KV a prefill of the
    fork's tokens computes where they match, leaves the rest pending, and the next pass's logits and
    verdict are bit for bit a fresh prefill's."""
    engine = TargetEngine(tiny_target, 16)
    source_tokens = list(PROMPT_IDS)
    if source_state == "diverging":
        source_tokens[80:] = [9] * 40
    source, committed, _ = engine.prefill(source_tokens, defer=source_state == "deferred")
    if source_state == "after rounds":
        for r in range(3):
            committed = engine.verify(source, committed, [], DRAFT, [], Sampling(), r).committed
    forked, length, copied = engine.fork(source, PROMPT_IDS, fence=7)
    expected_copy = {"fresh": 119, "after rounds": 119, "deferred": 0, "diverging": 80}[source_state]
    assert (length, copied) == (120, expected_copy)
    fresh, _, _ = engine.prefill(PROMPT_IDS)
    fork_cache, fresh_cache = engine.caches.get(forked), engine.caches.get(fresh)
    assert fork_cache.kv_tokens == PROMPT_IDS[:copied] and fork_cache.fence == 7
    assert kv_equal(fork_cache, fresh_cache, copied)
    assert torch.equal(logits_after(engine, forked, DRAFT), logits_after(engine, fresh, DRAFT))
    # The fork's pending rows are fed by its first round, as a deferred prompt's.
    rounds = [engine.verify_batch([round_call(i, 120, fence)])[0] for i, fence in ((forked, 7), (fresh, 0))]
    assert rounds[0].tokens == rounds[1].tokens and rounds[0].logprobs == rounds[1].logprobs
    assert engine.caches.get(source).committed[:80] == source_tokens[:80]  # the source is left as it was


def round_call(cache_id: str, start: int, fence: int) -> VerifyCall:
    """A greedy round verifying DRAFT after ``start`` committed tokens, with logprobs."""
    return VerifyCall(cache_id, start, [], DRAFT, [], Sampling(), 0, fence=fence, top_logprobs=5)


def test_fork_counts_rows_and_refuses_unknown_sources_and_a_full_budget(tiny_target):
    """A fork copies rows instead of feeding them (the counters say which); an unknown source is
    CacheNotFound naming ``fork_of``; a fork the KV budget cannot hold while the other caches are in use
    is refused and not kept, and the source serves on."""
    engine = TargetEngine(tiny_target, 16)
    source, _, _ = engine.prefill(PROMPT_IDS)
    engine.fork(source, PROMPT_IDS)
    assert (engine.prefill_rows, engine.forked_rows) == (119, 119)
    with pytest.raises(CacheNotFound, match="fork_of: no cache 'gone'"):
        engine.fork("gone", PROMPT_IDS)
    with pytest.raises(ValueError, match="tokens"):
        engine.fork(source, [])
    size = kv_buffer_bytes(engine.caches.get(source).kv)
    tight = TargetEngine(tiny_target, 16, budget_bytes=int(1.5 * size))
    kept, _, _ = tight.prefill(PROMPT_IDS)
    with pytest.raises(CacheBudgetExceeded, match="fork_of: no room to copy .* KV cache budget"):
        tight.fork(kept, PROMPT_IDS)
    assert tight.caches.ids() == {kept}
    assert tight.verify(kept, 120, [], DRAFT, [], Sampling(), 0).committed > 120


def test_model_and_ngram_draft_forks_propose_what_a_prefill_proposes(tiny_target, tiny_draft):
    """A model draft's fork copies its KV and computes only the rest; an n-gram draft's holds no KV. Each
    proposes exactly what a session prefilled from scratch proposes."""
    model = ModelDrafter(tiny_draft, 8, 64)
    ngram = NgramDrafter(tiny_target.facts("target"), 8, 4, 2)
    for engine, expect_copied in ((model, 119), (ngram, 0)):
        source, committed = engine.prefill(PROMPT_IDS)
        engine.propose(source, committed, [7, 8], 3, Sampling(), 0)  # the source moves on
        forked, length, copied = engine.fork(source, PROMPT_IDS)
        fresh, _ = engine.prefill(PROMPT_IDS)
        assert (length, copied) == (120, expect_copied)
        for sampling in (Sampling(), Sampling(1.0, seed=3)):
            a = engine.propose(forked, 120, [], 4, sampling, 1)
            b = engine.propose(fresh, 120, [], 4, sampling, 1)
            assert (a.tokens, a.q) == (b.tokens, b.q)
        with pytest.raises(CacheNotFound):
            engine.fork("gone", PROMPT_IDS)


def test_a_feature_draft_fork_keeps_the_prompts_features(feature_draft, tiny_target):
    """A feature draft's fork holds the source's target features and KV pairs for the prompt, so it
    proposes with no hidden rows sent what a fresh session proposes given all of them."""
    engine = FeatureDrafter(feature_draft, tiny_target.facts("target"), 8, 64, lookup_min=0)
    feats = sample_features(tiny_target.model, [PROMPT_IDS])[0].float()
    rows = HiddenRows(0, feats[:-1])  # [119, D]: the prompt's positions but the last
    source, committed = engine.prefill(PROMPT_IDS)
    first = engine.propose(source, committed, [], 3, Sampling(), 0, rows)
    forked, _, copied = engine.fork(source, PROMPT_IDS)
    assert copied == 119 and engine.caches.get(forked).ready()
    fresh, _ = engine.prefill(PROMPT_IDS)
    assert engine.propose(forked, 120, [], 3, Sampling(), 0).tokens == first.tokens
    assert engine.propose(fresh, 120, [], 3, Sampling(), 0, rows).tokens == first.tokens
    assert len(first.tokens) == 3


def test_first_of_many_and_the_hidden_backlog_cut():
    """The first caller builds, the others wait (a cancelled waiter disturbs no one); a failed build
    is None. The backlog drops the rows a draft fork already holds."""

    async def scenario():
        shared: FirstOfMany[int] = FirstOfMany()
        assert shared.first() and not shared.first()
        waiters = [asyncio.create_task(shared.wait()) for _ in range(3)]
        await asyncio.sleep(0)
        waiters[0].cancel()
        shared.settle(42)
        shared.settle(7)  # only the first outcome counts
        assert await asyncio.gather(*waiters[1:]) == [42, 42]
        failed: FirstOfMany[int] = FirstOfMany()
        failed.first()
        failed.settle(None)
        assert await failed.wait() is None

    asyncio.run(scenario())
    backlog = HiddenBacklog(HiddenChunk(0, 2, bytes(range(40))))  # 10 rows of 2 fp16 values
    backlog.drop_before(4)
    message = backlog.message()
    assert message is not None and (message.start, message.rows, message.fp16) == (4, 6, bytes(range(16, 40)))
    backlog.drop_before(20)
    assert backlog.message() is None


# --- the coordinator in process ---------------------------------------------------------------------


class Stopped(BaseException):
    """Not an ``Exception``: an ending that ``except Exception`` lets through."""


@pytest.mark.parametrize("stop", [asyncio.CancelledError, Stopped])
def test_a_choice_stopped_by_a_base_exception_fails_the_request_at_once(stop):
    """A choice's run that ends on something other than an ``Exception`` still queues its end, so the
    reader gets a failure at once instead of waiting for a chunk that never comes."""

    async def finishing():
        yield Chunk("s", "a", [1])
        await asyncio.sleep(0)
        yield Chunk("s", "b", [2], "stop", Stats())

    async def stopping():
        yield Chunk("s", "x", [1])
        raise stop()

    async def scenario() -> tuple[list[tuple[int, str]], BaseException]:
        runs = ChoiceRuns([finishing(), stopping()])
        seen = []
        try:
            with pytest.raises(RuntimeError, match="choice 1 stopped") as raised:
                async with asyncio.timeout(10):
                    async for index, chunk in runs.chunks():
                        seen.append((index, chunk.text))
        finally:
            await runs.close()
        return seen, raised.value

    seen, error = asyncio.run(scenario())
    assert (1, "x") in seen and isinstance(error.__cause__, stop)


def test_choice_runs_end_when_every_choice_has_finished():
    async def finishing(text: str):
        yield Chunk("s", text, [1])
        yield Chunk("s", "!", [2], "stop", Stats())

    async def scenario() -> list[tuple[int, str]]:
        runs = ChoiceRuns([finishing("a"), finishing("b")])
        try:
            async with asyncio.timeout(10):
                return [(index, chunk.text) async for index, chunk in runs.chunks()]
        finally:
            await runs.close()

    seen = asyncio.run(scenario())
    assert sorted(seen) == [(0, "!"), (0, "a"), (1, "!"), (1, "b")]


def test_choices_prefill_once_and_equal_their_single_requests(tiny_target, tiny_draft):
    """Round loop over in-process backends: 4 seeded sampled choices feed the prompt to the target
    once and fork it three times, on the target and the draft; each equals the request with seed + i."""
    loop = make_loop(tiny_target, tiny_draft)
    target = loop.router.targets.by_address["inprocess:target"]._engine
    base = GenerationRequest(None, None, 12, temperature=1.0, seed=5, k=2, prompt_token_ids=tuple(PROMPT_IDS))

    async def scenario():
        fed = target.prefill_rows + target.prompt_rows
        runs = ChoiceRuns([loop.generate(r, lambda: None) for r in choice_requests(base, 4)])
        together: dict[int, list[int]] = {i: [] for i in range(4)}
        try:
            async for index, chunk in runs.chunks():
                together[index] += chunk.token_ids
        finally:
            await runs.close()
        counted = (target.prefill_rows + target.prompt_rows - fed, target.forked_rows)
        alone = []
        for i in range(4):
            alone.append([t async for c in loop.generate(replace(base, seed=5 + i), lambda: None) for t in c.token_ids])
        return together, counted, alone

    together, counted, alone = asyncio.run(scenario())
    assert counted == (119, 3 * 119)
    assert [together[i] for i in range(4)] == alone
    assert len({tuple(t) for t in alone}) > 1


def test_a_lost_source_cache_makes_the_choice_prefill(tiny_target, tiny_draft):
    """A choice whose source cache is gone (evicted, released) by the time it forks prefills its own
    and answers exactly; so does one whose source prefilled other tokens."""
    loop = make_loop(tiny_target, tiny_draft)
    alone = GenerationRequest(None, None, 10, prompt_token_ids=tuple(PROMPT_IDS))

    async def scenario():
        want = [t async for c in loop.generate(alone, lambda: None) for t in c.token_ids]
        got = []
        for shared in (
            SharedPrefill(CacheRef("inprocess:target", "gone", 120), tuple(PROMPT_IDS), None),
            SharedPrefill(CacheRef("inprocess:target", "gone", 5), (1, 2, 3, 4, 5), None),
        ):
            forks = PromptForks()
            forks.target.first()
            forks.target.settle(shared)
            request = replace(alone, forks=forks)
            got.append([t async for c in loop.generate(request, lambda: None) for t in c.token_ids])
        return want, got

    want, got = asyncio.run(scenario())
    assert got == [want, want]


# --- over gRPC: services, coordinator, SDK, HTTP, Redis ---------------------------------------------


@pytest.fixture(scope="module")
def stack(tiny_target, tiny_draft, tiny_dir, redis_url):
    """Tiny target and model draft behind real gRPC servers, one coordinator (serving HTTP), real Redis."""
    s = InProcessStack(TargetEngine(tiny_target, 64), ModelDrafter(tiny_draft, 64, 64), tiny_dir / "target", redis_url)
    s.target_address = s.add_target(s.target_engine)
    s.draft_address = s.add_draft(s.draft_engine)
    s.http_port = free_port()
    s.add_coordinator(http_port=s.http_port)
    yield s
    s.close()


def test_bad_forks_get_their_status_and_the_services_serve_on(stack):
    """Target and draft: an unknown ``fork_of`` is NOT_FOUND naming it; a fork that also scores the
    prompt is INVALID_ARGUMENT; a fork of a known cache then works, reporting the rows it copied."""
    target = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(stack.target_address))
    draft = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(stack.draft_address))
    for stub in (target, draft):
        with pytest.raises(grpc.RpcError) as info:
            stub.Prefill(common_pb2.PrefillRequest(tokens=PROMPT_IDS, fork_of="gone"), timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "fork_of: no cache 'gone'" in info.value.details()
        source = stub.Prefill(common_pb2.PrefillRequest(tokens=PROMPT_IDS, feed_now=True), timeout=30)
        forked = stub.Prefill(common_pb2.PrefillRequest(tokens=PROMPT_IDS, fork_of=source.cache_id), timeout=30)
        assert forked.committed == 120 and forked.copied == 119 and forked.cache_id != source.cache_id
    with pytest.raises(grpc.RpcError) as info:
        target.Prefill(common_pb2.PrefillRequest(tokens=PROMPT_IDS, fork_of="x", prompt_logprobs=2), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in info.value.details()


def test_a_fork_past_the_kv_budget_is_resource_exhausted(tiny_target, tiny_dir, redis_url):
    """A target whose KV budget holds one cache refuses a fork while the source is in use."""
    probe = TargetEngine(tiny_target, 4)
    size = kv_buffer_bytes(probe.caches.get(probe.prefill(PROMPT_IDS)[0]).kv)
    s = InProcessStack(
        TargetEngine(tiny_target, 8, budget_bytes=int(1.5 * size)),
        NgramDrafter(tiny_target.facts("target"), 8, 4, 2),
        tiny_dir / "target",
        redis_url,
    )
    try:
        stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(s.add_target(s.target_engine)))
        source = stub.Prefill(common_pb2.PrefillRequest(tokens=PROMPT_IDS), timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            stub.Prefill(common_pb2.PrefillRequest(tokens=PROMPT_IDS, fork_of=source.cache_id), timeout=30)
        details = info.value.details()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details.startswith(f"fork_of: no room to copy {source.cache_id!r}") and "KV cache budget" in details
        sync = common_pb2.CacheSync(cache_id=source.cache_id, start=120)  # the source serves on
        assert stub.Verify(target_pb2.VerifyRequest(sync=sync, draft_tokens=DRAFT), timeout=30).committed > 120
    finally:
        s.close()


def record_of(redis_url: str, session_id: str) -> SessionRecord:
    raw = redis.Redis.from_url(redis_url).get(f"specdec:session:{session_id}")
    assert raw is not None
    return SessionRecord.from_json(raw)


def test_sdk_choices_share_one_prefill_and_keep_their_own_records(stack, redis_url, monkeypatch):
    """``Client.complete(n=3)``: seeded sampled choices equal the requests with seeds 5, 6, 7; the
    target fed the prompt once and forked it twice, the draft forked its cache too; each choice's
    Redis record names its own caches on the replicas holding the source; a forked session continues
    like any other. Streamed, each chunk carries its choice's index."""
    target, draft = stack.target_engine, stack.draft_engine
    forks = []
    original = draft.fork
    monkeypatch.setattr(draft, "fork", lambda *a, **k: forks.append(a[0]) or original(*a, **k))
    options = dict(prompt_token_ids=PROMPT_IDS, max_new_tokens=12, temperature=1.0, k=2)
    with Client(stack.address, timeout=60) as client:
        fed, forked = target.prefill_rows + target.prompt_rows, target.forked_rows
        whole = client.complete(None, seed=5, n=3, **options)
        assert (target.prefill_rows + target.prompt_rows - fed, target.forked_rows - forked) == (119, 2 * 119)
        assert len(forks) == 2 and len(set(forks)) == 1
        alone = [client.complete(None, seed=5 + i, **options) for i in range(3)]
        assert [c.token_ids for c in whole.choices] == [a.token_ids for a in alone]
        assert whole.token_ids == whole.choices[0].token_ids and len({c.session_id for c in whole.choices}) == 3
        records = [record_of(redis_url, c.session_id) for c in whole.choices]
        for choice, record in zip(whole.choices, records, strict=True):
            assert record.target.address == stack.target_address and record.draft.address == stack.draft_address
            assert record.tokens == PROMPT_IDS + choice.token_ids
            assert target.caches.get(record.target.cache_id).committed[:120] == PROMPT_IDS
        assert len({r.target.cache_id for r in records}) == 3 and len({r.draft.cache_id for r in records}) == 3
        chunks = list(client.stream(None, seed=5, n=3, **options))
        streamed = {i: [t for c in chunks if c.index == i for t in c.token_ids] for i in range(3)}
        assert [streamed[i] for i in range(3)] == [a.token_ids for a in alone]
        assert sorted(c.index for c in chunks if c.finish_reason) == [0, 1, 2]
        # A forked session continues like any other: greedy, its next turn equals a fresh session's.
        after = PROMPT_IDS + whole.choices[1].token_ids + [5, 6]
        more = client.complete(None, prompt_token_ids=[5, 6], max_new_tokens=8, session_id=whole.choices[1].session_id)
        assert more.token_ids == client.complete(None, prompt_token_ids=after, max_new_tokens=8).token_ids
        greedy = client.complete(None, prompt_token_ids=PROMPT_IDS, max_new_tokens=12, n=2)
        single = client.complete(None, prompt_token_ids=PROMPT_IDS, max_new_tokens=12)
        assert [c.token_ids for c in greedy.choices] == [single.token_ids] * 2


def test_sdk_n_is_checked_and_async(stack):
    """n past 64, or several choices with a session to continue, are INVALID_ARGUMENT naming ``n``;
    ``AsyncClient`` takes ``n`` as ``Client`` does."""
    with Client(stack.address, timeout=60) as client:
        for bad in (dict(n=65), dict(n=2, session_id="0" * 32)):
            with pytest.raises(InvalidArgument, match="n: "):
                client.complete("w1 w2", max_new_tokens=2, **bad)
        with pytest.raises(InvalidArgument, match="n: must be an integer"):
            client.complete("w1 w2", max_new_tokens=2, n=0)

    async def run():
        async with AsyncClient(stack.address, timeout=60) as client:
            whole = await client.complete("w1 w2 w3", max_new_tokens=6, n=2, temperature=1.0, seed=9)
            alone = await client.complete("w1 w2 w3", max_new_tokens=6, temperature=1.0, seed=10)
            indices = [c.index async for c in client.stream("w1 w2 w3", max_new_tokens=6, n=2)]
            return whole, alone, indices

    whole, alone, indices = asyncio.run(run())
    assert whole.choices[1].token_ids == alone.token_ids and set(indices) == {0, 1}


def test_cli_generate_prints_each_choice(stack, capsys):
    """``specdec generate --n 2`` prints each choice whole, with its stats."""
    main(["generate", "--address", stack.address, "--raw", "w1 w2 w3", "--n", "2", "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert "--- choice 0 ---" in out and "--- choice 1 ---" in out and out.count("[finish: ") == 2


def test_http_n_choices_share_one_prefill(stack):
    """The OpenAI API's n: the prompt is fed once, and each choice equals the request with seed + i."""
    target = stack.target_engine
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 21}

    def post(extra: dict) -> dict:
        request = urllib.request.Request(
            f"http://127.0.0.1:{stack.http_port}/v1/completions",
            data=json.dumps({**body, **extra}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())

    fed, forked = target.prefill_rows + target.prompt_rows, target.forked_rows
    whole = post({"n": 4})
    assert (target.prefill_rows + target.prompt_rows - fed, target.forked_rows - forked) == (119, 3 * 119)
    alone = [post({"seed": 21 + i})["choices"][0]["text"] for i in range(4)]
    assert [c["text"] for c in whole["choices"]] == alone


def test_a_tensor_parallel_target_forks_on_every_rank(tiny_dir, tmp_path):
    """A target sharded over two processes forks on both ranks (each its own heads' KV): the fork's
    round after it equals a fresh prefill's, and the group stays in step."""
    argv = [sys.executable, "-m", "specdec.cli", "serve-target", "--port", "0", "--model", str(tiny_dir / "target")]
    argv += ["--cache-dir", str(tiny_dir), "--threads", "1", "--tp", "2"]
    proc = Process("target", argv, tmp_path, child_env(1, passive=True))
    try:
        stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(wait_for_line(proc, "READY ", 120.0)))
        source = stub.Prefill(common_pb2.PrefillRequest(tokens=PROMPT_IDS, feed_now=True), timeout=60)
        forked = stub.Prefill(common_pb2.PrefillRequest(tokens=PROMPT_IDS, fork_of=source.cache_id), timeout=60)
        fresh = stub.Prefill(common_pb2.PrefillRequest(tokens=PROMPT_IDS, feed_now=True), timeout=60)
        assert forked.copied == 119
        replies = []
        for cache_id in (forked.cache_id, fresh.cache_id, forked.cache_id):
            sync = common_pb2.CacheSync(cache_id=cache_id, start=120)
            request = target_pb2.VerifyRequest(sync=sync, draft_tokens=DRAFT, top_logprobs=3)
            replies.append(stub.Verify(request, timeout=60))
        assert replies[0].tokens == replies[1].tokens and replies[0].logprobs == replies[1].logprobs
        assert replies[2].committed == replies[0].committed  # the same round again: both ranks in step
        assert proc.popen.poll() is None, proc.log_tail()
    finally:
        proc.stop()


# --- the default target -----------------------------------------------------------------------------


def test_default_target_fork_logits_equal_a_fresh_prefill(default_model):
    """On the real default target: a ~200-token prompt forked from a session that ran rounds gives the
    same logits, bit for bit, as the prompt prefilled afresh; and greedy choices equal the single answer."""
    engine = TargetEngine(default_model, 8)
    tokenizer = default_model.tokenizer
    text = "The history of the lighthouse on the northern coast begins with a storm. " * 16
    prompt = tokenizer.encode(text)[:200]
    assert len(prompt) == 200
    source, committed, _ = engine.prefill(prompt)
    for r in range(2):
        committed = engine.verify(source, committed, [], [13, 260], [], Sampling(), r).committed
    forked, _, copied = engine.fork(source, prompt)
    fresh, _, _ = engine.prefill(prompt)
    assert copied == 199
    assert torch.equal(logits_after(engine, forked, [13, 260, 314]), logits_after(engine, fresh, [13, 260, 314]))
    ngram = InProcessDraft(NgramDrafter(default_model.facts("target"), 8, 4, 2))
    loop = make_loop(default_model, None, drafts=[ngram])
    single = GenerationRequest(None, None, 12, prompt_token_ids=tuple(prompt))

    async def scenario():
        alone = [t async for c in loop.generate(single, lambda: None) for t in c.token_ids]
        runs = ChoiceRuns([loop.generate(r, lambda: None) for r in choice_requests(single, 3)])
        together: dict[int, list[int]] = {i: [] for i in range(3)}
        try:
            async for index, chunk in runs.chunks():
                together[index] += chunk.token_ids
        finally:
            await runs.close()
        return alone, together

    alone, together = asyncio.run(scenario())
    assert [together[i] for i in range(3)] == [alone] * 3
