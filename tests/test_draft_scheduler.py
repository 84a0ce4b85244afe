"""The draft's scheduler without gRPC: proposals batched together, drafting ahead after the reply."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from draft_service.engine import Proposal, ProposeCall
from draft_service.scheduler import DraftScheduler, rows_of
from specdec.sampling import Sampling


class _Drafter:
    """Stands in for a DraftEngine: records each batch's cache ids and each call drafted ahead, and
    answers from ahead for cache "warm"; drafting ahead for cache "gone" fails."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.ahead: list[str] = []

    def propose_batch(self, calls: list[ProposeCall]) -> list[Proposal]:
        self.batches.append([c.cache_id for c in calls])
        return [Proposal([4] * c.k, [], 3, from_ahead=c.cache_id == "warm") for c in calls]

    def draft_ahead(self, call: ProposeCall) -> int:
        self.ahead.append(call.cache_id)
        if call.cache_id == "gone":
            raise LookupError(call.cache_id)
        return call.ahead


def _call(cache_id: str, k: int = 2, ahead: int = 0) -> ProposeCall:
    return ProposeCall(cache_id, 3, [], k, Sampling(), 0, ahead=ahead)


def test_proposals_that_arrive_together_share_a_batch_and_ahead_follows_the_reply():
    """Calls submitted together are drafted in one batch; drafting ahead is queued for the calls that
    ask for it and were not answered from ahead, and its failure reaches no caller."""
    drafter, executor = _Drafter(), ThreadPoolExecutor(max_workers=1)

    async def main():
        scheduler = DraftScheduler(drafter, executor)
        calls = [_call("a", ahead=3), _call("warm", ahead=3), _call("gone", ahead=3), _call("b")]
        proposals = await asyncio.gather(*(scheduler.propose(c) for c in calls))
        await asyncio.sleep(0.05)  # let the batcher's gathering window close before the loop does
        return proposals

    try:
        proposals = asyncio.run(main())
    finally:
        executor.shutdown(wait=True)  # the queued drafting ahead has run
    assert [p.tokens for p in proposals] == [[4, 4]] * 4
    assert drafter.batches == [["a", "warm", "gone", "b"]] and drafter.ahead == ["a", "gone"]
    assert rows_of(_call("a", k=0)) == 1 and rows_of(_call("a", k=5)) == 5
