"""The round loop: draft proposes k tokens, the target verifies them in one pass, repeat.

Each round commits the accepted draft prefix plus one target token (recovered or bonus). The loop
streams committed tokens as they arrive and stops on EOS, max_new_tokens, a stop string, or the
context limit. Caches that a replica lost are rebuilt from the committed tokens, so a lost cache
costs time, never correctness.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

from opentelemetry import trace

from coordinator.adaptive import AcceptanceTracker, CostModel
from specdec.batching import PassLoad
from coordinator.backends import (
    BackendRejected,
    BackendUnavailable,
    CacheLost,
    CacheRef,
    DraftReplica,
    DraftResult,
    TargetReplica,
    VerifyResult,
    merge_hidden,
)
from coordinator.prompts import build_turn
from coordinator.sessions import SessionRecord, SessionStore
from coordinator.textstream import TextStream
from specdec.kvcache import common_prefix_len
from specdec.metrics import CoordinatorMetrics
from specdec.models import ModelFacts
from specdec.sampling import Sampling
from specdec.v1.common_pb2 import HiddenStates

log = logging.getLogger(__name__)


# Rounds of target-only decoding after which an adaptive session tries k = 1 again.
_PROBE_EVERY = 8
# Seconds a target's load report stays current for choosing k.
_LOAD_FRESH_S = 1.0


class SessionNotFound(LookupError):
    """The request named a session that does not exist or has expired."""


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request; exactly one of ``text`` and ``messages`` is set."""

    text: str | None
    messages: list[dict[str, str]] | None
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    session_id: str | None = None
    # None: the coordinator's default; 0: target-only.
    k: int | None = None


@dataclass
class Stats:
    """Counters of one request. Mean accepted length counts the target's own token each round."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    prefill_ms: float = 0.0
    total_ms: float = 0.0
    time_to_first_token_ms: float = 0.0
    # Committed tokens per round, summed: accepted + 1 before any truncation at a stop.
    committed_in_rounds: int = 0
    # Acceptance by draft position; it also steers the adaptive choice of k.
    positions: AcceptanceTracker = field(default_factory=AcceptanceTracker)

    def add_round(self, drafted: int, accepted: int, committed: int) -> None:
        """Counts one finished round."""
        self.rounds += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.committed_in_rounds += committed
        self.positions.record(drafted, accepted)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per round, the bonus or recovered token included."""
        return self.committed_in_rounds / self.rounds if self.rounds else 0.0

    @property
    def other_ms(self) -> float:
        """Time not spent waiting on draft or target: the coordinator's own overhead."""
        return max(0.0, self.total_ms - self.draft_ms - self.verify_ms - self.prefill_ms)


@dataclass(frozen=True)
class Chunk:
    """Streamed output; the last chunk has ``finish_reason`` and ``stats``."""

    session_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: Stats | None = None


