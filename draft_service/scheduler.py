"""The draft's call scheduling: proposals that arrive together share one batch, and drafting ahead
follows each reply on the model's thread.

No gRPC here: ``draft_service.server`` decodes requests into ``ProposeCall``s and encodes proposals.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor

from draft_service.engine import DraftEngine, Proposal, ProposeCall
from specdec.batching import PassBatcher

log = logging.getLogger(__name__)

# Sessions reach the draft right after a shared verify pass, a few ms apart: a short gathering window
# (the target's is 30 ms, see specdec.batching).
GATHER_MS = 10.0


def rows_of(call: ProposeCall) -> int:
    """What a proposal adds to a batch's row budget: its k draft positions (at least one)."""
    return max(1, call.k)


class DraftScheduler:
    """Owns the draft's batcher: proposals that arrive together are drafted together (one ragged pass
    per draft position), and a call that asks to draft ahead gets that work queued after its reply."""

    def __init__(self, engine: DraftEngine, executor: Executor, max_batch_rows: int = 256) -> None:
        """``executor`` is the engine's one worker thread (``specdec.model_thread``)."""
        self._engine = engine
        self._executor = executor
        self._batcher = PassBatcher(engine.propose_batch, executor, rows_of, max_batch_rows, gather_ms=GATHER_MS)

    async def propose(self, call: ProposeCall) -> Proposal:
        """Drafts ``call`` in the next batch; raises the error that call caused."""
        proposal = await self._batcher.submit(call)
        if call.ahead and not proposal.from_ahead:
            # Queued on the model's one worker thread before this reply leaves, so it runs before
            # the session's next proposal can arrive, whatever the timing.
            asyncio.get_running_loop().run_in_executor(self._executor, self._draft_ahead, call)
        return proposal

    def idle(self, cache_id: str) -> None:
        """The session of ``cache_id`` ended its turn: the next batch does not wait for it."""
        self._batcher.idle(cache_id)

    def _draft_ahead(self, call: ProposeCall) -> None:
        """Drafts ahead for ``call``; a failure costs only the tokens ahead (the cache may be gone)."""
        try:
            self._engine.draft_ahead(call)
        except Exception:  # noqa: BLE001 - nobody waits on this work
            log.debug("drafting ahead failed for cache %s", call.cache_id, exc_info=True)
