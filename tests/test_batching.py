"""Batched verification: the ragged pass, the engine's batches, the batcher, and load-aware k."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import SimpleNamespace

import grpc
import pytest
import torch
from harness import InProcessStack
from test_e2e_tiny import hf_greedy

from coordinator.adaptive import AcceptanceTracker, CostModel, choose_k
from draft_service.engine import ModelDrafter
from specdec import Client
from specdec.batching import PassBatcher, PassLoad
from specdec.config import TargetConfig
from specdec.errors import CacheBudgetExceeded
from specdec.hidden_wire import hidden_from_pb
from specdec.kvcache import HiddenRows, SessionCache, kv_buffer_bytes
from specdec.ragged import RaggedItem, ragged_forward, supports_ragged
from specdec.sampling import Sampling
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.engine import PREFILL_HIDDEN_ROWS, SparseQ, TargetEngine, VerifyCall, feed_call, newest_hidden
from target_service.pass_costs import PassCosts


def _sessions(model, lengths: list[int], seed: int) -> list[SessionCache]:
    """Session caches over random prompts of the given lengths, prefilled as the services do."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    out = []
    for n in lengths:
        cache = SessionCache(committed=torch.randint(2, vocab, (n,), generator=g).tolist())
        cache.prefill(model)
        out.append(cache)
    return out


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_ragged_pass_equals_one_pass_per_session(which, tiny_target, default_model):
    """Logits, hidden states and the grown caches match separate single-session passes."""
    model = (tiny_target if which == "tiny" else default_model).model
    assert supports_ragged(model)
    lengths, extras = [1, 5, 17, 40], [[3], [4, 5, 6], [], [7, 8]]
    alone, batched = _sessions(model, lengths, 0), _sessions(model, lengths, 0)
    expected = [c.forward_with_hidden(model, extra, len(extra) + 1) for c, extra in zip(alone, extras)]
    items = [RaggedItem(c.kv, c.pending() + extra, len(extra) + 1) for c, extra in zip(batched, extras)]
    logits, hidden = ragged_forward(model, items)
    for (want_logits, want_hidden), got_logits, got_hidden, a, b in zip(expected, logits, hidden, alone, batched):
        assert got_logits.shape == want_logits.shape
        torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_hidden, want_hidden.rows, atol=1e-4, rtol=1e-4)
        assert torch.equal(got_logits.argmax(-1), want_logits.argmax(-1))
        for la, lb in zip(a.kv.layers, b.kv.layers):
            torch.testing.assert_close(la.keys, lb.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(la.values, lb.values, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("which", ["tiny", "default"])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_a_lone_session_ragged_is_bit_identical_to_transformers_forward(which, rows, tiny_target, default_model):
    """The target runs every verify pass ragged, a lone session's too: its logits and hidden states
    must be exactly those of transformers' own forward, not merely close."""
    model = (tiny_target if which == "tiny" else default_model).model
    plain, ragged = _sessions(model, [23], 1)[0], _sessions(model, [23], 1)[0]
    extra = [5, 6, 7, 8, 9][: rows - 1]
    want_logits, want_hidden = plain.forward_with_hidden(model, extra, rows)
    logits, hidden = ragged_forward(model, [RaggedItem(ragged.kv, ragged.pending() + extra, rows)])
    assert torch.equal(logits[0], want_logits) and torch.equal(hidden[0], want_hidden.rows)


def _calls(
    engine: TargetEngine,
    prompts: list[list[int]],
    drafts: list[list[int]],
    sampling: Sampling,
    with_hidden: bool = False,
) -> list[VerifyCall]:
    ids = [engine.prefill(p)[0] for p in prompts]
    return [VerifyCall(i, len(p), [], d, [], sampling, 3, with_hidden) for i, p, d in zip(ids, prompts, drafts)]


PROMPTS = [[5, 6, 7], [9] * 12, [3, 4], [20, 21, 22, 23, 24, 25, 26]]
DRAFTS = [[8, 9], [], [5, 6, 7, 8], [27]]


def test_the_pass_computes_where_the_model_lives(tiny_target):
    """Every tensor the ragged pass builds (token ids, positions, masks, rows kept) is made on the model's
    device. No GPU runs here: on the meta device a tensor left on the CPU fails this pass as it would on
    CUDA (the pass before device placement fails here). Transformers' own forward, which the session
    cache's prefill takes, accepts CPU token ids beside meta weights, so the meta device checks only
    that it runs."""
    model = copy.deepcopy(tiny_target.model).to("meta")
    caches = [SessionCache(committed=[3, 4, 5, 6]), SessionCache(committed=[7, 8])]
    for cache in caches:
        cache.prefill(model)
    logits, hidden = ragged_forward(model, [RaggedItem(caches[0].kv, [6, 9, 10], 2), RaggedItem(caches[1].kv, [8], 1)])
    assert [(x.device.type, tuple(x.shape)) for x in logits] == [("meta", (2, 32)), ("meta", (1, 32))]
    assert [(h.device.type, h.shape[0]) for h in hidden] == [("meta", 3), ("meta", 1)]


def test_verify_batch_equals_separate_verifies(tiny_target):
    """Greedy verdicts, committed tokens and hidden rows are the same batched as one by one."""
    batched, alone = TargetEngine(tiny_target, 16), TargetEngine(tiny_target, 16)
    calls = _calls(batched, PROMPTS, DRAFTS, Sampling(), with_hidden=True)
    results = batched.verify_batch(calls)
    assert batched.passes == 1 and batched.largest_pass == len(PROMPTS)
    for call, got in zip(_calls(alone, PROMPTS, DRAFTS, Sampling(), with_hidden=True), results):
        want = alone.verify_batch([call])[0]
        assert (got.accepted, got.tokens, got.committed) == (want.accepted, want.tokens, want.committed)
        assert got.hidden.start == want.hidden.start
        torch.testing.assert_close(got.hidden.rows, want.hidden.rows, atol=1e-4, rtol=1e-4)
        assert got.load.sessions == len(PROMPTS) and got.load.rows == sum(len(d) + 1 for d in DRAFTS)
        assert got.load.others_committed == sum(len(r.tokens) for r in results) - len(got.tokens)


def test_a_verdict_that_fails_fails_only_its_own_call_in_the_pass(tiny_target):
    """A temperature past float32 (the services refuse one at the edge) makes one session's sampled
    verdict fail after the shared pass; the others' verdicts stand, and the failed session's cache
    answers its next round as a fresh one would."""
    engine, alone = TargetEngine(tiny_target, 16), TargetEngine(tiny_target, 16)
    calls = _calls(engine, PROMPTS, DRAFTS, Sampling())
    bad = replace(calls[2], sampling=Sampling(temperature=1e-40, seed=1), q=[SparseQ([t], [1.0]) for t in DRAFTS[2]])
    results = engine.verify_batch([calls[0], calls[1], bad, calls[3]])
    assert engine.passes == 1
    assert isinstance(results[2], Exception)
    wanted = alone.verify_batch(_calls(alone, PROMPTS, DRAFTS, Sampling()))
    for i in (0, 1, 3):
        assert (results[i].accepted, results[i].tokens) == (wanted[i].accepted, wanted[i].tokens)
    alone = TargetEngine(tiny_target, 16)
    again = engine.verify_batch([calls[2]])[0]
    fresh = alone.verify_batch([_calls(alone, [PROMPTS[2]], [DRAFTS[2]], Sampling())[0]])[0]
    assert (again.accepted, again.tokens, again.committed) == (fresh.accepted, fresh.tokens, fresh.committed)


def test_a_deferred_prefill_is_fed_by_its_sessions_first_verify_pass(tiny_target):
    """A prompt left unfed at prefill joins the next verify pass beside running sessions: verdicts,
    commits and hidden rows (now from position 0) are those of a prefilled session, and that pass, a
    prefill's cost rather than a verify's, stays off the cost curve coordinators price rows with."""
    folded, plain = TargetEngine(tiny_target, 16), TargetEngine(tiny_target, 16)
    running = _calls(folded, PROMPTS[:2], DRAFTS[:2], Sampling(), with_hidden=True)
    late = []
    for prompt, draft in zip(PROMPTS[2:], DRAFTS[2:]):
        cache_id, committed, hidden = folded.prefill(prompt, with_hidden=True, defer=True)
        assert committed == len(prompt) and hidden is None
        late.append(VerifyCall(cache_id, len(prompt), [], draft, [], Sampling(), 3, True))
    results = folded.verify_batch(running + late)
    assert folded.passes == 1
    assert all(r.load.alone_ms == [] for r in results)  # nothing recorded: no curve yet
    assert results[0].load.rows == sum(len(p) - 1 for p in PROMPTS[2:]) + sum(len(d) + 1 for d in DRAFTS)
    assert [r.load.fed_rows for r in results] == [len(DRAFTS[0]) + 1, len(DRAFTS[1]) + 1] + [
        len(p) - 1 + len(d) + 1 for p, d in zip(PROMPTS[2:], DRAFTS[2:])
    ]
    for i, call in enumerate(_calls(plain, PROMPTS, DRAFTS, Sampling(), with_hidden=True)):
        want, got, prompt = plain.verify_batch([call])[0], results[i], PROMPTS[i]
        assert (got.accepted, got.tokens, got.committed) == (want.accepted, want.tokens, want.committed)
        if i >= 2:
            assert got.hidden.start == 0 and len(got.hidden.rows) == len(prompt) - 1 + len(want.hidden.rows)
            torch.testing.assert_close(got.hidden.rows[len(prompt) - 1 :], want.hidden.rows, atol=1e-4, rtol=1e-4)
    # The next pass, one pending token per session, is a verify's: it is recorded.
    again = [VerifyCall(c.cache_id, r.committed, [], [], [], Sampling(), 4) for c, r in zip(running + late, results)]
    assert all(r.load.alone_ms != [] for r in folded.verify_batch(again))


def test_a_long_prompt_fed_in_chunks_answers_as_one_fed_at_once(tiny_target):
    """A deferred prompt fed chunk by chunk, each chunk in a pass beside a running session's round,
    then its tail with its first round: verdicts and hidden rows are those of a prompt prefilled in
    one pass, the running session is unaffected, and chunk passes stay off the cost curve."""
    prompt = [(7 * i) % 29 + 2 for i in range(41)]
    chunked, plain = TargetEngine(tiny_target, 16), TargetEngine(tiny_target, 16)
    running = _calls(chunked, PROMPTS[:1], DRAFTS[:1], Sampling(), with_hidden=True)[0]
    cache_id = chunked.prefill(prompt, with_hidden=True, defer=True)[0]
    rows = []
    for n in (16, 16):
        results = chunked.verify_batch([running, feed_call(cache_id, n, with_hidden=True)])
        rows.append(results[1].hidden)
        assert results[1].tokens == [] and results[1].committed == len(prompt)
        assert results[0].load.alone_ms == []  # a chunk's pass is a prefill's cost: not recorded
        running = VerifyCall(running.cache_id, results[0].committed, [], [], [], Sampling(), 4, True)
    assert chunked.passes == 2 and chunked.verified == 2 and chunked.largest_pass == 1
    assert [(r.start, len(r.rows)) for r in rows] == [(0, 16), (16, 16)]
    refused = chunked.verify_batch([feed_call(cache_id, len(prompt) - 32)])[0]  # the last token is a round's
    assert isinstance(refused, ValueError) and "feed_rows" in str(refused)
    got = chunked.verify(cache_id, len(prompt), [], DRAFTS[3], [], Sampling(), 3, True)

    plain_id, _, hidden = plain.prefill(prompt, with_hidden=True)
    want = plain.verify(plain_id, len(prompt), [], DRAFTS[3], [], Sampling(), 3, True)
    assert (got.accepted, got.tokens, got.committed) == (want.accepted, want.tokens, want.committed)
    assert got.hidden.start == 32
    fed_rows = torch.cat([r.rows for r in rows] + [got.hidden.rows])
    torch.testing.assert_close(fed_rows, torch.cat([hidden.rows, want.hidden.rows]), atol=1e-4, rtol=1e-4)


def test_newest_hidden_joins_consecutive_rows_and_keeps_the_newest():
    """Chunks' hidden rows join into one block; past PREFILL_HIDDEN_ROWS (fewer for rows widened by
    side layers) only the newest rows (and their start position) are kept, since the draft attends to
    the newest ones."""
    assert newest_hidden([]) is None
    rows = torch.arange(2 * 3, dtype=torch.float32).view(2, 3)
    chunks = [HiddenRows(5, rows), HiddenRows(7, rows + 6)]
    joined = newest_hidden(chunks)
    assert joined.start == 5 and torch.equal(joined.rows, torch.arange(12, dtype=torch.float32).view(4, 3))
    long = [HiddenRows(0, torch.zeros(PREFILL_HIDDEN_ROWS, 3)), HiddenRows(PREFILL_HIDDEN_ROWS, torch.ones(10, 3))]
    kept = newest_hidden(long)
    assert kept.start == 10 and len(kept.rows) == PREFILL_HIDDEN_ROWS and kept.rows[-10:].eq(1).all()
    # Rows with four side layers of the default target's width: a reply stays inside 6 MiB.
    wide = newest_hidden([HiddenRows(0, torch.zeros(PREFILL_HIDDEN_ROWS, 5 * 576, dtype=torch.float16))])
    assert (
        wide.start + len(wide.rows) == PREFILL_HIDDEN_ROWS
        and wide.rows.numel() * 2 <= 6 * 1024 * 1024 < (len(wide.rows) + 1) * 5 * 576 * 2
    )


class _GatedEngine(TargetEngine):
    """A target engine whose verify passes (or prefill passes) wait for a gate, so a test holds the
    target busy."""

    def __init__(self, *args, gated: str = "verify", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gated = gated
        self.entered, self.gate = threading.Event(), threading.Event()

    def _hold(self) -> None:
        self.entered.set()
        assert self.gate.wait(60)

    def verify_batch(self, calls):
        if self.gated == "verify":
            self._hold()
        return super().verify_batch(calls)

    def prefill(self, tokens, with_hidden=False, fence=0, cache_id=None, defer=False, side_layers=()):
        if self.gated == "prefill" and not defer:
            self._hold()
        return super().prefill(tokens, with_hidden, fence, cache_id, defer, side_layers)


def _deferred_flags(stack: InProcessStack) -> list[bool]:
    return [
        s.attributes["specdec.deferred"]
        for s in stack.exporter.get_finished_spans()
        if s.name == "TargetService/Prefill"
    ]


def test_a_prompt_that_arrives_during_a_pass_is_fed_by_the_next_one(tiny_target, tiny_dir, redis_url):
    """Over gRPC: an idle target prefills at once; a prompt arriving while a pass runs is deferred (its
    Prefill span says so, its reply has no hidden rows), and its first Verify feeds it and answers as a
    prefilled session would, hidden rows from position 0 included."""
    engine, plain = _GatedEngine(tiny_target, 16), TargetEngine(tiny_target, 16)
    stack = InProcessStack(engine, None, tiny_dir / "target", redis_url)
    greedy = common_pb2.SamplingParams(temperature=0.0, top_p=1.0)
    try:
        stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(stack.add_target(engine)))
        first = stub.Prefill(common_pb2.PrefillRequest(tokens=PROMPTS[0], return_hidden=True))
        assert first.hidden.fp16
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(
                stub.Verify,
                target_pb2.VerifyRequest(
                    sync=common_pb2.CacheSync(cache_id=first.cache_id, start=len(PROMPTS[0])), sampling=greedy
                ),
            )
            assert engine.entered.wait(30)
            late = pool.submit(stub.Prefill, common_pb2.PrefillRequest(tokens=PROMPTS[3], return_hidden=True))
            time.sleep(1.0)  # the Prefill reaches the service while the pass still runs
            engine.gate.set()
            running.result(30)
            late = late.result(30)
        assert late.committed == len(PROMPTS[3]) and not late.hidden.fp16
        got = stub.Verify(
            target_pb2.VerifyRequest(
                sync=common_pb2.CacheSync(cache_id=late.cache_id, start=len(PROMPTS[3])),
                draft_tokens=DRAFTS[3],
                sampling=greedy,
                round=3,
                return_hidden=True,
            )
        )
    finally:
        stack.close()
    want = plain.verify(plain.prefill(PROMPTS[3])[0], len(PROMPTS[3]), [], DRAFTS[3], [], Sampling(), 3, True)
    assert (got.accepted, list(got.tokens), got.committed) == (want.accepted, want.tokens, want.committed)
    rows = len(PROMPTS[3]) - 1 + len(want.hidden.rows)  # the prompt's, then the round's
    assert got.hidden.start == 0 and len(got.hidden.fp16) == 2 * got.hidden.dim * rows
    assert _deferred_flags(stack) == [False, True]


class _LoggingEngine(TargetEngine):
    """A target engine that logs each pass: the ``feed_rows`` of every call in it (0: a round)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[list[int]] = []

    def verify_batch(self, calls):
        self.log.append([c.feed_rows for c in calls])
        return super().verify_batch(calls)


def test_a_long_prompt_is_fed_beside_running_sessions_a_chunk_a_pass(tiny_target, tiny_dir, redis_url):
    """Over gRPC, a prompt longer than the target's chunk never holds the running sessions for its
    whole length: it is fed a chunk a pass, and a session verifying meanwhile gets its rounds in those
    same passes. The new session then answers as one prefilled in one pass would."""
    engine, plain = _LoggingEngine(tiny_target, 16), TargetEngine(tiny_target, 16)
    prompt = [(5 * i) % 29 + 2 for i in range(120)]
    stack = InProcessStack(engine, None, tiny_dir / "target", redis_url, target_config=TargetConfig(prefill_chunk=8))
    greedy = common_pb2.SamplingParams(temperature=0.0, top_p=1.0)
    done = threading.Event()

    def keep_verifying(stub) -> int:
        cache_id = stub.Prefill(common_pb2.PrefillRequest(tokens=PROMPTS[0])).cache_id  # shorter than a chunk
        committed, rounds = len(PROMPTS[0]), 0
        while not done.is_set():
            committed = stub.Verify(
                target_pb2.VerifyRequest(sync=common_pb2.CacheSync(cache_id=cache_id, start=committed), sampling=greedy)
            ).committed
            rounds += 1
        return rounds

    try:
        stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(stack.add_target(engine)))
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(keep_verifying, stub)
            while not any(0 in p for p in engine.log):  # the session runs: a round has been verified
                time.sleep(0.01)
            reply = stub.Prefill(common_pb2.PrefillRequest(tokens=prompt, return_hidden=True))
            done.set()
            assert running.result(30) > 0
        got = stub.Verify(
            target_pb2.VerifyRequest(
                sync=common_pb2.CacheSync(cache_id=reply.cache_id, start=len(prompt)),
                draft_tokens=DRAFTS[3],
                sampling=greedy,
                round=3,
                return_hidden=True,
            )
        )
    finally:
        stack.close()
    feeds = [p for p in engine.log if any(p)]
    assert all(max(p) <= 8 for p in feeds) and sum(map(sum, feeds)) >= len(prompt) - 9
    assert sum(0 in p for p in feeds) >= len(feeds) // 2  # the running session's rounds shared them
    spans = [s for s in stack.exporter.get_finished_spans() if s.name == "TargetService/Prefill"]
    assert spans[-1].attributes["specdec.chunked"]
    want = plain.verify(plain.prefill(prompt)[0], len(prompt), [], DRAFTS[3], [], Sampling(), 3, True)
    assert (got.accepted, list(got.tokens), got.committed) == (want.accepted, want.tokens, want.committed)
    prompt_rows = len(reply.hidden.fp16) // (2 * reply.hidden.dim)
    assert reply.hidden.start == 0 and got.hidden.start == prompt_rows
    assert prompt_rows + len(got.hidden.fp16) // (2 * got.hidden.dim) == len(prompt) - 1 + len(want.hidden.rows)


def test_a_long_new_turn_is_fed_a_chunk_a_pass_before_its_round(tiny_target, tiny_dir, redis_url):
    """A verify whose sync brings a long new turn (a document pasted into a chat's next turn) feeds it
    a chunk a pass first, as a long prompt is fed; the round's verdict and hidden rows are those of
    one pass over the whole turn."""
    engine, plain = _LoggingEngine(tiny_target, 16), TargetEngine(tiny_target, 16)
    turn = [(5 * i) % 29 + 2 for i in range(60)]
    stack = InProcessStack(engine, None, tiny_dir / "target", redis_url, target_config=TargetConfig(prefill_chunk=8))
    greedy = common_pb2.SamplingParams(temperature=0.0, top_p=1.0)
    try:
        stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(stack.add_target(engine)))
        cache_id = stub.Prefill(common_pb2.PrefillRequest(tokens=PROMPTS[1])).cache_id
        committed = stub.Verify(
            target_pb2.VerifyRequest(
                sync=common_pb2.CacheSync(cache_id=cache_id, start=len(PROMPTS[1])), sampling=greedy
            )
        ).committed
        engine.log.clear()
        got = stub.Verify(
            target_pb2.VerifyRequest(
                sync=common_pb2.CacheSync(cache_id=cache_id, start=committed, tokens=turn),
                draft_tokens=DRAFTS[3],
                sampling=greedy,
                round=1,
                return_hidden=True,
            )
        )
    finally:
        stack.close()
    # 61 pending tokens (the last committed one and the turn): 7 chunks of 8, then the round feeds 5.
    assert engine.log == [[8]] * 7 + [[0]]
    plain_id = plain.prefill(PROMPTS[1])[0]
    first = plain.verify(plain_id, len(PROMPTS[1]), [], [], [], Sampling(), 0)
    want = plain.verify(plain_id, first.committed, turn, DRAFTS[3], [], Sampling(), 1, True)
    assert (got.accepted, list(got.tokens), got.committed) == (want.accepted, want.tokens, want.committed)
    rows = hidden_from_pb(got.hidden, got.hidden.dim)
    assert rows.start == want.hidden.start
    torch.testing.assert_close(rows.rows.float(), want.hidden.rows, atol=1e-2, rtol=1e-2)  # fp16 on the wire


def test_a_long_prompt_takes_whole_passes_while_no_session_runs(tiny_target, tiny_dir, redis_url):
    """With no round in the last second nobody waits, so a long prompt is fed up to the pass budget a
    pass (fewer weight reads); right after a round, in chunks again."""
    engine = _LoggingEngine(tiny_target, 16)
    prompt = [(5 * i) % 29 + 2 for i in range(120)]
    config = TargetConfig(prefill_chunk=8, max_batch_rows=64)
    stack = InProcessStack(engine, None, tiny_dir / "target", redis_url, target_config=config)
    greedy = common_pb2.SamplingParams(temperature=0.0, top_p=1.0)
    try:
        stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(stack.add_target(engine)))
        alone = stub.Prefill(common_pb2.PrefillRequest(tokens=prompt))
        assert engine.log == [[63], [56]]  # 119 rows in passes of the whole budget; the last token is a round's
        stub.Verify(
            target_pb2.VerifyRequest(
                sync=common_pb2.CacheSync(cache_id=alone.cache_id, start=len(prompt)), sampling=greedy
            )
        )
        engine.log.clear()
        stub.Prefill(common_pb2.PrefillRequest(tokens=prompt))  # a round just ended
    finally:
        stack.close()
    assert engine.log and all(p == [8] for p in engine.log[:-1])


def test_a_chunked_prompt_given_up_by_its_caller_leaves_no_cache(tiny_target, tiny_dir, redis_url):
    """A caller whose deadline passes while its prompt is fed chunk by chunk gets DEADLINE_EXCEEDED;
    the half-fed cache is dropped, and the target serves the next prompt."""
    engine = _LoggingEngine(tiny_target, 16)
    prompt = [(3 * i) % 29 + 2 for i in range(250)]
    config = TargetConfig(prefill_chunk=1, max_batch_rows=2)  # a token a pass, sessions running or not
    stack = InProcessStack(engine, None, tiny_dir / "target", redis_url, target_config=config)
    try:
        stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(stack.add_target(engine)))
        with pytest.raises(grpc.RpcError) as error:
            stub.Prefill(common_pb2.PrefillRequest(tokens=prompt), timeout=0.05)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 10
        while len(engine.caches) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(engine.caches) == 0 and 0 < len(engine.log) < len(prompt) - 1  # stopped midway
        reply = stub.Prefill(common_pb2.PrefillRequest(tokens=PROMPTS[1]))
        assert reply.committed == len(PROMPTS[1]) and len(engine.caches) == 1
    finally:
        stack.close()


def test_a_burst_of_prompts_gets_one_prefill_pass_and_defers_the_rest(tiny_target, tiny_dir, redis_url):
    """Prompts arriving while another prompt's own pass runs are deferred too, so a burst's sessions
    start in shared verify passes rather than one prefill pass each; but never one that asks to be fed
    now (a seeded sampled request whose feature draft needs its hidden states for round 1)."""
    engine = _GatedEngine(tiny_target, 16, gated="prefill")
    stack = InProcessStack(engine, None, tiny_dir / "target", redis_url)
    try:
        stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(stack.add_target(engine)))
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(stub.Prefill, common_pb2.PrefillRequest(tokens=PROMPTS[0], return_hidden=True))
            assert engine.entered.wait(30)
            rest = [
                pool.submit(stub.Prefill, common_pb2.PrefillRequest(tokens=p, return_hidden=True, feed_now=now))
                for p, now in zip(PROMPTS[1:4], [False, False, True])
            ]
            time.sleep(1.0)  # all reach the service while the first prompt's pass still runs
            engine.gate.set()
            replies = [f.result(30) for f in [first, *rest]]
    finally:
        stack.close()
    assert [bool(r.hidden.fp16) for r in replies] == [True, False, False, True]
    assert sorted(_deferred_flags(stack)) == [False, False, True, True]


def test_a_deferred_prompt_meets_the_kv_budget_once_fed(tiny_target):
    """The budget check a deferred prefill skipped comes with the pass that feeds it: with every cache
    in use, the newcomer is refused (RESOURCE_EXHAUSTED on the wire) and the running sessions go on."""
    probe = TargetEngine(tiny_target, 16)
    size = kv_buffer_bytes(probe.caches.get(probe.prefill(PROMPTS[1])[0]).kv)
    engine = TargetEngine(tiny_target, 16, budget_bytes=int(2.5 * size))
    running = _calls(engine, PROMPTS[1:3], [[], []], Sampling())
    late_id = engine.prefill(PROMPTS[1], defer=True)[0]
    late = VerifyCall(late_id, len(PROMPTS[1]), [], [], [], Sampling(), 0)
    results = engine.verify_batch([*running, late])
    assert isinstance(results[2], CacheBudgetExceeded)
    assert not any(isinstance(r, Exception) for r in results[:2])
    assert late_id not in engine.caches.ids() and len(engine.caches) == 2


def test_verify_batch_isolates_a_bad_call_and_defers_a_repeated_session(tiny_target):
    """One call's bad field fails that call only; two rounds of one cache run in order, not together."""
    engine = TargetEngine(tiny_target, 16)
    calls = _calls(engine, PROMPTS[:2], DRAFTS[:2], Sampling())
    bad = VerifyCall(calls[0].cache_id, 3, [], [10_000], [], Sampling(), 0)
    missing = VerifyCall("nope", 0, [], [], [], Sampling(), 0)
    results = engine.verify_batch([calls[0], bad, missing, calls[1]])
    assert isinstance(results[1], ValueError) and "draft_tokens" in str(results[1])
    assert isinstance(results[2], LookupError)
    assert not isinstance(results[0], Exception) and not isinstance(results[3], Exception)

    # The same cache twice in one batch: the second round sees the first one's commits.
    first = results[0]
    again = VerifyCall(calls[0].cache_id, first.committed, [], [], [], Sampling(), 0)
    twice = engine.verify_batch([again, VerifyCall(calls[0].cache_id, first.committed + 1, [], [], [], Sampling(), 0)])
    assert twice[0].committed == first.committed + 1 and twice[1].committed == first.committed + 2


def test_sampled_verify_batch_is_reproducible_per_seed(tiny_target):
    """Sampled verdicts depend on the session's own seed and round only, never on batch company."""
    sampling = Sampling(temperature=1.0, seed=11)
    batched, alone = TargetEngine(tiny_target, 16), TargetEngine(tiny_target, 16)
    calls = _calls(batched, PROMPTS, [[] for _ in PROMPTS], sampling)
    results = batched.verify_batch(calls)
    for call, got in zip(_calls(alone, PROMPTS, [[] for _ in PROMPTS], sampling), results):
        assert alone.verify_batch([call])[0].tokens == got.tokens


def test_batcher_merges_calls_that_arrive_together(tiny_target):
    """Calls submitted while a pass runs share the next pass, and each gets its own verdict."""
    engine = TargetEngine(tiny_target, 32)
    reference = TargetEngine(tiny_target, 32)
    prompts = [[2 + i, 3 + i, 4 + i] for i in range(8)]
    drafts = [[5 + i] for i in range(8)]
    calls = _calls(engine, prompts, drafts, Sampling())
    expected = [reference.verify_batch([c])[0].tokens for c in _calls(reference, prompts, drafts, Sampling())]

    async def run():
        batcher = PassBatcher(
            engine.verify_batch,
            ThreadPoolExecutor(max_workers=1),
            lambda call: len(call.draft_tokens) + 1,
            max_batch_rows=6,
        )
        results = await asyncio.gather(*(batcher.submit(c) for c in calls))
        await asyncio.sleep(0.05)  # let the batcher's gathering window close before the loop does
        return results

    results = asyncio.run(run())
    assert [r.tokens for r in results] == expected
    # All eight arrive before the first pass starts: 8 x 2 rows go in passes of at most 6 rows.
    assert engine.passes == 3 and engine.largest_pass == 3


def test_a_session_whose_turn_ended_is_not_waited_for():
    """After a pass of two sessions the next pass waits for both (up to the gathering window, here a
    minute), unless the missing one is declared idle: then it starts at once."""
    passes: list[list[str]] = []

    def run_pass(calls):
        passes.append([call.cache_id for call in calls])
        return [call.cache_id for call in calls]

    async def run():
        batcher = PassBatcher(
            run_pass, ThreadPoolExecutor(max_workers=1), lambda call: 1, max_batch_rows=8, gather_ms=60_000
        )
        a, b = SimpleNamespace(cache_id="a"), SimpleNamespace(cache_id="b")
        await asyncio.gather(batcher.submit(a), batcher.submit(b))
        again = asyncio.ensure_future(batcher.submit(a))
        await asyncio.sleep(0.3)
        waited = not again.done()  # b was in the last pass: the next one waits for it
        batcher.idle("b")
        return waited, await asyncio.wait_for(again, 10)

    waited, result = asyncio.run(run())
    assert waited and result == "a"
    assert passes == [["a", "b"], ["a"]]


def test_pass_costs_interpolate_and_extrapolate():
    costs = PassCosts()
    assert costs.predict(4) is None and costs.curve(0, 3) == []
    for rows, ms in [(1, 10.0), (4, 16.0), (8, 40.0)]:
        costs.record(rows, ms)
    assert costs.predict(1) == 10.0
    assert costs.predict(2) == pytest.approx(12.0)
    assert costs.predict(12) == pytest.approx(64.0)  # the 4 -> 8 slope, 6 ms per row
    assert costs.curve(6, 3) == pytest.approx([34.0, 40.0, 46.0])
    costs.record(4, 26.0)
    assert costs.predict(4) == pytest.approx(18.0)  # a moving average, not the last value


def test_warmup_costs_seed_the_curve_only_until_serving_measures_a_pass():
    """A warm-up beside other start-up work priced 2 rows at 222 ms and 4 rows at 91 ms against 54 ms
    for one; serving never fed those sizes again while they looked dear. Once serving measures a pass,
    only its own measurements price the curve (flat past them), so a longer draft gets tried."""
    costs = PassCosts()
    for rows, ms in [(1, 54.0), (2, 222.0), (4, 91.0)]:
        costs.record(rows, ms, warmup=True)
    assert costs.curve(0, 4) == pytest.approx([54.0, 222.0, 222.0, 222.0])  # nothing else known yet
    costs.record(1, 47.0)
    assert costs.curve(0, 4) == pytest.approx([47.0] * 4)
    costs.record(2, 50.0)
    assert costs.curve(0, 4) == pytest.approx([47.0, 50.0, 53.0, 56.0])  # the measured slope, 3 ms a row
    costs.record(4, 52.0)
    assert costs.predict(4) == pytest.approx(52.0) and costs.predict(3) == pytest.approx(51.0)


def _flat_then_steep(others_rows: int) -> list[float]:
    """A synthetic CPU pass: 50 ms for up to 8 rows, then 4 ms per extra row (compute-bound)."""
    return [50.0 + 4.0 * max(0, others_rows + n - 8) for n in range(1, 10)]


def test_load_aware_k_drops_to_zero_under_load_and_recovers():
    accept = [0.6] * 8
    verify_alone = [0.0] + _flat_then_steep(0)
    # Alone: verifying up to 8 rows costs the same as one, so a good draft runs long.
    alone = choose_k(accept, 2.0, verify_alone, 8)
    assert alone >= 3
    # Sixteen sessions of one row each: every extra row costs 4 ms on a 82 ms pass shared by all.
    busy = choose_k(accept, 2.0, [0.0] + _flat_then_steep(15), 8, others_committed=15.0)
    assert busy == 0
    # Two sessions: rows are still nearly free, so speculation comes back.
    light = choose_k(accept, 2.0, [0.0] + _flat_then_steep(1), 8, others_committed=1.0)
    assert light >= 3
    # A poor draft is not worth a step even alone.
    assert choose_k([0.05] * 8, 10.0, verify_alone, 8) == 0


def test_cost_model_uses_the_targets_curve_and_tells_load_from_a_poor_draft():
    model = CostModel(k_max=8, draft_ms_per_token=2.0)
    good = AcceptanceTracker()
    for _ in range(50):
        good.record(4, 3)
    busy = PassLoad(
        sessions=16,
        rows=16,
        others_committed=15,
        pass_ms=82.0,
        curve_ms=_flat_then_steep(15),
        alone_ms=_flat_then_steep(0),
    )
    assert model.choose(good, busy) == 0
    assert model.choose_unloaded(good, busy) > 0  # the load holds k at 0, not the draft
    poor = AcceptanceTracker()
    for _ in range(50):
        poor.record(1, 0)
    assert model.choose_unloaded(poor, busy) == 0


def test_concurrent_sessions_share_passes_and_stay_exact(tiny_target, tiny_draft, tiny_dir, redis_url):
    """Twelve clients at once over gRPC: passes hold several sessions, and every answer is greedy's."""
    prompts = [f"w{i} w{i + 1} w{(3 * i) % 30}" for i in range(12)]
    expected = [hf_greedy(tiny_target, p, 30) for p in prompts]
    engine = TargetEngine(tiny_target, 64)
    stack = InProcessStack(engine, ModelDrafter(tiny_draft, 64, 64), tiny_dir / "target", redis_url).start()
    try:
        with Client(stack.address, timeout=120) as client, ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(
                    lambda ik: client.complete(prompts[ik[0]], max_new_tokens=30, k=ik[1]),
                    [(i, [None, 0, 2][i % 3]) for i in range(len(prompts))],
                )
            )
    finally:
        stack.close()
    assert [r.token_ids for r in results] == expected
    assert engine.largest_pass > 1 and engine.passes < engine.verified


def test_a_draft_on_the_targets_own_cores_is_off_under_load():
    """Two sessions, a cheap-rows pass: a separate draft machine makes k > 0 pay; sharing the cores, not,
    and no probe is worth it either."""
    tracker = AcceptanceTracker()
    for i in range(40):
        tracker.record(1, i % 2)  # the first draft token passes half the time
    load = PassLoad(
        sessions=2,
        rows=2,
        others_committed=1,
        pass_ms=130.0,
        curve_ms=[130.0 + 2.0 * n for n in range(9)],
        alone_ms=[110.0 + 2.0 * n for n in range(9)],
    )
    separate, shared = CostModel(k_max=8), CostModel(k_max=8, colocated=True)
    for costs in (separate, shared):
        for _ in range(10):
            costs.record_draft(40.0, 2)
    assert separate.choose(tracker, load) > 0
    assert shared.choose(tracker, load) == 0
    assert separate.worth_probing(load) and not shared.worth_probing(load)
    # Alone on the target the draft never overlaps another session's pass: both agree.
    alone = PassLoad(1, 1, 0, 110.0, load.alone_ms, load.alone_ms)
    assert shared.choose(tracker, alone) == separate.choose(tracker, alone) > 0


def test_the_load_table_forgets_targets_that_left(tiny_target, tiny_draft, tiny_dir, redis_url):
    """Discovered targets come and go under new addresses: once the coordinator's table of their
    latest passes outgrows the live replicas, the stale entries go and the fresh ones stay."""
    stack = InProcessStack(
        TargetEngine(tiny_target, 4), ModelDrafter(tiny_draft, 4, 4), tiny_dir / "target", redis_url
    ).start()
    try:
        loop = stack.round_loops[0]
        load = PassLoad(1, 1, 0, 1.0, [1.0], [1.0])
        stale = time.monotonic() - 60
        loads = loop.policy.loads
        loads.seen.update({f"gone-{i}:1": (stale, load) for i in range(10)})
        loads.note("fresh:1", load)
        assert set(loads.seen) == {"fresh:1"} and loads.fresh("fresh:1") is load
    finally:
        stack.close()
