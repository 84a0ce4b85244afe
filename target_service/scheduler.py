"""The target's pass scheduling: which shared pass feeds each prompt and round, decided on arrival.

Every session's rounds share the target's passes (``specdec.batching.PassBatcher``), so a prompt fed
in a pass of its own stalls all of them for its whole length (6.5 s for 2048 tokens of the default
target on 2 cores). Under load a prompt is therefore

- **folded**: its prefill feeds nothing (``TargetEngine.prefill(defer=True)``) and its session's first
  verify pass feeds it beside the others' one-token rows, which costs about the prompt alone
  (compute-bound rows). Prompts of at most ``fold_rows`` tokens are folded, and a chunked prompt's tail;
- **chunked**: a prompt longer than ``chunk_rows`` is fed a chunk a pass through the batcher, in passes
  shared with the running sessions' rounds; a verify whose sync brings a long new turn likewise;
- **deferred** (either of the two): the prefill call's own pass feeds nothing.

No gRPC here: ``target_service.server`` decodes requests into these calls and encodes what they return.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from dataclasses import dataclass, replace

from specdec.batching import PassBatcher
from specdec.kvcache import HiddenRows
from specdec.token_lists import common_prefix_len
from target_service.engine import (
    PREFILL_HIDDEN_ROWS,
    TargetEngine,
    VerifyCall,
    VerifyOutcome,
    feed_call,
    newest_hidden,
    stamp_queue_wait,
)
from target_service.tensor_parallel import LeaderEngine

# Sessions count as running while a round is in flight or ended within this many seconds (see
# TargetScheduler.next_chunk).
RUNNING_WINDOW_S = 1.0


@dataclass(frozen=True)
class PrefillPlan:
    """How a prompt is fed, decided when it arrives (``TargetScheduler.plan_prefill``)."""

    chunked: bool
    """Longer than a chunk: fed a chunk a pass through the batcher, beside running sessions' rounds."""
    deferred: bool
    """Folded: the prompt (a chunked one's tail) is fed by its session's first verify pass."""

    @property
    def defer(self) -> bool:
        """The prefill's own pass feeds nothing: its tokens go through shared passes."""
        return self.chunked or self.deferred


