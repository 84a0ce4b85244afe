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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, nullcontext
from dataclasses import dataclass, field, replace

from opentelemetry import trace

from coordinator.adaptive import AcceptanceTracker, CostModel, FleetAcceptance, add_counts
from coordinator.backends import (
    BackendRejected,
    BackendUnavailable,
    CacheLost,
    CacheRef,
    DraftReplica,
    DraftResult,
    TargetReplica,
    VerifyResult,
    REST_S,
    ReplicaSet,
)
from coordinator.hidden_backlog import HiddenBacklog
from coordinator.prompts import build_turn
from coordinator.checkpoints import Checkpoints
from coordinator.sessions import (
    SessionRecord,
    SessionStore,
    StoreUnavailable,
    TurnState,
    is_session_id,
    new_session_id,
)
from coordinator.textstream import TextStream
from specdec.batching import PassLoad
from specdec.config import FEATURE_KIND
from specdec.token_lists import common_prefix_len
from specdec.metrics import CoordinatorMetrics
from specdec.vocab import ModelFacts
from specdec.ngram import LOOKUP_MAX_N, propose_ngram
from specdec.sampling_params import Sampling
from specdec.v1.common_pb2 import HiddenStates

log = logging.getLogger(__name__)


# Rounds of target-only decoding after which an adaptive session tries k = 1 again.
_PROBE_EVERY = 8
# Seconds a target's load report stays current for choosing k.
_LOAD_FRESH_S = 1.0


class SessionNotFound(LookupError):
    """The request named a session that does not exist or has expired."""


class TooManySessions(RuntimeError):
    """The client already keeps as many live sessions as it may."""


class TurnMismatch(RuntimeError):
    """A resume named a session that is not running the resumed request."""


@dataclass(frozen=True)
class Resume:
    """What the client of a lost stream already received of this turn."""

    tokens: int
    text_chars: int


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
    # Set when a client resumes a stream it lost.
    resume: Resume | None = None
    # Digest of the request minus its session and resume fields: names the turn a resume continues.
    fingerprint: str = ""
    # Who sent it (see coordinator.server.client_of); counts against its session limit.
    client: str = ""


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
    # Rounds whose proposal the draft had drafted ahead, during the round before.
    ahead_rounds: int = 0
    # Acceptance by draft position of the draft service's proposals; it steers the adaptive choice of k.
    positions: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    # The same for the coordinator's own prompt lookup. Its hits follow long repeats, so they start
    # from a higher prior (offline, along the benchmark prompts' greedy continuations, a hit from a
    # suffix of 3+ tokens passed 0.70-0.80 per position).
    lookup: AcceptanceTracker = field(default_factory=lambda: AcceptanceTracker(prior=0.7))

    def add_round(self, drafted: int, accepted: int, committed: int, looked_up: bool = False) -> None:
        """Counts one finished round; ``looked_up``: the coordinator's prompt lookup drafted it."""
        self.rounds += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.committed_in_rounds += committed
        (self.lookup if looked_up else self.positions).record(drafted, accepted)

    def by_position(self) -> tuple[list[int], list[int]]:
        """Drafted and accepted counts by draft position, over every source of proposals."""
        drafted, accepted = list(self.positions.drafted), list(self.positions.accepted)
        add_counts(drafted, self.lookup.drafted)
        add_counts(accepted, self.lookup.accepted)
        return drafted, accepted

    @property
    def judged_tokens(self) -> int:
        """Draft tokens the target judged (each round's up to its first rejection), every source."""
        return sum(self.positions.tried) + sum(self.lookup.tried)

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


def _out_of_time(remaining_s: Callable[[], float | None]) -> bool:
    """Whether the request's own deadline has passed. A call that failed then failed on the client's
    clock, not the replica's: resting the replica would fail every other session on it."""
    left = remaining_s()
    return left is not None and left <= 0


