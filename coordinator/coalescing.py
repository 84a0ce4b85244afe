"""Calls that a coordinator's sessions make in one event-loop turn, sent as one batched call.

At several streams the target's verify pass returns every session's verdict at once, and each
session answers with its next round moments later. Sent as one gRPC call each, those rounds queue
behind one another in the target's event loop, which pays a fixed cost for every call in and every
reply out, and the next pass waits for the last of them. Gathered into one call (``VerifyBatch``),
they cost the loop one call's overhead and still join the next pass together.

A call waits for nothing but the rest of the current event-loop turn: the batch goes out as soon as
the sessions that were ready when it began have made their calls, so a lone session's round is never
held back.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Q = TypeVar("Q")
A = TypeVar("A")

# Sends a batch with the longest of its calls' timeouts; returns each call's answer or the error it
# failed with, in order (raising fails them all).
Send = Callable[[list[Q], float], Awaitable[Sequence[A | Exception]]]


class Coalescer(Generic[Q, A]):
    """Gathers the calls made in one event-loop turn into one batched ``send``."""

    def __init__(self, send: Send[Q, A]) -> None:
        self._send = send
        self._pending: list[tuple[Q, asyncio.Future[A], float]] = []
        self._sending: set[asyncio.Task[None]] = set()

    @property
    def busy(self) -> bool:
        """Whether a call waits to be sent or for its batch's answer."""
        return bool(self._pending or self._sending)

    async def call(self, request: Q, timeout_s: float) -> A:
        """Sends ``request`` in the next batch; its answer, or the error it failed with.

        Raises ``TimeoutError`` when no answer came within ``timeout_s`` (the batch may still be
        running for the other calls in it).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[A] = loop.create_future()
        self._pending.append((request, future, timeout_s))
        if len(self._pending) == 1:
            # In a context of its own: the batch is no one session's, and must not run in the trace
            # context of whichever call came first.
            loop.call_soon(self._flush, context=contextvars.Context())
        return await asyncio.wait_for(future, timeout_s)

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        live = [(request, future, timeout) for request, future, timeout in batch if not future.done()]
        if live:
            task = asyncio.get_running_loop().create_task(self._deliver(live))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _deliver(self, batch: list[tuple[Q, asyncio.Future[A], float]]) -> None:
        answers: Sequence[A | Exception] = ()
        try:
            answers = await self._send([request for request, _, _ in batch], max(timeout for _, _, timeout in batch))
            if len(answers) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} calls was answered {len(answers)} times")
        except Exception as exc:  # noqa: BLE001 - the batch's failure is each of its calls'
            answers = [exc] * len(batch)
        except asyncio.CancelledError:
            answers = [ConnectionAbortedError("the batched call was cancelled")] * len(batch)
            raise
        finally:
            for (_, future, _), answer in zip(batch, answers):
                if future.done():  # its caller gave up (timeout or cancellation)
                    continue
                if isinstance(answer, Exception):
                    future.set_exception(answer)
                else:
                    future.set_result(answer)