class RoundLoop:
    """Runs requests over a set of draft and target replicas and a session store."""

    def __init__(
        self,
        tokenizer,
        target_facts: ModelFacts,
        drafts: Sequence[DraftReplica],
        targets: Sequence[TargetReplica],
        store: SessionStore,
        tracer: trace.Tracer,
        default_k: int | None,
        max_auto_k: int = 8,
        want_hidden: bool = False,
        draft_retry_s: float = 5.0,
        metrics: CoordinatorMetrics | None = None,
        draft_colocated: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._facts = target_facts
        self._drafts = {d.address: d for d in drafts}
        self._targets = {t.address: t for t in targets}
        self._store = store
        self._tracer = tracer
        self._default_k = default_k
        self._next_replica = 0
        # A feature draft reads the target's hidden states: ask the target for them, carry them over.
        self._want_hidden = want_hidden
        # A draft replica that failed is left alone this long; rounds meanwhile run target-only.
        self._draft_retry_s = draft_retry_s
        self._draft_down_until: dict[str, float] = {}
        # Measured costs steer greedy requests. Seeded sampled requests use the fixed prior curve,
        # so their k sequence, and hence their tokens, never depend on timing.
        self._costs = CostModel(k_max=max_auto_k, colocated=draft_colocated)
        self._prior_costs = CostModel(k_max=max_auto_k)
        # Prometheus metrics of this process; None records nothing.
        self._metrics = metrics
        # Each target replica's latest batched pass and when it was seen: steers k under load.
        self._target_load: dict[str, tuple[float, PassLoad]] = {}
        # Whether the targets report their passes (a target that does not batch reports none).
        self._batching_targets = True

    def _pick(self, replicas: dict, current: CacheRef | None):
        """The replica holding a session's cache, or the next one in turn for a new cache."""
        if current is not None and current.address in replicas:
            return replicas[current.address]
        self._next_replica += 1
        return list(replicas.values())[self._next_replica % len(replicas)]

    async def _load_session(self, session_id: str | None) -> SessionRecord:
        if not session_id:
            return SessionRecord(session_id=uuid.uuid4().hex)
        record = await self._store.get(session_id)
        if record is None:
            raise SessionNotFound(f"session_id: no session {session_id!r} (unknown or expired)")
        return record

    async def generate(self, request: GenerationRequest, remaining_s: Callable[[], float | None]) -> AsyncIterator[Chunk]:
        """Runs one request to completion, yielding chunks as rounds commit tokens."""
        started = time.perf_counter()
        stats = Stats()
        running = self._metrics.running() if self._metrics is not None else nullcontext()
        with self._tracer.start_as_current_span("specdec.generate", kind=trace.SpanKind.SERVER) as span, running:
            record = await self._load_session(request.session_id)
            turn = build_turn(self._tokenizer, record.tokens, record.messages, request.text, request.messages)
            limit = self._facts.max_context
            if len(turn.tokens) >= limit:
                raise ValueError(f"prompt: {len(turn.tokens)} tokens leave no room in the context of {limit}")
            # The caches keep the prefix this turn shares with what the session committed before.
            shared = common_prefix_len(record.tokens, turn.tokens)
            draft_ref = _clip(record.draft, shared)
            target_ref = _clip(record.target, shared)
            committed = list(turn.tokens)
            prompt_len = len(committed)
            stats.prompt_tokens = prompt_len
            sampling = Sampling(
                request.temperature,
                request.top_k,
                request.top_p,
                request.seed if request.seed is not None else secrets.randbits(63),
            )
            fixed_k = self._default_k if request.k is None else request.k
            costs = self._costs if sampling.greedy else self._prior_costs
            rounds_without_draft = 0
            span.set_attributes(
                _request_attributes(self._facts, request, record.session_id, prompt_len, fixed_k)
            )

            target = self._pick(self._targets, target_ref)
            hidden = None  # target hidden states the draft has not been sent yet
            if target_ref is None or target_ref.address != target.address:
                t0 = time.perf_counter()
                target_ref, hidden = await target.prefill_with_hidden(committed, remaining_s(), self._want_hidden)
                stats.prefill_ms = (time.perf_counter() - t0) * 1000
            record.tokens, record.target = committed, target_ref
            await self._store.put(record)

            text = TextStream(self._tokenizer, list(request.stop))
            finish: str | None = None
            round_index = 0
            while finish is None:
                room = min(request.max_new_tokens - stats.generated_tokens, limit - len(committed))
                load = self._fresh_load(target_ref.address) if sampling.greedy else None
                k = fixed_k if fixed_k is not None else costs.choose(stats.positions, load)
                if fixed_k is None and sampling.greedy and load is None and self._batching_targets:
                    # No recent pass seen on this replica: its load is unknown (a burst may just have
                    # arrived), so this round runs target-only and measures it rather than drafting
                    # into a busy batch.
                    k = 0
                # Probe now and then, so a session whose draft improves can win it back; but only when
                # its acceptance, not the target's load, holds k at 0, and a good draft would be used.
                probe = fixed_k is None and k == 0 and rounds_without_draft >= _PROBE_EVERY
                if probe and costs.choose_unloaded(stats.positions, load) == 0 and costs.worth_probing(load):
                    k = 1
                k_round = max(0, min(k, room - 1))
                draft, verdict, draft_ref, target_ref, hidden = await self._round(
                    round_index, k_round, committed, sampling, draft_ref, target_ref, hidden, stats, remaining_s
                )
                drafted = len(draft.tokens) if draft else 0
                rounds_without_draft = 0 if drafted else rounds_without_draft + 1
                if _moved(record.draft, draft_ref) or _moved(record.target, target_ref):
                    # A new cache was made: record where it lives, so another coordinator finds it.
                    record.draft, record.target, record.tokens = draft_ref, target_ref, list(committed)
                    await self._store.put(record)
                round_index += 1
                stats.add_round(drafted, verdict.accepted, len(verdict.tokens))

                new = verdict.tokens
                eos = next((i for i, t in enumerate(new) if t in self._facts.eos_token_ids), None)
                if eos is not None:
                    new, finish = new[: eos + 1], "stop"
                if len(new) >= room:
                    new = new[:room]
                    if finish is None:
                        finish = "length" if room == request.max_new_tokens - stats.generated_tokens else "context"
                released = text.push(new)
                if released.stopped:
                    finish = "stop"
                    new = new[: len(text.tokens) - stats.generated_tokens]
                committed.extend(new)
                stats.generated_tokens += len(new)
                if released.token_ids or released.text:
                    if not stats.time_to_first_token_ms:
                        stats.time_to_first_token_ms = (time.perf_counter() - started) * 1000
                    yield Chunk(record.session_id, released.text, released.token_ids)

            tail = text.finish()
            record.tokens = committed
            record.draft = _clip(draft_ref, len(committed))
            record.target = _clip(target_ref, len(committed))
            if turn.messages is not None:
                record.messages = [*turn.messages, {"role": "assistant", "content": text.text}]
            await self._store.put(record)
            stats.total_ms = (time.perf_counter() - started) * 1000
            if self._metrics is not None:
                first_s = stats.time_to_first_token_ms / 1000 if stats.time_to_first_token_ms else None
                self._metrics.observe_request(
                    finish, stats.prompt_tokens, stats.generated_tokens, stats.total_ms / 1000, first_s
                )
            span.set_attributes(
                {
                    "gen_ai.usage.output_tokens": stats.generated_tokens,
                    "gen_ai.response.finish_reasons": (finish,),
                    "specdec.rounds": stats.rounds,
                    "specdec.acceptance_rate": stats.acceptance_rate,
                    "specdec.mean_accepted_length": stats.mean_accepted_length,
                }
            )
            yield Chunk(record.session_id, tail.text, tail.token_ids, finish, stats)

    async def _round(
        self,
        round_index: int,
        k: int,
        committed: list[int],
        sampling: Sampling,
        draft_ref: CacheRef | None,
        target_ref: CacheRef,
        hidden: HiddenStates | None,
        stats: Stats,
        remaining_s: Callable[[], float | None],
    ) -> tuple[DraftResult | None, VerifyResult, CacheRef | None, CacheRef, HiddenStates | None]:
        """One round in its own span: draft k tokens (if k > 0), verify, and time both.

        ``hidden`` holds target hidden states the draft has not been sent; the round returns what is
        still unsent afterwards. A draft that fails costs this round its speculation, never the request.
        """
        with self._tracer.start_as_current_span("specdec.round") as span:
            round_t0 = time.perf_counter()
            draft, draft_ms, drafting = None, 0.0, False
            if k > 0 and self._draft_usable(draft_ref):
                drafting = True
                t0 = time.perf_counter()
                try:
                    draft, draft_ref = await self._propose(
                        draft_ref, committed, k, sampling, round_index, remaining_s, hidden
                    )
                    hidden = None
                except (BackendUnavailable, BackendRejected) as error:
                    self._draft_failed(draft_ref, error, span)
                draft_ms = (time.perf_counter() - t0) * 1000
                if draft is not None:
                    self._costs.record_draft(draft_ms, len(draft.tokens))
            t0 = time.perf_counter()
            verdict, target_ref, fed = await self._verify(target_ref, committed, draft, sampling, round_index, remaining_s)
            hidden = merge_hidden(hidden, fed)
            verify_ms = (time.perf_counter() - t0) * 1000
            drafted = len(draft.tokens) if draft else 0
            self._costs.record_verify(verify_ms, drafted + 1, verdict.load)
            if verdict.load is not None:
                self._target_load[target_ref.address] = (time.monotonic(), verdict.load)
            else:
                self._batching_targets = False
            stats.draft_ms += draft_ms
            stats.verify_ms += verify_ms
            if self._metrics is not None:
                # k > 0 and no draft: the draft failed this round, or is resting after a failure.
                self._metrics.observe_round(
                    drafted, verdict.accepted, len(verdict.tokens), draft_ms / 1000 if drafting else None,
                    verify_ms / 1000, time.perf_counter() - round_t0, fallback=k > 0 and draft is None,
                )
            span.set_attributes(
                {
                    "specdec.round": round_index,
                    "specdec.k": drafted,
                    "specdec.accepted": verdict.accepted,
                    "specdec.draft_ms": draft_ms,
                    "specdec.verify_ms": verify_ms,
                }
            )
        return draft, verdict, draft_ref, target_ref, hidden

    def _fresh_load(self, address: str) -> PassLoad | None:
        """The replica's latest pass, unless it is older than a second (the load may have changed)."""
        seen = self._target_load.get(address)
        if seen is None or time.monotonic() - seen[0] > _LOAD_FRESH_S:
            return None
        return seen[1]

    def _draft_usable(self, ref: CacheRef | None) -> bool:
        """False while the replica that would draft for this session is backing off after a failure."""
        address = ref.address if ref is not None and ref.address in self._drafts else None
        if address is None:
            return any(time.monotonic() >= self._draft_down_until.get(a, 0.0) for a in self._drafts)
        return time.monotonic() >= self._draft_down_until.get(address, 0.0)

    def _draft_failed(self, ref: CacheRef | None, error: Exception, span: trace.Span) -> None:
        """Notes a failed draft call: the round goes on target-only and the replica rests a while."""
        address = getattr(error, "address", None) or (ref.address if ref is not None else None)
        if address is not None:
            self._draft_down_until[address] = time.monotonic() + self._draft_retry_s
        span.add_event("specdec.draft_failed", {"error": str(error)})
        log.warning("draft failed, this round runs target-only: %s", error)

    async def _propose(
        self,
        ref: CacheRef | None,
        committed: list[int],
        k: int,
        sampling: Sampling,
        round_index: int,
        remaining_s: Callable[[], float | None],
        hidden: HiddenStates | None,
    ) -> tuple[DraftResult, CacheRef]:
        """Asks the session's draft replica for k tokens, prefilling it first if it lost the cache."""
        draft = self._pick(self._drafts, ref)
        if ref is not None and ref.address == draft.address:
            try:
                result = await draft.propose(ref, committed, k, sampling, round_index, remaining_s(), hidden)
                return result, replace(ref, committed=result.committed)
            except CacheLost:
                pass
        ref = await draft.prefill(committed, remaining_s())
        result = await draft.propose(ref, committed, k, sampling, round_index, remaining_s(), hidden)
        return result, replace(ref, committed=result.committed)

    async def _verify(
        self,
        ref: CacheRef,
        committed: list[int],
        draft: DraftResult | None,
        sampling: Sampling,
        round_index: int,
        remaining_s: Callable[[], float | None],
    ) -> tuple[VerifyResult, CacheRef, HiddenStates | None]:
        """Verifies on the session's target replica, prefilling it again if it lost the cache; also
        returns the hidden states the target fed (when the draft wants them)."""
        target = self._targets[ref.address]
        want = self._want_hidden
        try:
            result = await target.verify(ref, committed, draft, sampling, round_index, remaining_s(), want)
            fed = result.hidden
        except CacheLost:
            ref, fed = await target.prefill_with_hidden(committed, remaining_s(), want)
            result = await target.verify(ref, committed, draft, sampling, round_index, remaining_s(), want)
            fed = merge_hidden(fed, result.hidden)
        return result, replace(ref, committed=result.committed), fed

    async def close(self) -> None:
        """Closes every replica channel."""
        await asyncio.gather(*(r.close() for r in [*self._drafts.values(), *self._targets.values()]))


def _clip(ref: CacheRef | None, committed: int) -> CacheRef | None:
    """A cache reference that claims no more committed tokens than ``committed``."""
    return None if ref is None else replace(ref, committed=min(ref.committed, committed))


def _moved(stored: CacheRef | None, current: CacheRef | None) -> bool:
    """True when the cache a record points to is not the one in use."""
    if current is None:
        return False
    return stored is None or (stored.address, stored.cache_id) != (current.address, current.cache_id)


def _request_attributes(
    facts: ModelFacts, request: GenerationRequest, session_id: str, prompt_tokens: int, k: int | None
) -> dict:
    return {
        "gen_ai.operation.name": "chat" if request.messages is not None else "text_completion",
        "gen_ai.system": "specdec",
        "gen_ai.request.model": facts.name,
        "gen_ai.request.max_tokens": request.max_new_tokens,
        "gen_ai.request.temperature": request.temperature,
        "gen_ai.request.top_k": request.top_k,
        "gen_ai.request.top_p": request.top_p,
        "gen_ai.usage.input_tokens": prompt_tokens,
        "specdec.session_id": session_id,
        "specdec.k": "auto" if k is None else k,
    }