class TargetScheduler:
    """Owns the target's batcher and decides, per prompt and per round, which passes feed what.

    Runs on the event loop; model work goes to ``executor``, the engine's one worker thread.
    """

    def __init__(
        self,
        engine: TargetEngine | LeaderEngine,
        executor: Executor,
        max_batch_rows: int,
        fold_prefills: bool = True,
        prefill_chunk: int = 0,
    ) -> None:
        """``max_batch_rows`` is a pass's row budget; ``fold_prefills`` and ``prefill_chunk`` are
        ``TargetConfig``'s. An engine that does not batch (no ragged pass) neither folds nor chunks."""
        self._engine = engine
        self._executor = executor
        self._batcher = PassBatcher(engine.verify_batch, executor, self.rows_of, max_batch_rows, stamp_queue_wait)
        # A longer prompt is fed this many tokens a pass while other sessions run (0: in one pass of its
        # own, which every other session waits for); with none running, up to the pass budget a pass.
        self.chunk_rows = min(prefill_chunk, max_batch_rows - 1) if engine.batches else 0
        self.pass_rows = max_batch_rows - 1  # a chunk while no session runs (see next_chunk)
        # Prompts of at most this many tokens that arrive while passes run are fed by their session's
        # first verify pass (0: never); their caches' unfed rows count in that pass's row budget, and
        # their hidden rows return in one reply, as a prefill's would.
        self.fold_rows = (
            min(max_batch_rows - 1, PREFILL_HIDDEN_ROWS, self.chunk_rows or max_batch_rows)
            if fold_prefills and engine.batches
            else 0
        )
        self._prefilling = 0  # prefills running or queued with a pass of their own
        self._rounds_in_flight = 0
        self._last_round_end = float("-inf")  # event-loop time

    def rows_of(self, call: VerifyCall) -> int:
        """Rows the call's pass feeds: its draft tokens and its cache's pending committed tokens (one, or
        a deferred prompt's), or a prompt chunk's rows (the batcher's row budget counts these)."""
        if call.feed_rows:
            return call.feed_rows
        cache = self._engine.caches.peek(call.cache_id)
        pending = len(cache.pending()) if cache is not None else 1
        return len(call.draft_tokens) + max(1, pending)

    def plan_prefill(self, tokens: int, feed_now: bool = False) -> PrefillPlan:
        """How a prompt of ``tokens`` tokens arriving now is fed (``feed_now``: its caller needs its
        hidden states with the reply, so it is never folded). It reads the current load: plan right
        before ``prefill``."""
        # A burst of prompts counts as load too: the first gets a pass, the rest share verify passes.
        busy = self._batcher.busy or self._prefilling > 0
        fold = busy and not feed_now and self.fold_rows > 0
        chunked = 0 < self.chunk_rows < tokens
        return PrefillPlan(chunked, fold and (chunked or tokens <= self.fold_rows))

    async def prefill(
        self, tokens: list[int], return_hidden: bool, fence: int, plan: PrefillPlan, side_layers: tuple[int, ...] = ()
    ) -> tuple[str, int, HiddenRows | None]:
        """Creates a session cache over ``tokens`` fed as ``plan`` says; returns its id, committed length
        and, when asked, the hidden states of the rows fed (none for a folded prompt: its first round
        returns them). A chunked prompt whose feeding fails (or whose caller gives up) is released."""
        loop = asyncio.get_running_loop()
        self._prefilling += not plan.defer
        try:
            cache_id, committed, hidden = await loop.run_in_executor(
                self._executor,
                lambda: self._engine.prefill(tokens, return_hidden, fence, defer=plan.defer, side_layers=side_layers),
            )
        finally:
            self._prefilling -= not plan.defer
        if plan.chunked:
            leave = self.fold_rows if plan.deferred else 1  # pending tokens left to the first round
            cache = self._engine.caches.peek(cache_id)
            pending = len(cache.pending()) if cache is not None else len(tokens)  # after a reused prefix
            try:
                rows = await self._feed_chunks(cache_id, pending, leave, return_hidden, side_layers=side_layers)
            except BaseException:
                self._executor.submit(self._engine.release, cache_id)  # a half-fed cache serves no one
                raise
            hidden = await loop.run_in_executor(self._executor, newest_hidden, rows)
        return cache_id, committed, hidden

    async def verify(self, call: VerifyCall) -> VerifyOutcome:
        """Verifies a round in the next shared pass; a long new turn in its sync is fed a chunk a pass
        first, like a long prompt, and its rows' hidden states join the round's."""
        rows = []
        if self.chunk_rows and (pending := self._pending_after(call)) > self.chunk_rows:
            rows = await self._feed_chunks(
                call.cache_id, pending, self.chunk_rows, call.with_hidden, call, call.side_layers
            )
        self._rounds_in_flight += 1
        try:
            outcome = await self._batcher.submit(call)
        finally:
            self._rounds_in_flight -= 1
            self._last_round_end = asyncio.get_running_loop().time()
        if rows and outcome.hidden is not None:
            joined = await asyncio.get_running_loop().run_in_executor(
                self._executor, newest_hidden, [*rows, outcome.hidden]
            )
            outcome = replace(outcome, hidden=joined)
        return outcome

    def idle(self, cache_id: str) -> None:
        """The session of ``cache_id`` ended its turn: the next pass does not wait for it."""
        self._batcher.idle(cache_id)

    def next_chunk(self) -> int:
        """Rows of a prompt's next chunk: the configured chunk while sessions are running (a round in
        flight, or one that ended within RUNNING_WINDOW_S), else the whole pass budget. With no one to
        wait, a larger chunk only saves weight reads: 1024 tokens of the default target took 3.0 s in
        256-row passes, 3.8 s in 128-row passes and 3.3 s in one pass (2 cores)."""
        ended = asyncio.get_running_loop().time() - self._last_round_end
        idle = not self._rounds_in_flight and ended > RUNNING_WINDOW_S
        return self.pass_rows if idle else self.chunk_rows

    async def _feed_chunks(
        self,
        cache_id: str,
        pending: int,
        leave: int,
        with_hidden: bool,
        sync: VerifyCall | None = None,
        side_layers: tuple[int, ...] = (),
    ) -> list[HiddenRows]:
        """Feeds a cache's ``pending`` tokens through the batcher, a chunk a pass, until ``leave`` are
        left, so running sessions' rounds share those passes instead of waiting for all of them (the
        first chunk applies ``sync``, a round's call, first). Returns the fed rows' hidden states."""
        rows, first = [], True
        while pending > leave:
            n = min(self.next_chunk(), pending - 1)  # the last committed token is always a round's to feed
            outcome = await self._batcher.submit(
                feed_call(cache_id, n, with_hidden, sync if first else None, side_layers)
            )
            first, pending = False, pending - n
            if outcome.hidden is not None:
                rows.append(outcome.hidden)
        return rows

    def _pending_after(self, call: VerifyCall) -> int:
        """Tokens the call's pass would feed before its draft tokens once its sync applies, when that
        sync brings more new tokens than a chunk (a long new turn); else 0, at the cost of one check."""
        if len(call.new_tokens) <= self.chunk_rows:
            return 0
        cache = self._engine.caches.peek(call.cache_id)
        if cache is None:
            return 0  # the round's own call reports the lost cache
        committed = cache.committed[: call.start] + call.new_tokens
        return len(committed) - min(common_prefix_len(cache.kv_tokens, committed), len(committed) - 1)
