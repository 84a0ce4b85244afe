"""A request's several choices: their requests, the prefill they share, and running them side by side.

A request for n choices (OpenAI's ``n``, ``GenerateRequest.n``) runs n turns side by side, each on a
session of its own; choice i samples as the same request with seed + i. Their prompts are the same
tokens, so n prefills would run the prompt through the target n times. Instead the choices of one
prompt share a ``PromptForks``:

- the first choice to place a target cache prefills it, fed at once (so its KV holds the whole
  prompt), and publishes it; every other choice waits for that prefill and forks the cache on the
  replica that holds it (``PrefillRequest.fork_of``), which copies its KV instead of computing it, and
  takes a copy of the hidden rows the prefill returned (for a feature draft);
- likewise the first choice to need a draft cache prefills it and publishes it once its first
  proposal is made (a feature draft then holds the prompt's features and KV pairs); the others wait
  for that and fork it at their first draft call, on its replica, so the draft too takes the prompt
  in once.

A position's KV does not depend on the pass that computed it (``specdec.invariance``), so a forked cache
holds bit for bit what a prefill would: every choice's output is what it is alone. Whatever keeps a
fork from happening (the first prefill failed, its cache was evicted, its replica rests) only makes
that choice prefill as it would alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Generic, TypeVar

from coordinator.replicas import CacheRef, HiddenChunk

if TYPE_CHECKING:
    from coordinator.turns import Chunk, GenerationRequest

T = TypeVar("T")

# Most choices (n times the prompts) one request may ask for: each runs as a session of its own, so
# one request must not fan out without bound.
MAX_CHOICES = 64


@dataclass(frozen=True)
class SharedPrefill:
    """The first choice's target cache right after its prefill: where it is, over which committed
    tokens, and the hidden rows that prefill fed (None when none were asked for)."""

    ref: CacheRef
    tokens: tuple[int, ...]
    hidden: HiddenChunk | None


class FirstOfMany(Generic[T]):
    """Something the first of several callers builds while the others wait to use it."""

    def __init__(self) -> None:
        self._future: asyncio.Future[T | None] | None = None

    def first(self) -> bool:
        """Whether the caller is the first: it then builds the thing, and must ``settle`` however that
        ends. Every later caller waits for it (``wait``)."""
        if self._future is not None:
            return False
        self._future = asyncio.get_running_loop().create_future()
        return True

    def settle(self, value: T | None) -> None:
        """The first caller's work ended: what it built, or None (it failed; the others build their own)."""
        assert self._future is not None
        if not self._future.done():
            self._future.set_result(value)

    async def wait(self) -> T | None:
        """What the first caller built, once it has (None: it failed). A caller cancelled meanwhile
        leaves the others waiting undisturbed."""
        assert self._future is not None
        return await asyncio.shield(self._future)


class PromptForks:
    """What the choices of one prompt share: the first target cache placed, and the first draft cache
    that proposed (after its first proposal, a feature draft's holds the prompt's features too).

    Lives on the coordinator that runs the request, for as long as its choices run; nothing of it is
    stored (each choice's session record holds its own caches)."""

    def __init__(self) -> None:
        self.target: FirstOfMany[SharedPrefill] = FirstOfMany()
        self.draft: FirstOfMany[CacheRef] = FirstOfMany()


def choice_requests(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The ``n`` choices of ``request``: choice i with seed + i (modulo 2^64; unseeded, each draws its
    own), all sharing one ``PromptForks`` when there are several."""
    if n == 1:
        return [request]
    forks = PromptForks()
    return [
        replace(request, seed=None if request.seed is None else (request.seed + i) % 2**64, forks=forks)
        for i in range(n)
    ]


def share_prefills(choices: Sequence[GenerationRequest], n: int) -> list[GenerationRequest]:
    """``choices`` in OpenAI's order (prompt-major, ``n`` per prompt), the choices of each prompt
    sharing one ``PromptForks``."""
    if n == 1:
        return list(choices)
    out = []
    for start in range(0, len(choices), n):
        forks = PromptForks()
        out += [replace(choice, forks=forks) for choice in choices[start : start + n]]
    return out


class ChoiceRuns:
    """A request's choices, run side by side: each choice's chunks (or its failure) arrive on one queue,
    tagged with the choice's index. ``close`` cancels whatever still runs, which closes its round-loop
    generator and frees its slot and lease.

    However a choice's run ends, it queues an end marker after its chunks: None after its finish
    chunk, else its failure, which the reader raises. An ending that is no ``Exception`` (such as a
    ``CancelledError`` from inside the run) comes as a RuntimeError caused by it. So a reader never
    waits for a choice that has stopped."""

    def __init__(self, runs: Sequence[AsyncGenerator[Chunk, None]]) -> None:
        # Unbounded: a choice waiting for an admission slot must not stall the others that hold one.
        self._queue: asyncio.Queue[tuple[int, Chunk | Exception | None]] = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(index, run)) for index, run in enumerate(runs)]
        self._running = len(self._tasks)

    async def _pump(self, index: int, run: AsyncGenerator[Chunk, None]) -> None:
        end: Exception | None = None
        try:
            async with aclosing(run) as chunks:
                async for chunk in chunks:
                    self._queue.put_nowait((index, chunk))
                    if chunk.finish_reason is not None:
                        return
            end = RuntimeError("the round loop's stream ended without a finish reason")
        except Exception as exc:  # noqa: BLE001 - the failure is the whole request's
            end = exc
        except BaseException as exc:
            end = RuntimeError(f"choice {index} stopped: {type(exc).__name__}")
            end.__cause__ = exc
            raise
        finally:
            self._queue.put_nowait((index, end))

    async def next(self) -> tuple[int, Chunk]:
        """The next chunk of any choice, with its index; a choice's failure is raised. Call it only
        while some choice has not sent its finish chunk."""
        while True:
            index, item = await self._queue.get()
            if isinstance(item, Exception):
                raise item
            if item is not None:
                return index, item

    async def chunks(self) -> AsyncGenerator[tuple[int, Chunk], None]:
        """Every choice's chunks with their index, as they come, until each choice has finished; the
        first failure of any choice is raised."""
        while self._running:
            index, chunk = await self.next()
            if chunk.finish_reason is not None:
                self._running -= 1
            yield index, chunk

    async def close(self) -> None:
        """Stops every choice still running and waits until each has let go of its turn."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
