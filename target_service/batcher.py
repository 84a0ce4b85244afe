"""Continuous batching at round granularity: verify calls that arrive together share one pass.

While a pass runs, newly arrived calls wait; when it ends, every waiting call (up to a row budget)
goes into the next pass. A session therefore joins or leaves the batch between passes, nobody waits
for more than the pass in flight, and an idle target starts a lone call at once (no batching delay).
"""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import Executor

from target_service.engine import TargetEngine, VerifyCall, VerifyOutcome


class VerifyBatcher:
    """Queues verify calls and runs them in batched passes on the engine's one worker thread."""

    def __init__(self, engine: TargetEngine, executor: Executor, max_batch_rows: int) -> None:
        self._engine = engine
        self._executor = executor
        self._max_rows = max_batch_rows
        self._waiting: deque[tuple[VerifyCall, asyncio.Future]] = deque()
        self._draining = False

    async def verify(self, call: VerifyCall) -> VerifyOutcome:
        """Verifies one call in the next pass; raises the error that call caused."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((call, future))
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    def _take(self) -> list[tuple[VerifyCall, asyncio.Future]]:
        """The oldest waiting calls whose rows fit the budget (always at least one)."""
        batch, rows = [], 0
        while self._waiting:
            call, future = self._waiting[0]
            if future.cancelled():  # its client gave up: skip it rather than spend a row on it
                self._waiting.popleft()
                continue
            need = len(call.draft_tokens) + 1
            if batch and rows + need > self._max_rows:
                break
            batch.append(self._waiting.popleft())
            rows += need
        return batch

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while batch := self._take():
                calls = [call for call, _ in batch]
                try:
                    results = await loop.run_in_executor(self._executor, self._engine.verify_batch, calls)
                except Exception as exc:  # noqa: BLE001 - delivered to every caller of this pass
                    results = [exc] * len(batch)
                for (_, future), result in zip(batch, results):
                    if future.done():
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._draining = False
