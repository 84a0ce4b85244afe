"""The draft engine as a coordinator backend in the same process, with no gRPC in between.

``InProcessDraft`` implements ``coordinator.replicas.DraftBackend`` over a ``DraftEngine``, so the
round loop and the speculation policy run against real drafters in tests without a network.
Engine errors become the errors the gRPC client raises for the same statuses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from coordinator.replicas import CacheRef, DraftResult, Forked, HiddenChunk, core_error
from draft_service.engine import DraftEngine, ProposeCall
from specdec.hidden_wire import hidden_from_fp16
from specdec.sampling_params import Sampling
from specdec.trees import TreeShape
from specdec.vocab import ModelFacts

T = TypeVar("T")


class InProcessDraft:
    """A draft replica in this process."""

    service = "draft"

    def __init__(self, engine: DraftEngine, address: str = "inprocess:draft") -> None:
        self.address = address
        self._engine = engine
        self.busy = False  # calls finish before they return: none is ever cut off

    def _run(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - translated as the gRPC client would
            raise core_error(self.service, self.address, exc) from exc

    async def prefill(self, tokens: list[int], remaining_s: float | None = None, fence: int = 0) -> CacheRef:
        """Creates a cache over the committed ``tokens``."""
        cache_id, committed = self._run(lambda: self._engine.prefill(list(tokens), fence))
        return CacheRef(self.address, cache_id, committed, fence)

    async def propose(
        self,
        ref: CacheRef,
        committed: list[int],
        k: int,
        sampling: Sampling,
        round_index: int,
        remaining_s: float | None,
        hidden: HiddenChunk | None = None,
        min_confidence: float = 0.0,
        ahead: int = 0,
        tree: TreeShape | None = None,
    ) -> DraftResult:
        """Syncs the cache to ``committed`` (taking in target hidden states) and proposes up to ``k``
        tokens; then drafts ``ahead`` tokens ahead, as the service does once its reply has left."""
        start = min(ref.committed, len(committed))

        def propose_one():
            width = self._engine.hidden_size
            rows = hidden_from_fp16(hidden.start, hidden.dim, hidden.fp16, width) if hidden and width else None
            call = ProposeCall(
                ref.cache_id,
                start,
                committed[start:],
                k,
                sampling,
                round_index,
                rows,
                ref.fence,
                min_confidence,
                ahead,
                tree,
            )
            proposal = self._engine.propose_batch([call])[0]
            if isinstance(proposal, Exception):
                raise proposal
            if ahead and not proposal.from_ahead:
                self._engine.draft_ahead(call)
            return proposal

        proposal = self._run(propose_one)
        return DraftResult(
            list(proposal.tokens),
            [(list(ids), list(p)) for ids, p in proposal.q],
            proposal.committed,
            proposal.from_ahead,
            proposal.looked_up,
            tuple(proposal.parents),
        )

    async def fork(
        self, source: CacheRef, tokens: list[int], remaining_s: float | None = None, fence: int = 0
    ) -> Forked:
        """Creates a cache over ``tokens`` copying ``source``'s state where their tokens match."""
        cache_id, committed, copied = self._run(lambda: self._engine.fork(source.cache_id, list(tokens), fence))
        return Forked(CacheRef(self.address, cache_id, committed, fence), copied)

    async def release(self, cache_id: str, remaining_s: float | None = None) -> None:
        """Drops a cache."""
        self._engine.release(cache_id)

    async def idle(self, cache_id: str, remaining_s: float | None = None) -> None:
        """Nothing to tell: in process, calls run as they come and never wait for other sessions."""

    async def facts(self, remaining_s: float | None = None) -> ModelFacts:
        """The draft's model facts."""
        return self._engine.facts

    async def close(self) -> None:
        """Nothing to release: the engine belongs to the caller."""
