"""The round loop: plan, draft, verify, commit, stream, checkpoint; repeat.

Each round the draft proposes up to k tokens and the target verifies them in one pass, committing
the accepted prefix plus one token of its own (recovered or bonus). The loop streams committed text
as soon as no stop string can retract it, and stops on EOS, max_new_tokens, a stop string or the
context limit. What to draft is the policy's call (``coordinator.policy``); where each call goes,
and how a lost cache or replica is recovered, the router's (``coordinator.routing``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing, nullcontext
from dataclasses import replace

from opentelemetry import trace

from coordinator.adaptive import CostModel
from coordinator.checkpoints import Checkpoints
from coordinator.identity import span_session
from coordinator.policy import RoundOutcome, RoundPlan, SpeculationPolicy
from coordinator.routing import PROBE_TIMEOUT_S, Router
from coordinator.sessions import SessionRecord, StoreUnavailable, TurnState, new_session_id
from coordinator.textstream import Release, TextStream
from coordinator.turns import Chunk, GenerationRequest, Stats, Turn, Turns, clip
from specdec.metrics import CoordinatorMetrics
from specdec.sampling_params import Sampling, TokenLogprob
from specdec.vocab import ModelFacts

log = logging.getLogger(__name__)

# The start-up probe (``RoundLoop.probe``): rounds alternating the longest adaptive k and k = 1, so
# the draft is priced at two lengths (its call's fixed part and its step), the verify pass at two
# sizes, and the draft's acceptance is seen at every position.
PROBE_ROUNDS = 8
# Plain text any tokenizer encodes: the draft is judged on the target's own continuation of it.
PROBE_TEXT = "The history of the lighthouse on the northern coast begins"


class RoundLoop:
    """Runs requests' turns over a router's replicas, as a policy plans their rounds."""

    def __init__(
        self,
        tokenizer,
        facts: ModelFacts,
        router: Router,
        policy: SpeculationPolicy,
        turns: Turns,
        tracer: trace.Tracer,
        metrics: CoordinatorMetrics | None = None,
        checkpoint_interval_s: float = 0.0,
    ) -> None:
        self._tokenizer = tokenizer
        self._facts = facts
        self.router = router
        self.policy = policy
        self._turns = turns
        self._tracer = tracer
        self._metrics = metrics  # None records nothing
        self._checkpoint_interval_s = checkpoint_interval_s
        self._background: set[asyncio.Task] = set()  # late writes of last records

    async def close(self) -> None:
        """Stops late record writes and discovery, then closes every replica."""
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.router.close()

    def _in_background(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def generate(
        self, request: GenerationRequest, remaining_s: Callable[[], float | None]
    ) -> AsyncGenerator[Chunk, None]:
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
                await self._turns.unclaim(request, new_id)
            raise

    def token_text(self, token: int) -> str:
        """A token id's text, decoded alone (logprobs name their tokens by it)."""
        return self._tokenizer.decode([token])

    def decode(self, tokens: Sequence[int]) -> str:
        """Token ids' text, decoded together (an echoed token-id prompt)."""
        return self._tokenizer.decode(list(tokens))

    async def probe(self, timeout_s: float, rounds: int = PROBE_ROUNDS) -> int:
        """Measures the draft and target this coordinator serves with, before any request, and
        returns the rounds that ran: greedy rounds of a throwaway session (never stored, not in the
        metrics, its caches released after). What a draft call and a verify pass cost becomes the
        adaptive k's prior costs (``CostModel.seed``); the draft's acceptance by position goes into
        the fleet's (``FleetAcceptance``), which new sessions start from.

        Assumed priors fit one kind of draft only (a cheap one, half its tokens accepted) and held a
        model draft to short k through a fresh coordinator's first requests. A probe that fails or
        runs out of time only measures less, never fails the start: the rounds learn the rest.
        """
        if not len(self.router.drafts):
            return 0  # nothing to measure yet: drafts that join later are learned from their rounds
        k_max = self.policy.costs.k_max
        probed = CostModel(k_max)
        prompt = self._tokenizer.encode(PROBE_TEXT, add_special_tokens=True)
        record = SessionRecord(new_session_id(), tokens=list(prompt), turn=TurnState("", len(prompt), 0))
        deadline = time.monotonic() + timeout_s
        turn = Turn(
            GenerationRequest(None, None, rounds * (k_max + 1)),
            record,
            False,
            Sampling(),
            Stats(),
            lambda: max(0.0, deadline - time.monotonic()),
        )
        span, done = trace.INVALID_SPAN, 0
        try:
            with self.router.holding() as holding:
                async with asyncio.timeout(timeout_s):
                    await self.router.place(turn, span)
                    holding.update(turn.draft, turn.target)
                    for i in range(rounds):
                        k = k_max if i % 2 == 0 else 1
                        if len(turn.committed) + k + 1 > self._facts.max_context:
                            break
                        outcome, _ = await self._draft_and_verify(turn, RoundPlan(k), span)
                        holding.update(turn.draft, turn.target)
                        self.policy.observe_probe(probed, outcome)
                        turn.committed.extend(outcome.verdict.tokens)
                        turn.state.round += 1
                        done += 1
        except Exception as exc:  # noqa: BLE001 - a probe that fails must not stop the coordinator
            log.warning("start-up probe of draft and target stopped after %d of %d rounds: %s", done, rounds, exc)
        finally:
            await self._release_probe(turn)
        self.policy.costs.seed(probed)
        log.info(
            "start-up probe: %d rounds, draft %.1f ms a token, acceptance by position %s",
            done,
            self.policy.costs.draft_step_ms(),
            [round(a, 2) for a in self.policy.fleet.counts.rates(k_max)],
        )
        return done

    async def _release_probe(self, turn: Turn) -> None:
        """Drops the probe's caches, best effort: a cache left behind idles out in the end."""
        for replicas, ref in ((self.router.drafts, turn.draft), (self.router.targets, turn.target)):
            replica = replicas.find(ref.address) if ref is not None else None
            if replica is None or ref is None:
                continue
            try:
                await replica.release(ref.cache_id, PROBE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - best effort, as above
                log.info("could not release the probe's cache on %s: %s", ref.address, exc)

    async def _generate(
        self, request: GenerationRequest, remaining_s: Callable[[], float | None], new_id: str
    ) -> AsyncGenerator[Chunk, None]:
        started = time.perf_counter()
        running = self._metrics.running() if self._metrics is not None else nullcontext()
        with (
            self._tracer.start_as_current_span("specdec.generate", kind=trace.SpanKind.SERVER) as span,
            running,
            self.router.holding() as holding,
        ):
            turn = await self._open(request, remaining_s, new_id, span)
            holding.update(turn.draft, turn.target)
            checkpoints = Checkpoints(self._turns.store, self._checkpoint_interval_s)
            text = TextStream(self._tokenizer, list(request.stop))
            if turn.resumed and request.resume is not None:
                text.skip(turn.committed[turn.state.prompt_len :], request.resume.tokens, request.resume.text_chars)
            finish = turn.state.finish
            finished_before = finish is not None
            if request.prompt_logprobs is not None:
                yield prompt_chunk(turn)
            if finish is None and request.max_new_tokens <= 0:
                finish = "length"  # the prompt alone was asked for (scored)
            while finish is None:
                room = self._room(turn)
                plan = self.policy.plan(turn, room)
                outcome = await self._round(turn, plan)
                holding.update(turn.draft, turn.target)
                self.policy.observe(turn, outcome)
                turn.state.round += 1
                verdict = outcome.verdict
                if outcome.accepted_ranks is not None and outcome.draft is not None:
                    turn.stats.add_tree_round(
                        outcome.draft.parents, verdict.path or (), outcome.accepted_ranks, len(verdict.tokens)
                    )
                else:
                    turn.stats.add_round(
                        outcome.drafted, verdict.accepted, len(verdict.tokens), plan.lookup is not None, plan.forced
                    )
                released, finish = self._commit(turn, text, verdict.tokens, room, verdict.logprobs)
                if finish is not None:
                    self.router.turn_ended(turn.draft, turn.target)
                else:
                    # The checkpoint goes out before the tokens do, so a resume never starts ahead of them.
                    self._checkpoint(checkpoints, turn)
                    if checkpoints.fenced is not None:
                        raise checkpoints.fenced
                if released.token_ids or released.text:
                    if not turn.stats.time_to_first_token_ms:
                        turn.stats.time_to_first_token_ms = (time.perf_counter() - started) * 1000
                    logprobs = _logprobs(turn, released)
                    yield Chunk(turn.record.session_id, released.text, released.token_ids, logprobs=logprobs)
            yield await self._finish(turn, text, checkpoints, finish, finished_before, started, span)

    async def _open(
        self, request: GenerationRequest, remaining_s: Callable[[], float | None], new_id: str, span: trace.Span
    ) -> Turn:
        """Opens the request's turn and gives it a target cache; the record is stored before round 1."""
        record, resumed = await self._turns.open(request, new_id)
        state = record.turn
        assert state is not None
        stats = Stats(prompt_tokens=state.prompt_len, generated_tokens=len(record.tokens) - state.prompt_len)
        # A seeded request samples coupled: its tokens then depend on no draft, outage or coordinator.
        coupled = request.seed is not None and request.temperature > 0
        sampling = request.sampling(state.seed, coupled, state.prompt_len)
        turn = Turn(request, record, resumed, sampling, stats, remaining_s, record.draft, record.target)
        if request.response_format:
            turn.grammar = self._turns.matcher(request.response_format)
        self.policy.start(turn)
        span.set_attributes(
            _request_attributes(
                self._facts, request, record.session_id, state.prompt_len, self.policy.fixed_k(turn), resumed
            )
        )
        t0 = time.perf_counter()
        # A seeded sampled request's draws follow its rounds' k; a deferred prompt would leave a
        # feature draft without features in round 1, and so make the tokens depend on load.
        feed_now = request.seed is not None and not sampling.greedy
        if await self.router.place(turn, span, feed_now):
            stats.prefill_ms = (time.perf_counter() - t0) * 1000
        record.target = turn.target
        await self._turns.store.put(record)
        return turn

    def _room(self, turn: Turn) -> int:
        """Tokens the turn may still commit: the request's budget, within the context."""
        return min(
            turn.request.max_new_tokens - turn.stats.generated_tokens, self._facts.max_context - len(turn.committed)
        )

    async def _draft_and_verify(self, turn: Turn, plan: RoundPlan, span: trace.Span) -> tuple[RoundOutcome, bool]:
        """Drafts as planned and verifies, timing both; also whether a draft replica was called."""
        t0 = time.perf_counter()
        draft, caught_up, draft_ms, called = plan.local_draft(), None, 0.0, False
        if plan.k > 0:
            call = await self.router.draft(turn, plan, span)
            if call is not None:
                called, draft, caught_up = True, call.result, call.caught_up
                draft_ms = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        verdict = await self.router.verify(turn, draft, span, plan.features)
        verify_ms = (time.perf_counter() - t0) * 1000
        assert turn.target is not None
        return RoundOutcome(plan, draft, verdict, turn.target.address, draft_ms, verify_ms, caught_up), called

    async def _round(self, turn: Turn, plan: RoundPlan) -> RoundOutcome:
        """One round in its own span: draft as planned, verify, and time both."""
        with self._tracer.start_as_current_span("specdec.round") as span:
            round_t0 = time.perf_counter()
            outcome, called = await self._draft_and_verify(turn, plan, span)
            draft, verdict, draft_ms, verify_ms = outcome.draft, outcome.verdict, outcome.draft_ms, outcome.verify_ms
            if draft is not None and draft.from_ahead:
                turn.stats.ahead_rounds += 1
            turn.stats.draft_ms += draft_ms
            turn.stats.verify_ms += verify_ms
            if self._metrics is not None:
                # k > 0 and no draft: the draft failed this round, or is resting after a failure.
                self._metrics.observe_round(
                    outcome.drafted,
                    verdict.accepted,
                    len(verdict.tokens),
                    draft_ms / 1000 if called else None,
                    verify_ms / 1000,
                    time.perf_counter() - round_t0,
                    fallback=plan.k > 0 and draft is None,
                    accepted_ranks=outcome.accepted_ranks,
                )
            span.set_attributes(
                {
                    "specdec.round": turn.state.round,
                    "specdec.k": outcome.drafted,
                    "specdec.k_asked": plan.k,
                    "specdec.min_confidence": plan.min_confidence,
                    "specdec.looked_up": plan.lookup is not None and not plan.forced,
                    "specdec.forced": plan.forced,
                    "specdec.from_ahead": bool(draft is not None and draft.from_ahead),
                    "specdec.accepted": verdict.accepted,
                    "specdec.tree_nodes": outcome.drafted if outcome.accepted_ranks is not None else 0,
                    "specdec.tree_depth": plan.tree.depth if plan.tree is not None else 0,
                    "specdec.tree_width": plan.tree.width if plan.tree is not None else 0,
                    "specdec.accepted_ranks": outcome.accepted_ranks or (),
                    "specdec.draft_ms": draft_ms,
                    "specdec.verify_ms": verify_ms,
                }
            )
        return outcome

    def _commit(
        self,
        turn: Turn,
        text: TextStream,
        tokens: list[int],
        room: int,
        logprobs: list[TokenLogprob] | None = None,
    ) -> tuple[Release, str | None]:
        """Commits a round's tokens up to EOS, the room left or a stop string (keeping the logprobs of
        those committed); returns what may be streamed now and the finish reason, if the turn ends here."""
        finish = None
        eos = next((i for i, t in enumerate(tokens) if t in self._facts.eos_token_ids), None)
        if eos is not None:
            tokens, finish = tokens[: eos + 1], "stop"
        stats = turn.stats
        if len(tokens) >= room:
            tokens = tokens[:room]
            if finish is None:
                finish = "length" if room == turn.request.max_new_tokens - stats.generated_tokens else "context"
        released = text.push(tokens)
        if released.stopped:
            finish = "stop"
            tokens = tokens[: len(text.tokens) - stats.generated_tokens]
        for i, entry in enumerate((logprobs or [])[: len(tokens)]):
            turn.logprobs[stats.generated_tokens + i] = entry
        turn.committed.extend(tokens)
        stats.generated_tokens += len(tokens)
        return released, finish

    def _checkpoint(self, checkpoints: Checkpoints, turn: Turn) -> None:
        """Hands the turn's progress (tokens, caches, round, acceptance) to the background writer."""
        record, positions = turn.record, turn.stats.positions
        record.draft = clip(turn.draft, len(record.tokens))
        record.target = clip(turn.target, len(record.tokens))
        turn.state.drafted = list(positions.drafted)
        turn.state.accepted = list(positions.accepted)
        turn.state.tried = list(positions.tried)
        checkpoints.submit(record)

    async def _finish(
        self,
        turn: Turn,
        text: TextStream,
        checkpoints: Checkpoints,
        finish: str,
        finished_before: bool,
        started: float,
        span: trace.Span,
    ) -> Chunk:
        """Ends the turn: the last record written, metrics and span set; returns the final chunk."""
        tail = text.finish()
        state, stats = turn.state, turn.stats
        if state.messages is not None and state.finish is None:
            turn.record.messages = [*state.messages, {"role": "assistant", "content": text.text}]
        state.finish = finish
        self._checkpoint(checkpoints, turn)
        try:
            await checkpoints.flush(must_write=True)
        except StoreUnavailable as exc:
            # Every token has reached the client: failing now would only make it retry what it has.
            # The last record is written later if the store comes back; until then the session's
            # next turn starts from the last record that was written.
            log.warning(
                "session %s: its last record could not be written, retrying later: %s", turn.record.session_id, exc
            )
            span.add_event("specdec.last_checkpoint_failed", {"error": str(exc)})
            self._in_background(checkpoints.write_late(replace(turn.record, tokens=list(turn.record.tokens))))
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
        return Chunk(turn.record.session_id, tail.text, tail.token_ids, finish, stats, _logprobs(turn, tail))


def prompt_chunk(turn: Turn) -> Chunk:
    """The chunk that carries a turn's prompt tokens and their logprobs, before any output."""
    prompt = turn.committed[: turn.state.prompt_len]
    scored = (turn.prompt_logprobs or [])[: max(0, len(prompt) - 1)]
    return Chunk(turn.record.session_id, prompt_token_ids=prompt, prompt_logprobs=scored)


def _logprobs(turn: Turn, released: Release) -> list[TokenLogprob] | None:
    """The logprobs of a release's tokens, when the request asked for them and this coordinator holds
    every one (a turn resumed here lacks those committed before)."""
    if turn.request.top_logprobs is None:
        return None
    positions = range(released.start, released.start + len(released.token_ids))
    if any(i not in turn.logprobs for i in positions):
        return None
    return [turn.logprobs[i] for i in positions]


def _request_attributes(
    facts: ModelFacts,
    request: GenerationRequest,
    session_id: str,
    prompt_tokens: int,
    k: int | None,
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
        "specdec.session": span_session(session_id),
        "specdec.k": "auto" if k is None else k,
    }
