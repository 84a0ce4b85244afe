"""Keeps one service's replica set in step with a discovery source.

A replica that leaves is retired at once, so no new work goes to it and its sessions move on their
next round. A replica that joins is first checked like the replicas at start-up (ready, and serving
a model with the coordinator's tokenizer); only then does it take work. One that fails the check is
logged and skipped: for good when its tokenizer differs, until the next retry otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Generic

from coordinator.discovery import Source
from coordinator.replicas import R, ReplicaSet
from specdec.vocab import ModelFacts

log = logging.getLogger(__name__)

# Seconds between sweeps, which close idle retired replicas and retry skipped ones.
_TICK_S = 1.0


class Refused(RuntimeError):
    """A replica that answers but must never take work (its model does not fit); not retried."""


class Membership(Generic[R]):
    """Follows a source into a ``ReplicaSet``; start with ``start``, end with ``stop``."""

    def __init__(
        self,
        service: str,
        source: Source,
        replicas: ReplicaSet[R],
        make: Callable[[str], R],
        check: Callable[[R], Awaitable[ModelFacts]],
        retry_s: float,
        on_join: Callable[[R, ModelFacts], None] | None = None,
    ) -> None:
        """``check`` returns a replica's facts, raising ``Refused`` for one that must never take work
        and anything else for one to try again after ``retry_s``; ``on_join`` hears of each joiner."""
        self._service = service
        self._source = source
        self.replicas = replicas
        self._make = make
        self._check = check
        self._retry_s = retry_s
        self._on_join = on_join
        # The latest published addresses; None until the source first answers.
        self._wanted: frozenset[str] | None = None
        self._changed = asyncio.Event()
        self._pending: dict[str, asyncio.Task] = {}
        # Addresses that failed their check, and when to try each again (inf: never while listed).
        self._skipped: dict[str, float] = {}
        # Facts of the first replica that joined, and its arrival.
        self._first: ModelFacts | None = None
        self._joined = asyncio.Event()
        self._settled = asyncio.Event()
        self._task: asyncio.Task | None = None
        # Facts of each member that joined through this membership.
        self.facts: dict[str, ModelFacts] = {}

    def start(self) -> None:
        """Starts following the source on the running loop."""
        self._task = asyncio.create_task(self._run(), name=f"{self._service} discovery")

    async def stop(self) -> None:
        """Stops following and drops unfinished checks (members stay, for the caller to close)."""
        tasks = [t for t in (self._task, *self._pending.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def first_facts(self, timeout_s: float) -> ModelFacts:
        """Waits until a replica has joined and returns its facts; TimeoutError after ``timeout_s``."""
        try:
            await asyncio.wait_for(self._joined.wait(), timeout_s)
        except TimeoutError:
            found = "none listed" if not self._wanted else f"{len(self._wanted)} listed, none usable"
            raise TimeoutError(f"no {self._service} replica joined within {timeout_s:.0f}s ({found})") from None
        return self._first

    async def settled(self, timeout_s: float) -> bool:
        """Waits until the source has answered and every replica it listed then is checked; False
        when that takes longer than ``timeout_s``."""
        try:
            await asyncio.wait_for(self._settled.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    def _publish(self, addresses: frozenset[str]) -> None:
        self._wanted = addresses
        self._changed.set()

    async def _run(self) -> None:
        source = asyncio.create_task(self._source.run(self._publish), name=f"{self._service} source")
        try:
            while True:
                try:
                    # Wakes on each change, and at least as often as skipped replicas are retried.
                    await asyncio.wait_for(self._changed.wait(), min(_TICK_S, self._retry_s))
                except TimeoutError:
                    pass
                self._changed.clear()
                if source.done():
                    # Sources survive lookup and API failures themselves; this is a bug, so say so loudly.
                    log.error(
                        "%s discovery stopped (%r); restarting it",
                        self._service,
                        None if source.cancelled() else source.exception(),
                    )
                    source = asyncio.create_task(self._source.run(self._publish), name=f"{self._service} source")
                self._apply()
                for replica in self.replicas.sweep():
                    await replica.close()
        finally:
            source.cancel()
            await asyncio.gather(source, return_exceptions=True)

    def _apply(self) -> None:
        """Retires members no longer listed and checks listed addresses that are not members yet."""
        if self._wanted is None:
            return
        for address in [a for a in self.replicas.by_address if a not in self._wanted]:
            self.replicas.retire(address)
            self.facts.pop(address, None)
            log.info("%s replica %s left", self._service, address)
        self._skipped = {a: t for a, t in self._skipped.items() if a in self._wanted}
        now = time.monotonic()
        for address in sorted(self._wanted):
            if address in self.replicas.by_address or address in self._pending:
                continue
            if self._skipped.get(address, 0.0) > now:
                continue
            self._pending[address] = asyncio.create_task(self._admit(address))
        if not self._pending:
            self._settled.set()

    async def _admit(self, address: str) -> None:
        """Checks a listed address and, if it is still listed and fits, adds it to the set."""
        replica = self._make(address)
        joined = False
        try:
            facts = await self._check(replica)
            if self._wanted is not None and address in self._wanted:
                self.replicas.add(replica)
                self.facts[address] = facts
                joined = True
                self._skipped.pop(address, None)
                log.info("%s replica %s joined (%s)", self._service, address, facts.name)
                if self._on_join is not None:
                    self._on_join(replica, facts)
                self._first = self._first or facts
                self._joined.set()
        except Refused as exc:
            self._skipped[address] = math.inf
            log.error("%s replica %s skipped: %s", self._service, address, exc)
        except Exception as exc:  # noqa: BLE001 - an unreachable or failing replica is retried later
            self._skipped[address] = time.monotonic() + self._retry_s
            log.warning(
                "%s replica %s not usable yet, retrying in %.1fs: %s", self._service, address, self._retry_s, exc
            )
        finally:
            del self._pending[address]
            if not joined:
                await replica.close()
            if not self._pending and self._wanted is not None:
                self._settled.set()
