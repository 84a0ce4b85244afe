"""Continuous batching at round granularity: calls that arrive together share one pass.

The target batches its verify calls and the draft its propose calls, the same way.

While a pass runs, newly arrived calls wait; when it ends, every waiting call (up to a row budget)
goes into the next pass. A session therefore joins or leaves the batch between passes, and nobody
waits for more than the pass in flight plus a short gathering window.

The window exists because the sessions of one pass all get their verdicts at once and come back a
few milliseconds apart (each coordinator streams, then calls again). Without it the first to come back
would find the target idle and run alone, and the rest would run in a second pass: two passes per
round instead of one, and the two groups stay out of step for good. So after a pass of several
sessions (or one during which another call arrived), the next pass waits until each of them has a
call waiting again (calls that arrived during the pass are already there), or until the window
closes, whichever comes first. A lone session never waits, and a session that does not come back
within the window is not waited for again. A session whose turn ended is not waited for at all once
its coordinator says so (``idle``): a request's end would otherwise hold the next pass a whole window.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


@dataclass(frozen=True)
class PassLoad:
    """A batched pass as one of its sessions saw it (``PassLoad`` in the proto); it steers that
    session's next draft length (``coordinator.adaptive``)."""

    sessions: int
    """Sessions verified in the pass."""
    rows: int
    """Token rows the pass fed, all sessions together."""
    others_committed: int
    """Tokens the pass committed for the other sessions."""
    pass_ms: float
    """How long the pass took."""
    curve_ms: list[float]
    """Predicted pass ms had this session fed 1, 2, ... rows beside the others' rows."""
    alone_ms: list[float]
    """Predicted pass ms had this session fed 1, 2, ... rows alone."""
    queue_ms: float = 0.0
    """How long the call waited before its pass began (the batcher fills it in)."""
    fed_rows: int = 0
    """Rows this session fed: its draft tokens + 1, more when the pass also fed its deferred prompt."""


class BatchCall(Protocol):
    """What the batcher reads from a call: the session cache it works on."""

    cache_id: str


C = TypeVar("C", bound=BatchCall)
R = TypeVar("R")


def waves(calls: Sequence[BatchCall]) -> Iterator[list[int]]:
    """Indices of ``calls`` in waves in which no cache appears twice, in arrival order.

    Two calls of one session (racing coordinators) must never share a pass: the later one runs in a
    later wave, after the earlier one's effect on the cache.
    """
    remaining = list(range(len(calls)))
    while remaining:
        seen: set[str] = set()
        wave, later = [], []
        for i in remaining:
            (later if calls[i].cache_id in seen else wave).append(i)
            seen.add(calls[i].cache_id)
        yield wave
        remaining = later


class PassBatcher(Generic[C, R]):
    """Queues calls and runs them in batched passes on the engine's one worker thread.

    ``run(calls) -> [result or exception]`` does one batch; ``rows_of(call)`` is what a call adds to
    a pass (the row budget); ``stamp(result, queue_ms)`` may record how long the call waited.
    """

    def __init__(
        self,
        run: Callable[[list[C]], list[R | Exception]],
        executor: Executor,
        rows_of: Callable[[C], int],
        max_batch_rows: int,
        stamp: Callable[[R, float], R] | None = None,
        gather_ms: float = 30.0,
    ) -> None:
        self._run = run
        self._executor = executor
        self._rows_of = rows_of
        self._stamp = stamp
        self._max_rows = max_batch_rows
        self._gather_s = gather_ms / 1000
        self._waiting: deque[tuple[C, asyncio.Future, float]] = deque()  # call, result, arrival
        self._arrived = asyncio.Event()
        self._draining = False
        self._expected: set[str] = set()  # sessions of the last pass, when it held several

    @property
    def busy(self) -> bool:
        """True while a pass runs or calls wait for one."""
        return self._draining

    async def submit(self, call: C) -> R:
        """Runs one call in the next pass; raises the error that call caused."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.append((call, future, loop.time()))
        self._arrived.set()
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    def idle(self, cache_id: str) -> None:
        """The session of ``cache_id`` has no call coming (its turn ended): the next pass does not wait
        for it."""
        if cache_id in self._expected:
            self._expected.discard(cache_id)
            self._arrived.set()

    def _take(self) -> list[tuple[C, asyncio.Future, float]]:
        """The oldest waiting calls whose rows fit the budget (always at least one)."""
        batch, rows = [], 0
        while self._waiting:
            call, future, _ = self._waiting[0]
            if future.cancelled():  # its client gave up: skip it rather than spend a row on it
                self._waiting.popleft()
                continue
            need = self._rows_of(call)
            if batch and rows + need > self._max_rows:
                break
            batch.append(self._waiting.popleft())
            rows += need
        return batch

    async def _gather(self) -> None:
        """Waits, up to the window, until every session of the last pass has a call waiting."""
        deadline = asyncio.get_running_loop().time() + self._gather_s
        while missing := self._expected - {call.cache_id for call, _, _ in self._waiting}:
            left = deadline - asyncio.get_running_loop().time()
            if left > 0:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                    continue
                except TimeoutError:
                    pass
            self._expected -= missing  # ended, or drafting elsewhere: not waited for again
            return

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._gather()
                batch = self._take()
                if not batch:
                    break
                calls = [call for call, _, _ in batch]
                started = loop.time()
                try:
                    results = await loop.run_in_executor(self._executor, self._run, calls)
                except Exception as exc:  # noqa: BLE001 - delivered to every caller of this pass
                    results = [exc] * len(batch)
                # Sessions run concurrently when the pass held several, or another call arrived while it
                # ran: then the next pass waits for this one's sessions (else two lone sessions would
                # alternate, one pass each, for good). A lone session's pass expects nothing.
                concurrent = len(batch) > 1 or any(not f.cancelled() for _, f, _ in self._waiting)
                self._expected = {call.cache_id for call in calls} if concurrent else set()
                for (_, future, arrived), result in zip(batch, results):
                    if future.done():
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        if self._stamp is not None:
                            result = self._stamp(result, (started - arrived) * 1000)
                        future.set_result(result)
        finally:
            self._draining = False
