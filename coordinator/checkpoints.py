"""Writing a running turn's progress to the session store without holding up its stream.

Each round hands its record over; one background write runs at a time and always carries the latest
round, so a slow or restarting Redis delays checkpoints, never tokens. Writes are also spaced at
least an interval apart (the turn's first and last go at once): a write costs the coordinator's one
event loop a noticeable share of a round's work for its session, and under load that loop serves
every session's rounds. A resumed turn may therefore
start a few rounds back from where its client was; it replays them and streams only what the client
has not seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace

from coordinator.replicas import Fenced
from coordinator.sessions import SessionRecord, SessionStore, StoreUnavailable

log = logging.getLogger(__name__)


class Checkpoints:
    """Background writer of one turn's session record, latest round wins."""

    def __init__(self, store: SessionStore, interval_s: float = 0.0) -> None:
        self._store = store
        self._interval_s = interval_s
        self._pending: SessionRecord | None = None
        self._task: asyncio.Task | None = None
        self._last_write = float("-inf")  # event-loop time the latest write began
        self._hurry = asyncio.Event()  # set by flush: the write waiting out the interval goes now
        # Set when a newer turn took the session: the turn that owns these checkpoints must stop.
        self.fenced: Fenced | None = None
        # Set while the latest write failed (the store unreachable); a later successful one clears it.
        self._unwritten: StoreUnavailable | None = None

    def submit(self, record: SessionRecord) -> None:
        """Queues a snapshot of ``record``: its lists are copied now, so later rounds cannot change
        what is written (cache refs are frozen and shared)."""
        turn = record.turn and replace(
            record.turn,
            drafted=list(record.turn.drafted),
            accepted=list(record.turn.accepted),
            tried=list(record.turn.tried),
        )
        self._pending = replace(record, tokens=list(record.tokens), turn=turn)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending is not None and self.fenced is None:
            wait = self._last_write + self._interval_s - loop.time()
            if wait > 0 and not self._hurry.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._hurry.wait(), wait)
            record, self._pending = self._pending, None
            self._last_write = loop.time()
            try:
                await self._store.put(record)
                self._unwritten = None
            except Fenced as exc:
                self.fenced = exc
            except StoreUnavailable as exc:
                # The stream goes on; the next round's checkpoint tries again.
                self._unwritten = exc
                log.warning("checkpoint of session %s skipped: %s", record.session_id, exc)

    async def write_late(self, record: SessionRecord, delays_s: tuple[float, ...] = (1.0, 5.0, 25.0)) -> None:
        """Keeps trying to write a turn's last record after its stream has ended (the store was
        unreachable at the end), so the session's next turn finds it; gives up quietly after the
        last delay, leaving the last record that was written."""
        for delay in delays_s:
            await asyncio.sleep(delay)
            try:
                await self._store.put(record)
                return
            except Fenced:
                return  # a newer turn holds the session: its own records supersede this one
            except StoreUnavailable as exc:
                log.warning("late write of session %s's last record failed: %s", record.session_id, exc)

    async def flush(self, must_write: bool = False) -> None:
        """Waits for the write in flight, if any; raises Fenced when a newer turn took the session,
        and with ``must_write`` StoreUnavailable when the latest record could not be written."""
        self._hurry.set()
        if self._task is not None:
            await asyncio.shield(self._task)
        if self.fenced is not None:
            raise self.fenced
        if must_write and self._unwritten is not None:
            raise self._unwritten