class RoundLoop:
    """Runs requests over a set of draft and target replicas and a session store."""

    def __init__(
        self,
        tokenizer,
        target_facts: ModelFacts,
        drafts: Sequence[DraftReplica] | ReplicaSet[DraftReplica],
        targets: Sequence[TargetReplica] | ReplicaSet[TargetReplica],
        store: SessionStore,
        tracer: trace.Tracer,
        default_k: int | None,
        max_auto_k: int = 8,
        want_hidden: bool = False,
        side_layers: tuple[int, ...] = (),
        draft_retry_s: float = REST_S,
        metrics: CoordinatorMetrics | None = None,
        draft_colocated: bool = False,
        max_sessions_per_client: int = 0,
        free_lookup_min: int = 0,
        confidence_cutoff: bool = False,
        draft_ahead: int = 0,
        checkpoint_interval_s: float = 0.0,
    ) -> None:
        self._tokenizer = tokenizer
        self._checkpoint_interval_s = checkpoint_interval_s
        self._facts = target_facts
        # A replica that failed rests this long before new work goes to it. Sessions on a resting
        # (or departed) draft replica move to another or run target-only; those on a target move.
        # Sets given as such may change while the loop runs (discovery); lists stay fixed.
        self._drafts = drafts if isinstance(drafts, ReplicaSet) else ReplicaSet(drafts, draft_retry_s)
        self._targets = targets if isinstance(targets, ReplicaSet) else ReplicaSet(targets, draft_retry_s)
        # Stopped on close, before the channels: the discovery that changes the sets.
        self._stoppers: list[Callable[[], Awaitable[None]]] = []
        self._store = store
        self._tracer = tracer
        self._default_k = default_k
        # A feature draft reads the target's hidden states: ask the target for them, carry them over.
        self._want_hidden = want_hidden
        self._side_layers = side_layers  # target layers whose outputs the feature draft reads too
        # Measured costs steer greedy requests. Seeded sampled requests use the fixed prior curve,
        # so their k sequence, and hence their tokens, never depend on timing.
        self._costs = CostModel(k_max=max_auto_k, colocated=draft_colocated)
        self._prior_costs = CostModel(k_max=max_auto_k)
        self._fleet = FleetAcceptance()
        # Prometheus metrics of this process; None records nothing.
        self._metrics = metrics
        # Each target replica's latest batched pass and when it was seen: steers k under load.
        self._target_load: dict[str, tuple[float, PassLoad]] = {}
        # Whether the targets report their passes (a target that does not batch reports none).
        self._batching_targets = True
        self._max_sessions_per_client = max_sessions_per_client
        self._free_lookup_min = free_lookup_min
        # With k auto, the draft stops where its confidence no longer pays (CostModel.min_confidence).
        self._confidence_cutoff = confidence_cutoff
        # Tokens the draft drafts ahead while a lone session's round is verified (0: none).
        self._draft_ahead = draft_ahead

    def draft_joined(self, facts: ModelFacts) -> None:
        """A draft replica joined while running: a feature draft needs the target's hidden states
        from now on."""
        if facts.kind == FEATURE_KIND:
            self._want_hidden = True
            self._side_layers = facts.side_layers

    def members(self) -> tuple[frozenset[str], frozenset[str]]:
        """The addresses of the draft and of the target replicas that take work now."""
        return frozenset(self._drafts.by_address), frozenset(self._targets.by_address)

    def stop_on_close(self, stop: Callable[[], Awaitable[None]]) -> None:
        """``close`` awaits ``stop()`` first (a discovery task that adds and retires replicas)."""
        self._stoppers.append(stop)

    async def _load_session(self, session_id: str | None, new_id: str) -> SessionRecord:
        if not session_id:
            return SessionRecord(session_id=new_id)
        record = await self._store.get(session_id) if is_session_id(session_id) else None
        if record is None:
            raise SessionNotFound(f"session_id: no session {session_id!r} (unknown or expired)")
        return record

    async def _begin_turn(self, request: GenerationRequest, new_id: str) -> tuple[SessionRecord, bool]:
        """The session's record with this request's turn in ``record.turn``, and whether the turn is
        resumed (it ran before, on this or another coordinator). The turn takes the session's lease."""
        record = await self._load_session(request.session_id, new_id)
        if request.resume is not None:
            if record.turn is not None and record.turn.fingerprint == request.fingerprint:
                await self._claim(request, record)
                await self._take_lease(record)
                return record, True
            if request.resume.tokens or request.resume.text_chars:
                raise TurnMismatch(
                    f"resume: session {record.session_id!r} is not running this request (it expired or a "
                    "later turn replaced it)"
                )
            # Nothing was received and the turn never started: start it now.
        turn = build_turn(self._tokenizer, record.tokens, record.messages, request.text, request.messages)
        limit = self._facts.max_context
        if len(turn.tokens) >= limit:
            raise ValueError(f"prompt: {len(turn.tokens)} tokens leave no room in the context of {limit}")
        # The caches keep the prefix this turn shares with what the session committed before.
        shared = common_prefix_len(record.tokens, turn.tokens)
        record.draft, record.target = _clip(record.draft, shared), _clip(record.target, shared)
        record.tokens = list(turn.tokens)
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        record.turn = TurnState(request.fingerprint, len(turn.tokens), seed, turn.messages)
        await self._claim(request, record)
        await self._take_lease(record)
        return record, False

    async def _claim(self, request: GenerationRequest, record: SessionRecord) -> None:
        """Counts the session among its client's live ones, refusing one past the client's limit."""
        limit = self._max_sessions_per_client
        if limit and request.client and not await self._store.claim(request.client, record.session_id, limit):
            raise TooManySessions(
                f"session_id: this client already keeps {limit} live sessions; continue one of them or wait "
                "for one to expire"
            )

    async def _take_lease(self, record: SessionRecord) -> None:
        """Takes a fencing token newer than any earlier turn's, for the record and its caches: from
        now on the services and the store refuse the older turns' calls and writes."""
        record.fence = await self._store.take_fence(record.session_id)
        if record.draft is not None:
            record.draft = replace(record.draft, fence=record.fence)
        if record.target is not None:
            record.target = replace(record.target, fence=record.fence)

    async def generate(self, request: GenerationRequest, remaining_s: Callable[[], float | None]) -> AsyncIterator[Chunk]:
        """Runs one request to completion, yielding chunks as rounds commit tokens.

        A resumed request continues its turn from the latest checkpoint and streams only what its
        client has not received.
        """
        new_id = new_session_id()  # the session's id, unless the request continues one
        streamed = False
        try:
            # Closed with this generator, so its turn's clean-up never waits for garbage collection.
            async with aclosing(self._generate(request, remaining_s, new_id)) as chunks:
                async for chunk in chunks:
                    streamed = True
                    yield chunk
        except BaseException:
            if not request.session_id and not streamed:
                # A new session's id reaches its client only with a chunk: this one can never be
                # continued, so it must not count against the client's session limit until it expires.
                await self._unclaim(request, new_id)
            raise

    async def _unclaim(self, request: GenerationRequest, session_id: str) -> None:
        if not (self._max_sessions_per_client and request.client):
            return
        try:
            await asyncio.shield(self._store.unclaim(request.client, session_id))
        except StoreUnavailable as exc:  # the claim expires with the session's TTL instead
            log.warning("session %s still counts for its client until it expires: %s", session_id, exc)

    async def _generate(
        self, request: GenerationRequest, remaining_s: Callable[[], float | None], new_id: str
    ) -> AsyncIterator[Chunk]:
        started = time.perf_counter()
        running = self._metrics.running() if self._metrics is not None else nullcontext()
        with (
            self._tracer.start_as_current_span("specdec.generate", kind=trace.SpanKind.SERVER) as span,
            running,
            _Holding(self._drafts, self._targets) as holding,
        ):
            record, resumed = await self._begin_turn(request, new_id)
            turn = record.turn
            committed = record.tokens
            draft_ref, target_ref = record.draft, record.target
            stats = Stats(prompt_tokens=turn.prompt_len, generated_tokens=len(committed) - turn.prompt_len)
            sampling = Sampling(request.temperature, request.top_k, request.top_p, turn.seed)
            if sampling.greedy:
                stats.positions = self._fleet.session_tracker(self._costs.k_max, turn.drafted, turn.accepted,
                                                              turn.tried)
            else:
                stats.positions = AcceptanceTracker(drafted=list(turn.drafted), accepted=list(turn.accepted),
                                                    tried=list(turn.tried))
            fixed_k = self._default_k if request.k is None else request.k
            costs = self._costs if sampling.greedy else self._prior_costs
            limit = self._facts.max_context
            span.set_attributes(
                _request_attributes(self._facts, request, record.session_id, turn.prompt_len, fixed_k, resumed)
            )

            hidden = HiddenBacklog()  # target hidden states the draft has not been sent yet
            if target_ref is None or not self._targets.stays(target_ref.address):
                t0 = time.perf_counter()
                # A seeded sampled request's draws follow its rounds' k; a deferred prompt would leave a
                # feature draft without features in round 1, and so make the tokens depend on load.
                feed_now = request.seed is not None and not sampling.greedy
                target_ref, fed = await self._place_target(committed, remaining_s, span, record.fence, feed_now)
                hidden.add(fed)
                stats.prefill_ms = (time.perf_counter() - t0) * 1000
            record.target = target_ref
            holding.update(draft_ref, target_ref)
            await self._store.put(record)
            checkpoints = Checkpoints(self._store, self._checkpoint_interval_s)

            text = TextStream(self._tokenizer, list(request.stop))
            if resumed:
                text.skip(committed[turn.prompt_len:], request.resume.tokens, request.resume.text_chars)
            finish = turn.finish
            finished_before = finish is not None
            while finish is None:
                room = min(request.max_new_tokens - stats.generated_tokens, limit - len(committed))
                k = self._choose_k(fixed_k, costs, stats, sampling, target_ref.address, turn.rounds_without_draft)
                k_round = max(0, min(k, room - 1))
                looked_up = None
                if fixed_k is None and sampling.greedy:
                    looked_up = self._free_lookup(committed, costs, stats, target_ref.address, room - 1, k_round)
                    if looked_up is not None:
                        k_round = 0  # the lookup drafts this round: no draft call
                # Sampled requests read the fixed prior costs here too: their proposals never depend on timing.
                cutoff = costs.min_confidence() if self._confidence_cutoff and fixed_k is None and k_round else 0.0
                ahead = self._ahead(k_round, sampling, target_ref.address)
                draft, verdict, draft_ref, target_ref = await self._round(
                    turn.round, k_round, committed, sampling, draft_ref, target_ref, hidden, stats, remaining_s,
                    record.fence, looked_up, cutoff, ahead,
                )
                holding.update(draft_ref, target_ref)
                drafted = len(draft.tokens) if draft else 0
                model_drafted = drafted if looked_up is None else 0
                turn.rounds_without_draft = 0 if model_drafted else turn.rounds_without_draft + 1
                turn.round += 1
                stats.add_round(drafted, verdict.accepted, len(verdict.tokens), looked_up is not None)
                if model_drafted and sampling.greedy:
                    self._fleet.record(drafted, verdict.accepted)

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
                if finish is None:
                    # The checkpoint goes out before the tokens do, so a resume never starts ahead of them.
                    self._checkpoint(checkpoints, record, draft_ref, target_ref, stats)
                    if checkpoints.fenced is not None:
                        raise checkpoints.fenced
                if released.token_ids or released.text:
                    if not stats.time_to_first_token_ms:
                        stats.time_to_first_token_ms = (time.perf_counter() - started) * 1000
                    yield Chunk(record.session_id, released.text, released.token_ids)

            tail = text.finish()
            if turn.messages is not None and turn.finish is None:
                record.messages = [*turn.messages, {"role": "assistant", "content": text.text}]
            turn.finish = finish
            self._checkpoint(checkpoints, record, draft_ref, target_ref, stats)
            # No later round would repair a lost last record, and the session's next turn starts
            # from it: a store that stays unreachable fails the request, whose client resumes it.
            await checkpoints.flush(must_write=True)
            stats.total_ms = (time.perf_counter() - started) * 1000
            # A turn that had finished before this call (a resume that only sends what its client
            # missed) was counted when it finished.
            if self._metrics is not None and not finished_before:
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

    def _choose_k(
        self, fixed_k: int | None, costs: CostModel, stats: Stats, sampling: Sampling, address: str,
        rounds_without_draft: int,
    ) -> int:
        """This round's draft length: the request's fixed k, or the adaptive choice."""
        if fixed_k is not None:
            return fixed_k
        load = self._fresh_load(address) if sampling.greedy else None
        if sampling.greedy and load is None and self._batching_targets:
            # No recent pass seen on this replica: its load is unknown (a burst may just have
            # arrived), so this round runs target-only and measures it rather than drafting into a
            # busy batch.
            return 0
        k = costs.choose(stats.positions, load)
        # Probe now and then, so a session whose draft improves can win it back; but only when its
        # acceptance, not the target's load, holds k at 0, and a good draft would be used.
        probe = k == 0 and rounds_without_draft >= _PROBE_EVERY
        if probe and costs.choose_unloaded(stats.positions, load) == 0 and costs.worth_probing(load):
            return 1
        return k

    def _ahead(self, k: int, sampling: Sampling, address: str) -> int:
        """Tokens the draft should draft ahead after this round's proposal: the configured number for a
        session that drafts and verifies alone, else 0.

        Alone, the draft idles while the target verifies, so drafting ahead costs no one time on
        separate hosts. Beside other sessions it would delay their proposals. Sampled requests never
        draft ahead: whether they did hangs on the load, and so would their tokens, which a seeded
        request must repeat and a resumed one (seeded by its turn) must replay as its client saw them.
        """
        if not self._draft_ahead or k <= 0 or not sampling.greedy:
            return 0
        load = self._fresh_load(address)
        return self._draft_ahead if load is None or load.sessions <= 1 else 0

    def _free_lookup(
        self, committed: list[int], costs: CostModel, stats: Stats, address: str, room: int, model_k: int = 0
    ) -> DraftResult | None:
        """A prompt-lookup proposal the coordinator makes itself for a greedy round: as many of the
        looked-up tokens as pay for the verify rows they add, or None. For a round the draft service
        would draft (``model_k`` > 0), only where the lookup promises at least as many tokens per
        millisecond as that draft call (``CostModel.prefers_free``)."""
        if not self._free_lookup_min or room <= 0:
            return None
        load = self._fresh_load(address)
        if load is None and self._batching_targets:
            return None  # the target's load is unknown: measure it first (as ``_choose_k`` does)
        # The scan is linear in the context: only after the cheap checks, once per round.
        tokens = propose_ngram(committed, min(costs.k_max, room), LOOKUP_MAX_N, self._free_lookup_min)
        if not tokens:
            return None
        k = costs.choose_free(stats.lookup, load, len(tokens))
        if k <= 0 or (model_k > 0 and not costs.prefers_free(stats.lookup, k, stats.positions, model_k, load)):
            return None
        # committed: the draft cache's length, which a local proposal leaves as it was.
        return DraftResult(tokens[:k], [], 0)

    def _checkpoint(
        self, checkpoints: Checkpoints, record: SessionRecord, draft_ref: CacheRef | None, target_ref: CacheRef,
        stats: Stats,
    ) -> None:
        """Hands the turn's progress (tokens, caches, round, acceptance) to the background writer."""
        record.draft = _clip(draft_ref, len(record.tokens))
        record.target = _clip(target_ref, len(record.tokens))
        record.turn.drafted = list(stats.positions.drafted)
        record.turn.accepted = list(stats.positions.accepted)
        record.turn.tried = list(stats.positions.tried)
        checkpoints.submit(record)

    async def _round(
        self,
        round_index: int,
        k: int,
        committed: list[int],
        sampling: Sampling,
        draft_ref: CacheRef | None,
        target_ref: CacheRef,
        hidden: HiddenBacklog,
        stats: Stats,
        remaining_s: Callable[[], float | None],
        fence: int,
        looked_up: DraftResult | None = None,
        min_confidence: float = 0.0,
        ahead: int = 0,
    ) -> tuple[DraftResult | None, VerifyResult, CacheRef | None, CacheRef]:
        """One round in its own span: draft k tokens (if k > 0), verify, and time both.

        ``hidden`` holds target hidden states the draft has not been sent; the round sends them with
        its draft call and adds the ones its verify fed. A draft that fails costs this round its
        speculation, never the request.
        ``looked_up`` is the coordinator's own proposal for a round with k = 0: verified as drafted.
        ``ahead``: tokens the draft drafts ahead while this round is verified.
        """
        with self._tracer.start_as_current_span("specdec.round") as span:
            round_t0 = time.perf_counter()
            draft, draft_ms, drafting = looked_up, 0.0, False
            # Picked once per round: picking rotates among equally busy replicas.
            replica = self._drafts.pick(draft_ref) if k > 0 else None
            if replica is not None:
                drafting = True
                t0 = time.perf_counter()
                try:
                    draft, draft_ref, routine = await self._propose(
                        replica, draft_ref, committed, k, sampling, round_index, remaining_s, hidden.message(),
                        fence, min_confidence, ahead,
                    )
                    hidden.clear()
                except (BackendUnavailable, BackendRejected) as error:
                    if not _out_of_time(remaining_s):
                        self._failed(self._drafts, error, span, "draft", "draft failed, this round runs target-only")
                draft_ms = (time.perf_counter() - t0) * 1000
                if draft is not None and draft.from_ahead:
                    stats.ahead_rounds += 1
                elif draft is not None and not draft.looked_up and routine:
                    # Only the model's drafting on the spot counts: the cost of a call answered ahead
                    # or by a lookup says nothing of the next one the model drafts. Nor does a call
                    # that first took in a whole prompt (a session's first, or one placed anew): on
                    # the benchmark such a call cost 133 ms against 9 to 11 for a round's, and priced
                    # as a draft of its k it kept that k, and through the per-token average every
                    # longer one, from being tried again.
                    self._costs.record_draft(draft_ms, len(draft.tokens))
            t0 = time.perf_counter()
            verdict, target_ref, fed = await self._verify(
                target_ref, committed, draft, sampling, round_index, remaining_s, span
            )
            hidden.add(fed)
            verify_ms = (time.perf_counter() - t0) * 1000
            drafted = len(draft.tokens) if draft else 0
            self._costs.record_verify(verify_ms, drafted + 1, verdict.load)
            if verdict.load is not None:
                self._note_load(target_ref.address, verdict.load)
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
                    "specdec.k_asked": k,
                    "specdec.min_confidence": min_confidence,
                    "specdec.looked_up": looked_up is not None,
                    "specdec.from_ahead": bool(draft is not None and draft.from_ahead),
                    "specdec.accepted": verdict.accepted,
                    "specdec.draft_ms": draft_ms,
                    "specdec.verify_ms": verify_ms,
                }
            )
        return draft, verdict, draft_ref, target_ref

    def _note_load(self, address: str, load: PassLoad) -> None:
        """Keeps the replica's latest pass; forgets stale ones once replicas that left (discovered pods
        come and go under new addresses) could make the table grow past the live set."""
        now = time.monotonic()
        self._target_load[address] = (now, load)
        if len(self._target_load) > 2 * len(self._targets) + 1:
            self._target_load = {a: seen for a, seen in self._target_load.items() if now - seen[0] <= _LOAD_FRESH_S}

    def _fresh_load(self, address: str) -> PassLoad | None:
        """The replica's latest pass, unless it is older than a second (the load may have changed)."""
        seen = self._target_load.get(address)
        if seen is None or time.monotonic() - seen[0] > _LOAD_FRESH_S:
            return None
        return seen[1]

    def _failed(self, replicas: ReplicaSet, error: BackendUnavailable | BackendRejected, span: trace.Span,
                service: str, what: str) -> None:
        """Notes a failed call (a ``specdec.<service>_failed`` span event): the replica rests a while."""
        replicas.failed(error.address)
        span.add_event(f"specdec.{service}_failed", {"error": str(error)})
        log.warning("%s: %s", what, error)

    async def _propose(
        self,
        draft: DraftReplica,
        ref: CacheRef | None,
        committed: list[int],
        k: int,
        sampling: Sampling,
        round_index: int,
        remaining_s: Callable[[], float | None],
        hidden: HiddenStates | None,
        fence: int,
        min_confidence: float = 0.0,
        ahead: int = 0,
    ) -> tuple[DraftResult, CacheRef, bool]:
        """Asks ``draft`` for k tokens, prefilling it first if it lacks the session's cache; also returns
        whether the call was a round's routine one: no prefill, and no more tokens to take in first
        than one round commits."""
        if ref is not None and ref.address == draft.address:
            try:
                result = await draft.propose(ref, committed, k, sampling, round_index, remaining_s(), hidden,
                                             min_confidence, ahead)
                routine = len(committed) - ref.committed <= self._costs.k_max + 1
                return result, replace(ref, committed=result.committed), routine
            except CacheLost:
                pass
        ref = await draft.prefill(committed, remaining_s(), fence)
        result = await draft.propose(ref, committed, k, sampling, round_index, remaining_s(), hidden, min_confidence,
                                     ahead)
        return result, replace(ref, committed=result.committed), False

    async def _place_target(
        self, committed: list[int], remaining_s: Callable[[], float | None], span: trace.Span, fence: int,
        feed_now: bool = False,
    ) -> tuple[CacheRef, HiddenStates | None]:
        """Builds the session's target cache over ``committed`` on a healthy replica, trying the
        others when one is unreachable; also returns the fed hidden states (when the draft wants them).
        ``feed_now`` (only where the draft wants hidden states) forbids the target to defer the prompt."""
        error: BackendUnavailable | None = None
        for _ in range(len(self._targets)):
            target = self._targets.pick(None, probe=True)
            if target is None:
                break
            try:
                return await target.prefill_with_hidden(
                    committed, remaining_s(), self._want_hidden, fence, feed_now and self._want_hidden,
                    self._side_layers,
                )
            except BackendUnavailable as exc:
                if _out_of_time(remaining_s):
                    raise
                error = exc
                self._failed(self._targets, exc, span, "target", "target unreachable, trying another")
        raise error or BackendUnavailable("target", "*", "no target replica is available (all resting or none known)")

    async def _verify(
        self,
        ref: CacheRef,
        committed: list[int],
        draft: DraftResult | None,
        sampling: Sampling,
        round_index: int,
        remaining_s: Callable[[], float | None],
        span: trace.Span,
    ) -> tuple[VerifyResult, CacheRef, HiddenStates | None]:
        """Verifies on the session's target replica; also returns the hidden states the target fed
        (when the draft wants them).

        A replica that lost the cache gets it again from the committed tokens. A replica that is
        unreachable hands the session to another: the same round, with the same draft and round
        index, is verified there, so the stream goes on as if nothing happened.
        """
        want = self._want_hidden
        fed = None
        for _ in range(len(self._targets) + 1):
            if not self._targets.stays(ref.address):
                ref, fed = await self._place_target(committed, remaining_s, span, ref.fence)
            # The replica may have left while the cache was placed: the call then fails over below.
            target = self._targets.find(ref.address)
            try:
                if target is None:
                    raise BackendUnavailable("target", ref.address, "the replica left")
                asks = (want, self._side_layers)
                try:
                    result = await target.verify(ref, committed, draft, sampling, round_index, remaining_s(), *asks)
                except CacheLost:
                    ref, fed = await target.prefill_with_hidden(committed, remaining_s(), want, ref.fence,
                                                                side_layers=self._side_layers)
                    result = await target.verify(ref, committed, draft, sampling, round_index, remaining_s(), *asks)
                if fed is not None:  # the cache was placed anew: its prompt's rows come first
                    backlog = HiddenBacklog(fed)
                    backlog.add(result.hidden)
                    return result, replace(ref, committed=result.committed), backlog.message()
                return result, replace(ref, committed=result.committed), result.hidden
            except BackendUnavailable as exc:
                if _out_of_time(remaining_s):
                    raise
                self._failed(self._targets, exc, span, "target", "target unreachable, moving the session")
        raise BackendUnavailable("target", ref.address, "no target replica could verify this round")

    async def close(self) -> None:
        """Stops discovery, then closes every replica channel."""
        for stop in self._stoppers:
            await stop()
        replicas = [*self._drafts.everyone(), *self._targets.everyone()]
        await asyncio.gather(*(r.close() for r in replicas))


class _Holding:
    """The replicas one running request keeps caches on, counted in their replica sets while it runs."""

    def __init__(self, drafts: ReplicaSet, targets: ReplicaSet) -> None:
        self._sets = (drafts, targets)
        self._held: list[str | None] = [None, None]

    def update(self, draft: CacheRef | None, target: CacheRef | None) -> None:
        """The request's caches are now at ``draft`` and ``target``."""
        for i, ref in enumerate((draft, target)):
            address = None if ref is None else ref.address
            self._sets[i].hold(self._held[i], address)
            self._held[i] = address

    def __enter__(self) -> _Holding:
        return self

    def __exit__(self, *exc) -> None:
        self.update(None, None)


def _clip(ref: CacheRef | None, committed: int) -> CacheRef | None:
    """A cache reference that claims no more committed tokens than ``committed``."""
    return None if ref is None else replace(ref, committed=min(ref.committed, committed))


def _request_attributes(
    facts: ModelFacts, request: GenerationRequest, session_id: str, prompt_tokens: int, k: int | None,
    resumed: bool,
) -> dict:
    return {
        "specdec.resumed": resumed,
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
