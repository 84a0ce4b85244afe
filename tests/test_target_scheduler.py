"""The target's scheduler without gRPC: which prompts are folded, chunked or deferred, and which
passes feed them, on the tiny target's engine on its own worker thread."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec.sampling import Sampling
from target_service.engine import PREFILL_HIDDEN_ROWS, TargetEngine, VerifyCall
from target_service.scheduler import PrefillPlan, TargetScheduler

# Imports nothing of the coordinator or gRPC (test_batching's engines come with both).
PROMPTS = [[5, 6, 7], [9] * 12, [3, 4], [20, 21, 22, 23, 24, 25, 26]]
DRAFTS = [[8, 9], [], [5, 6, 7, 8], [27]]
LONG = [(5 * i) % 29 + 2 for i in range(120)]


class _Recorder(TargetEngine):
    """An engine that records the ``feed_rows`` of the calls in each pass (0: a round) and the ``defer``
    flag of each prefill; with ``hold`` ("verify" or "prefill") those passes wait at ``gate``, so a
    test can keep the target busy."""

    def __init__(self, *args, hold: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hold = hold
        self.log: list[list[int]] = []
        self.deferred: list[bool] = []
        self.entered, self.gate = threading.Event(), threading.Event()

    def _wait_if(self, kind: str) -> None:
        if self.hold == kind:
            self.entered.set()
            assert self.gate.wait(60)

    def verify_batch(self, calls):
        self.log.append([c.feed_rows for c in calls])
        self._wait_if("verify")
        return super().verify_batch(calls)

    def prefill(self, tokens, with_hidden=False, fence=0, cache_id=None, defer=False, side_layers=()):
        self.deferred.append(defer)
        if not defer:
            self._wait_if("prefill")
        return super().prefill(tokens, with_hidden, fence, cache_id, defer, side_layers)


class _Unbatched(TargetEngine):
    """An engine without ragged passes: each prompt gets a pass of its own."""

    batches = False


def _run(engine: _Recorder, test, max_batch_rows: int = 64, fold_prefills: bool = True, prefill_chunk: int = 0):
    """Runs ``await test(scheduler)`` on an event loop, the engine's work on a worker thread of its own;
    the gate of a gated engine opens at the end whatever happens, so no pass is left waiting."""
    executor = ThreadPoolExecutor(max_workers=1)

    async def main():
        scheduler = TargetScheduler(engine, executor, max_batch_rows, fold_prefills, prefill_chunk)
        try:
            return await test(scheduler)
        finally:
            engine.gate.set()
            await asyncio.sleep(0.05)  # let the batcher's gathering window close before the loop does

    try:
        return asyncio.run(main())
    finally:
        executor.shutdown(wait=True)


def _round(
    cache_id: str, committed: int, draft: list[int] = (), with_hidden: bool = False, new_tokens: list[int] = ()
) -> VerifyCall:
    return VerifyCall(cache_id, committed, list(new_tokens), list(draft), [], Sampling(), 0, with_hidden)


async def _entered(engine: _Recorder) -> None:
    """Waits (off the model's thread) until the engine holds a pass at its gate."""
    assert await asyncio.to_thread(engine.entered.wait, 30)


@pytest.mark.parametrize(
    "rows, fold, chunk, want",
    [
        (64, True, 128, (63, 63)),  # chunks and folds fit in a pass beside a round's row
        (256, True, 128, (128, 128)),  # a folded prompt is never longer than a chunk
        (256, True, 0, (0, 255)),
        (4096, True, 0, (0, PREFILL_HIDDEN_ROWS)),  # its hidden rows return in one reply
        (256, False, 128, (128, 0)),
    ],
)
def test_chunk_and_fold_limits_follow_the_pass_budget(tiny_target, rows, fold, chunk, want):
    scheduler = TargetScheduler(TargetEngine(tiny_target, 4), ThreadPoolExecutor(1), rows, fold, chunk)
    assert (scheduler.chunk_rows, scheduler.fold_rows) == want and scheduler.pass_rows == rows - 1
    unbatched = TargetScheduler(_Unbatched(tiny_target, 4), ThreadPoolExecutor(1), rows, fold, chunk)
    assert (unbatched.chunk_rows, unbatched.fold_rows) == (0, 0)


def test_an_idle_target_feeds_a_prompt_in_a_pass_of_its_own(tiny_target):
    engine = _Recorder(tiny_target, 16)

    async def test(scheduler):
        plan = scheduler.plan_prefill(len(PROMPTS[1]))
        assert plan == PrefillPlan(chunked=False, deferred=False) and not plan.defer
        return await scheduler.prefill(PROMPTS[1], True, 0, plan)

    cache_id, committed, hidden = _run(engine, test)
    assert committed == len(PROMPTS[1]) and (hidden.start, len(hidden.rows)) == (0, len(PROMPTS[1]) - 1)
    assert engine.deferred == [False] and engine.log == []


def test_a_prompt_arriving_during_a_pass_is_folded_into_its_first_round(tiny_target):
    """While a round's pass runs, a short prompt is deferred (unless fed now or longer than a folded
    prompt may be), and its session's first verify pass feeds it, the prompt counted in its rows."""
    engine = _Recorder(tiny_target, 16, hold="verify")
    running = engine.prefill(PROMPTS[0])[0]

    async def test(scheduler):
        round_task = asyncio.create_task(scheduler.verify(_round(running, len(PROMPTS[0]))))
        await _entered(engine)
        plan = scheduler.plan_prefill(len(PROMPTS[3]))
        assert plan == PrefillPlan(chunked=False, deferred=True) and plan.defer
        assert not scheduler.plan_prefill(len(PROMPTS[3]), feed_now=True).defer
        assert not scheduler.plan_prefill(scheduler.fold_rows + 1).defer
        engine.gate.set()
        await round_task
        cache_id, committed, hidden = await scheduler.prefill(PROMPTS[3], True, 0, plan)
        assert committed == len(PROMPTS[3]) and hidden is None
        first = _round(cache_id, committed, DRAFTS[3], with_hidden=True)
        assert scheduler.rows_of(first) == len(PROMPTS[3]) + len(DRAFTS[3])
        return await scheduler.verify(first)

    outcome = _run(engine, test, max_batch_rows=8)
    assert engine.deferred == [False, True] and engine.log == [[0], [0]]
    assert outcome.load.fed_rows == len(PROMPTS[3]) + len(DRAFTS[3]) and outcome.hidden.start == 0


def test_a_burst_of_prompts_gets_one_own_pass_and_defers_the_rest(tiny_target):
    """A prompt that arrives while another prompt's own pass runs counts as load: it is folded."""
    engine = _Recorder(tiny_target, 16, hold="prefill")

    async def test(scheduler):
        first = asyncio.create_task(scheduler.prefill(PROMPTS[0], False, 0, scheduler.plan_prefill(len(PROMPTS[0]))))
        await _entered(engine)
        plans = [scheduler.plan_prefill(len(p)) for p in PROMPTS[1:3]]
        engine.gate.set()
        await first
        assert all(p.deferred for p in plans)
        assert not scheduler.plan_prefill(len(PROMPTS[1])).defer  # the burst has passed

    _run(engine, test)


def test_a_long_prompt_takes_whole_passes_while_idle_and_chunks_after_a_round(tiny_target):
    """With no round in the last second a long prompt is fed up to the pass budget a pass; right after
    a round, a chunk a pass. The last token is always a round's, and the reply's hidden rows are all the
    chunks' rows."""
    engine = _Recorder(tiny_target, 16)

    async def test(scheduler):
        plan = scheduler.plan_prefill(len(LONG))
        assert plan == PrefillPlan(chunked=True, deferred=False)
        cache_id, committed, hidden = await scheduler.prefill(LONG, True, 0, plan)
        assert engine.log == [[63], [56]] and (hidden.start, len(hidden.rows)) == (0, len(LONG) - 1)
        engine.log.clear()
        await scheduler.verify(_round(cache_id, committed))
        await scheduler.prefill(LONG, False, 0, scheduler.plan_prefill(len(LONG)))

    _run(engine, test, prefill_chunk=8)
    assert engine.log == [[0]] + [[8]] * 14 + [[7]]
    assert engine.deferred == [True, True]  # a chunked prompt's own prefill feeds nothing


def test_a_busy_target_leaves_a_chunked_prompts_tail_to_its_first_round(tiny_target):
    """Chunked under load, a prompt is fed a chunk a pass until at most a folded prompt's rows are
    left; its first round feeds that tail."""
    engine = _Recorder(tiny_target, 16, hold="verify")
    running, prompt = engine.prefill(PROMPTS[0])[0], LONG[:30]

    async def test(scheduler):
        round_task = asyncio.create_task(scheduler.verify(_round(running, len(PROMPTS[0]))))
        await _entered(engine)
        plan = scheduler.plan_prefill(len(prompt))
        engine.gate.set()
        await round_task
        cache_id, committed, _ = await scheduler.prefill(prompt, False, 0, plan)
        return plan, scheduler.rows_of(_round(cache_id, committed, DRAFTS[0]))

    plan, rows = _run(engine, test, prefill_chunk=8)
    assert plan == PrefillPlan(chunked=True, deferred=True)
    assert engine.log == [[0], [8], [8], [8]] and rows == 6 + len(DRAFTS[0])  # 30 - 24 pending


def test_a_long_new_turn_is_fed_a_chunk_a_pass_before_its_round(tiny_target):
    """A round whose sync brings more than a chunk of new tokens feeds them a chunk a pass first (the
    first chunk applies the sync); a short turn goes straight to its round."""
    engine = _Recorder(tiny_target, 16)
    cache_id = engine.prefill(PROMPTS[1])[0]
    turn = LONG[:60]

    async def test(scheduler):
        short = await scheduler.verify(_round(cache_id, len(PROMPTS[1]), new_tokens=turn[:8]))
        return await scheduler.verify(_round(cache_id, short.committed, DRAFTS[3], True, turn))

    outcome = _run(engine, test, prefill_chunk=8)
    # 61 pending tokens (the last committed one and the turn): 7 chunks of 8, then the round feeds 5.
    assert engine.log == [[0]] + [[8]] * 7 + [[0]]
    assert outcome.load.fed_rows == 5 + len(DRAFTS[3])
    assert outcome.hidden.start == len(PROMPTS[1]) + 8  # the chunks' rows joined the round's


def test_a_chunked_prompt_given_up_midway_is_released(tiny_target):
    """A caller that gives up while its prompt is fed chunk by chunk leaves no half-fed cache."""
    engine = _Recorder(tiny_target, 16)
    prompt = [(3 * i) % 29 + 2 for i in range(250)]

    async def test(scheduler):
        task = asyncio.create_task(scheduler.prefill(prompt, False, 0, scheduler.plan_prefill(len(prompt))))
        while len(engine.log) < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    # The release is queued on the model's thread behind the pass in flight: done once _run returns.
    _run(engine, test, max_batch_rows=2, prefill_chunk=1)  # a token a pass, sessions running or not
    assert len(engine.caches) == 0 and 3 <= len(engine.log) < len(prompt) - 1


def test_a_deferred_prompt_counts_in_its_pass_row_budget(tiny_target):
    """The batcher's row budget counts what a pass will feed: a deferred prompt, then one pending token."""
    engine = TargetEngine(tiny_target, 16)
    scheduler = TargetScheduler(engine, ThreadPoolExecutor(1), max_batch_rows=64)
    cache_id = engine.prefill(PROMPTS[1], defer=True)[0]
    call = VerifyCall(cache_id, len(PROMPTS[1]), [], [5, 6], [], Sampling(), 0)
    assert scheduler.rows_of(call) == len(PROMPTS[1]) + 2
    committed = engine.verify_batch([call])[0].committed
    assert scheduler.rows_of(VerifyCall(cache_id, committed, [], [5, 6], [], Sampling(), 1)) == 1 + 2
    assert scheduler.rows_of(VerifyCall("gone", 0, [], [], [], Sampling(), 0)) == 1
