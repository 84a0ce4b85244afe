"""Admission: a bound on requests in flight, a bounded queue behind it, and fairness across clients.

A request runs at once while fewer than ``max_active`` run. Otherwise it waits in its client's own
queue; a freed slot goes to the clients with waiting requests in turn (round robin), so one client's
burst waits behind itself, not in front of everyone else. When ``max_queued`` requests already wait,
or the client already holds ``max_per_client`` requests (running or waiting), the request is refused
at once with a hint of when to retry, instead of piling up until deadlines expire.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from specdec.config import AdmissionLimits


class Overloaded(Exception):
    """No room for the request now; ``retry_after_s`` is when a retry is likely to be admitted."""

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(f"{reason}; retry after about {retry_after_s:.1f} s")
        self.retry_after_s = retry_after_s


class Admission:
    """Slots for running requests, granted in client round-robin order."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self._limits = limits
        self._active = 0
        self._queues: OrderedDict[str, deque[asyncio.Future]] = OrderedDict()  # client -> waiters, turn order
        self._held: dict[str, int] = {}  # client -> requests running or waiting
        # Moving average of how long a request holds its slot, for the retry hint.
        self._hold_s = 2.0

    @property
    def active(self) -> int:
        """Requests running now."""
        return self._active

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return sum(len(q) for q in self._queues.values())

    def retry_after_s(self) -> float:
        """Rough time until a request sent now would get a slot: the queue ahead drains in waves."""
        waves = math.ceil((self.queued + 1) / max(1, self._limits.max_active))
        return max(0.5, waves * self._hold_s)

    @asynccontextmanager
    async def slot(self, client: str) -> AsyncIterator[None]:
        """Holds a running slot for ``client`` for the duration of the block; raises Overloaded."""
        limits = self._limits
        if limits.max_per_client and self._held.get(client, 0) >= limits.max_per_client:
            raise Overloaded(f"client holds {limits.max_per_client} requests, its limit", self.retry_after_s())
        if not (self._active < limits.max_active and not self._queues) and self.queued >= limits.max_queued:
            raise Overloaded(f"{limits.max_queued} requests already wait", self.retry_after_s())
        self._held[client] = self._held.get(client, 0) + 1
        try:
            if self._active < limits.max_active and not self._queues:
                self._active += 1
            else:
                waiter = asyncio.get_running_loop().create_future()
                self._queues.setdefault(client, deque()).append(waiter)
                try:
                    await waiter  # the releaser counts this request active before waking it
                except asyncio.CancelledError:
                    if waiter.done() and not waiter.cancelled():
                        self._release()  # granted and cancelled at once: hand the slot on
                    else:
                        self._forget(client, waiter)
                    raise
            started = asyncio.get_running_loop().time()
            try:
                yield
            finally:
                self._hold_s += 0.1 * (asyncio.get_running_loop().time() - started - self._hold_s)
                self._release()
        finally:
            self._drop(client)

    def _drop(self, client: str) -> None:
        self._held[client] -= 1
        if self._held[client] <= 0:
            del self._held[client]

    def _forget(self, client: str, waiter: asyncio.Future) -> None:
        queue = self._queues.get(client)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._queues[client]

    def _release(self) -> None:
        """Frees a slot and grants it to the next client in turn that has a request waiting."""
        self._active -= 1
        while self._queues and self._active < self._limits.max_active:
            client, queue = next(iter(self._queues.items()))
            waiter = queue.popleft()
            # This client's turn is used: it goes to the back of the order, or leaves it if empty.
            del self._queues[client]
            if queue:
                self._queues[client] = queue
            if not waiter.done():
                self._active += 1
                waiter.set_result(None)
