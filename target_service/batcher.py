"""Continuous batching at round granularity: verify calls that arrive together share one pass.

While a pass runs, newly arrived calls wait; when it ends, every waiting call (up to a row budget)
goes into the next pass. A session therefore joins or leaves the batch between passes, and nobody
waits for more than the pass in flight plus a short gathering window.

The window exists because the sessions of one pass all get their verdicts at once and come back a
few milliseconds apart (each coordinator streams, then drafts). Without it the first to come back
would find the target idle and run alone, and the rest would run in a second pass: two passes per
round instead of one, and the two groups stay out of step for good. So an idle target waits until
every session active in the last two passes has a call waiting, or until the window closes,
whichever comes first. A lone session never waits; a session that ended costs one window per pass
for two passes, until it drops out of the active set.
"""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import Executor
from dataclasses import replace

from target_service.engine import TargetEngine, VerifyCall, VerifyOutcome


class VerifyBatcher:
    """Queues verify calls and runs them in batched passes on the engine's one worker thread."""

    def __init__(self, engine: TargetEngine, executor: Executor, max_batch_rows: int,
                 gather_ms: float = 30.0) -> None:
        self._engine = engine
        self._executor = executor
        self._max_rows = max_batch_rows
        self._gather_s = gather_ms / 1000
        self._waiting: deque[tuple[VerifyCall, asyncio.Future, float]] = deque()  # call, result, arrival
        self._arrived = asyncio.Event()
        self._draining = False
        self._passes = 0
        self._last_seen: dict[str, int] = {}  # cache id -> number of the last pass it was in

    async def verify(self, call: VerifyCall) -> VerifyOutcome:
        """Verifies one call in the next pass; raises the error that call caused."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.append((call, future, loop.time()))
        self._arrived.set()
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    def _take(self) -> list[tuple[VerifyCall, asyncio.Future, float]]:
        """The oldest waiting calls whose rows fit the budget (always at least one)."""
        batch, rows = [], 0
        while self._waiting:
            call, future, _ = self._waiting[0]
            if future.cancelled():  # its client gave up: skip it rather than spend a row on it
                self._waiting.popleft()
                continue
            need = len(call.draft_tokens) + 1
            if batch and rows + need > self._max_rows:
                break
            batch.append(self._waiting.popleft())
            rows += need
        return batch

    async def _gather(self) -> None:
        """Waits, up to the window, until every recently active session has a call waiting."""
        deadline = asyncio.get_running_loop().time() + self._gather_s
        active = {cid for cid, at in self._last_seen.items() if at >= self._passes - 1}
        while active - {call.cache_id for call, _, _ in self._waiting}:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._gather()
                batch = self._take()
                if not batch:
                    break
                self._passes += 1
                for call, _, _ in batch:
                    self._last_seen[call.cache_id] = self._passes
                if len(self._last_seen) > 4 * len(batch) + 64:  # forget sessions long gone
                    self._last_seen = {c: at for c, at in self._last_seen.items() if at >= self._passes - 1}
                calls = [call for call, _, _ in batch]
                started = loop.time()
                try:
                    results = await loop.run_in_executor(self._executor, self._engine.verify_batch, calls)
                except Exception as exc:  # noqa: BLE001 - delivered to every caller of this pass
                    results = [exc] * len(batch)
                for (_, future, arrived), result in zip(batch, results):
                    if future.done():
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        if result.load is not None:
                            result = replace(result, load=replace(result.load, queue_ms=(started - arrived) * 1000))
                        future.set_result(result)
        finally:
            self._draining = False
