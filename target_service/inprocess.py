"""The target engine as a coordinator backend in the same process, with no gRPC in between.

``InProcessTarget`` implements ``coordinator.replicas.TargetBackend`` over a ``TargetEngine``, so
the round loop and the speculation policy run against a real model in tests without a network.
Each call runs the engine inline: one session's rounds at a time, as the gRPC servicer would feed
them one by one. Engine errors become the errors the gRPC client raises for the same statuses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from coordinator.replicas import CacheRef, DraftResult, Forked, HiddenChunk, VerifyResult, core_error
from specdec.hidden_wire import hidden_to_fp16
from specdec.kvcache import HiddenRows
from specdec.sampling_params import Sampling, TokenLogprob
from specdec.vocab import ModelFacts
from target_service.engine import SparseQ, TargetEngine, VerifyCall

T = TypeVar("T")


def hidden_chunk(hidden: HiddenRows | None) -> HiddenChunk | None:
    """Hidden rows in the form the coordinator passes on (fp16 bytes, as on the wire)."""
    return None if hidden is None else HiddenChunk(*hidden_to_fp16(hidden))


class InProcessTarget:
    """A target replica in this process."""

    service = "target"

    def __init__(self, engine: TargetEngine, address: str = "inprocess:target") -> None:
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
        ref, _ = await self.prefill_with_hidden(tokens, remaining_s, False, fence)
        return ref

    async def prefill_with_hidden(
        self,
        tokens: list[int],
        remaining_s: float | None,
        with_hidden: bool,
        fence: int = 0,
        feed_now: bool = False,
        side_layers: tuple[int, ...] = (),
    ) -> tuple[CacheRef, HiddenChunk | None]:
        """``prefill``, also returning the fed positions' hidden states when ``with_hidden``. The
        prompt is always fed now: in process there is no busy pass to fold it into."""
        cache_id, committed, hidden = self._run(
            lambda: self._engine.prefill(list(tokens), with_hidden, fence, side_layers=side_layers)
        )
        return CacheRef(self.address, cache_id, committed, fence), hidden_chunk(hidden) if with_hidden else None

    async def prefill_scored(
        self,
        tokens: list[int],
        remaining_s: float | None,
        top: int,
        with_hidden: bool,
        fence: int = 0,
        side_layers: tuple[int, ...] = (),
    ) -> tuple[CacheRef, HiddenChunk | None, list[TokenLogprob]]:
        """``prefill_with_hidden`` into a fresh cache, also returning the prompt's logprobs with ``top``
        alternatives (``TargetEngine.prefill_scored``)."""
        cache_id, committed, hidden, scored = self._run(
            lambda: self._engine.prefill_scored(list(tokens), top, with_hidden, fence, side_layers)
        )
        ref = CacheRef(self.address, cache_id, committed, fence)
        return ref, hidden_chunk(hidden) if with_hidden else None, scored

    async def verify(
        self,
        ref: CacheRef,
        committed: list[int],
        draft: DraftResult | None,
        sampling: Sampling,
        round_index: int,
        remaining_s: float | None,
        with_hidden: bool = False,
        side_layers: tuple[int, ...] = (),
        top_logprobs: int | None = None,
    ) -> VerifyResult:
        """Syncs the cache to ``committed``, verifies the draft's tokens and commits accepted + 1 (with
        each committed token's logprob when ``top_logprobs`` is set)."""
        start = min(ref.committed, len(committed))
        tokens, q = (list(draft.tokens), [SparseQ(ids, probs) for ids, probs in draft.q]) if draft else ([], [])
        call = VerifyCall(
            ref.cache_id,
            start,
            committed[start:],
            tokens,
            q,
            sampling,
            round_index,
            with_hidden,
            ref.fence,
            side_layers=side_layers,
            draft_parents=tuple(draft.parents) if draft else (),
            top_logprobs=top_logprobs,
        )

        def verify_one():
            outcome = self._engine.verify_batch([call])[0]
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        outcome = self._run(verify_one)
        hidden = hidden_chunk(outcome.hidden) if with_hidden else None
        path = tuple(outcome.path) if outcome.path is not None else None
        return VerifyResult(
            outcome.accepted, list(outcome.tokens), outcome.committed, hidden, outcome.load, path, outcome.logprobs
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
        """The target's model facts."""
        return self._engine.facts

    async def close(self) -> None:
        """Nothing to release: the engine belongs to the caller."""
