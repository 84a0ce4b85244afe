"""Routing a turn's calls to draft and target replicas: placement, cache rebuilds and failover.

A cache a replica lost is rebuilt from the committed tokens, so a lost cache costs time, never
correctness. A target that is unreachable hands the session to another, which verifies the same
round with the same draft. A draft that fails costs its round the speculation, never the request.
A replica that failed rests a while, then is probed before work goes to it again, unless the call
failed only because the request's own deadline had passed. A replica that refuses one session's
call (a bad field, a full KV budget) is not resting for that: the session alone stops drafting for
a while. A session that moves releases the cache it leaves behind.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

from opentelemetry import trace

from coordinator.choices import PromptForks, SharedPrefill
from coordinator.policy import RoundPlan
from coordinator.replicas import (
    REST_S,
    BackendRejected,
    BackendUnavailable,
    CacheLost,
    CacheRef,
    DraftBackend,
    DraftResult,
    HiddenChunk,
    PromptScorer,
    ReplicaSet,
    TargetBackend,
    VerifyResult,
)
from coordinator.turns import Turn, deadline_passed
from specdec.config import FEATURE_KIND
from specdec.sampling_params import TokenLogprob
from specdec.vocab import ModelFacts

log = logging.getLogger(__name__)

# Deadline of a probe (a model-info call) of a replica whose rest has ended, and of a best-effort
# release of a cache left behind: a healthy replica answers in milliseconds.
PROBE_TIMEOUT_S = 1.0
# Rounds a session drafts no more after a draft replica refused its call.
REFUSED_ROUNDS = 8


@dataclass(frozen=True)
class DraftCall:
    """A draft call's result (None: it failed, and the round runs target-only), and how many committed
    tokens the replica's cache took in before drafting (None: it prefilled the session's cache)."""

    result: DraftResult | None
    caught_up: int | None = None


class Router:
    """One coordinator's draft and target replicas, and the calls a turn makes to them."""

    def __init__(
        self,
        drafts: Sequence[DraftBackend] | ReplicaSet[DraftBackend],
        targets: Sequence[TargetBackend] | ReplicaSet[TargetBackend],
        want_hidden: bool = False,
        side_layers: tuple[int, ...] = (),
        rest_s: float = REST_S,
    ) -> None:
        # Sets given as such may change while the loop runs (discovery); lists stay fixed.
        self.drafts = drafts if isinstance(drafts, ReplicaSet) else ReplicaSet(drafts, rest_s)
        self.targets = targets if isinstance(targets, ReplicaSet) else ReplicaSet(targets, rest_s)
        # A feature draft reads the target's hidden states: ask the target for them, carry them over.
        self.want_hidden = want_hidden
        self.side_layers = side_layers  # target layers whose outputs the feature draft reads too
        # Stopped on close, before the channels: the discovery that changes the sets.
        self._stoppers: list[Callable[[], Awaitable[None]]] = []
        self._background: set[asyncio.Task] = set()  # probes and releases

    def draft_joined(self, facts: ModelFacts) -> None:
        """A draft replica joined while running: a feature draft needs the target's hidden states
        from now on."""
        if facts.kind == FEATURE_KIND:
            self.want_hidden = True
            self.side_layers = facts.side_layers

    def members(self) -> tuple[frozenset[str], frozenset[str]]:
        """The addresses of the draft and of the target replicas that take work now."""
        return frozenset(self.drafts.by_address), frozenset(self.targets.by_address)

    def stop_on_close(self, stop: Callable[[], Awaitable[None]]) -> None:
        """``close`` awaits ``stop()`` first (a discovery task that adds and retires replicas)."""
        self._stoppers.append(stop)

    async def close(self) -> None:
        """Stops discovery, then closes every replica."""
        for stop in self._stoppers:
            await stop()
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(*(r.close() for r in [*self.drafts.everyone(), *self.targets.everyone()]))

    def holding(self) -> Holding:
        """Counts a running turn's caches in the replica sets while it runs (``Holding.update``)."""
        return Holding(self.drafts, self.targets)

    async def place(self, turn: Turn, span: trace.Span, feed_now: bool = False) -> bool:
        """Gives the turn a target cache over its committed tokens unless its cache stays where it is;
        whether it placed one. ``feed_now`` forbids a busy target to defer the prompt.

        A turn that asks for prompt logprobs (``GenerationRequest.prompt_logprobs``) and has none yet
        is always placed afresh, by a prefill that computes every position (a cache it kept would
        skip the shared prefix); ``turn.prompt_logprobs`` then holds them."""
        top = turn.request.prompt_logprobs
        scoring = top is not None and turn.prompt_logprobs is None
        if not scoring and turn.target is not None and self.targets.stays(turn.target.address):
            return False
        left = turn.target
        # One of several choices of a prompt: the first prefills, the others fork its cache.
        forks = turn.request.forks if not scoring else None
        first = forks is not None and forks.target.first()
        if forks is not None and not first and await self._fork_target(turn, forks, span):
            self._release_left(self.targets, left, turn.target)
            return True
        try:
            turn.target, fed, scored = await self._place(
                turn.committed, turn.remaining_s, span, turn.fence, feed_now, top if scoring else None, first
            )
        except BaseException:
            if first and forks is not None:
                forks.target.settle(None)  # the other choices prefill their own
            raise
        if first and forks is not None:
            forks.target.settle(SharedPrefill(turn.target, tuple(turn.committed), fed))
        turn.hidden.add(fed)
        if scoring:
            turn.prompt_logprobs = scored
            if left is not None and left.address == turn.target.address:
                self._release_left(self.targets, left, None)  # the cache the fresh one replaces
        self._release_left(self.targets, left, turn.target)
        return True

    async def place_target(
        self,
        committed: list[int],
        remaining_s: Callable[[], float | None],
        span: trace.Span,
        fence: int,
        feed_now: bool = False,
    ) -> tuple[CacheRef, HiddenChunk | None]:
        """Builds a target cache over ``committed`` on a healthy replica, trying the others when one is
        unreachable; also returns the fed hidden states (when the draft wants them)."""
        ref, fed, _ = await self._place(committed, remaining_s, span, fence, feed_now)
        return ref, fed

    async def _fork_target(self, turn: Turn, forks: PromptForks, span: trace.Span) -> bool:
        """Gives the turn a fork of the first choice's target cache, on the replica that holds it, once
        that cache is placed; whether it did. It does not when that prefill failed, or was over other
        tokens, or when its replica rests, left, fails the call or lost the cache: the turn then
        prefills its own. A refusal (a full KV budget) is the turn's, as a prefill's would be."""
        shared = await forks.target.wait()
        if shared is None or list(shared.tokens) != turn.committed:
            return False
        address = shared.ref.address
        replica = self.targets.find(address)
        if replica is None or not self.targets.usable(address):
            return False
        try:
            forked = await replica.fork(shared.ref, turn.committed, turn.remaining_s(), turn.fence)
        except CacheLost as exc:
            span.add_event("specdec.fork_lost", {"error": str(exc)})
            log.info("the first choice's target cache is gone, this choice prefills its own: %s", exc)
            return False
        except BackendUnavailable as exc:
            if turn.out_of_time():
                raise
            self._failed(self.targets, exc, span, "target", "target unreachable for a fork, prefilling elsewhere")
            return False
        self.targets.succeeded(address)
        turn.target = forked.ref
        turn.hidden.add(shared.hidden)  # the prompt's rows, as the first choice's prefill fed them
        span.add_event("specdec.forked", {"specdec.copied": forked.copied})
        return True

    async def _place(
        self,
        committed: list[int],
        remaining_s: Callable[[], float | None],
        span: trace.Span,
        fence: int,
        feed_now: bool = False,
        prompt_top: int | None = None,
        whole: bool = False,
    ) -> tuple[CacheRef, HiddenChunk | None, list[TokenLogprob] | None]:
        """``place_target``; with ``prompt_top`` set, by a prefill that also returns the logprob of each
        committed token from the second on, with that many alternatives (a target that cannot is a
        ValueError: the request asks for what this deployment does not serve). ``whole``: the prompt is
        fed now, whatever the draft wants (a cache other choices fork must hold all of it)."""
        self._probe_due(self.targets)
        error: BackendUnavailable | None = None
        for _ in range(len(self.targets)):
            target = self.targets.pick(None, probe=True)
            if target is None:
                break
            try:
                scored: list[TokenLogprob] | None = None
                if prompt_top is not None:
                    if not isinstance(target, PromptScorer):
                        raise ValueError(f"prompt_logprobs: target {target.address} does not report prompt logprobs")
                    ref, fed, scored = await target.prefill_scored(
                        committed, remaining_s(), prompt_top, self.want_hidden, fence, self.side_layers
                    )
                else:
                    fed_now = (feed_now and self.want_hidden) or whole
                    ref, fed = await target.prefill_with_hidden(
                        committed, remaining_s(), self.want_hidden, fence, fed_now, self.side_layers
                    )
                self.targets.succeeded(target.address)
                return ref, fed, scored
            except BackendUnavailable as exc:
                if deadline_passed(remaining_s):
                    raise
                error = exc
                self._failed(self.targets, exc, span, "target", "target unreachable, trying another")
        raise error or BackendUnavailable("target", "*", "no target replica is available (all resting or none known)")

    async def draft(self, turn: Turn, plan: RoundPlan, span: trace.Span) -> DraftCall | None:
        """Asks a draft replica for the plan's tokens (None: no replica is available), handing over the
        hidden states it has not seen; moves ``turn.draft`` to where its cache now is.

        One of several choices of a prompt with no draft cache yet: the first such call builds one and
        offers it once it has proposed; the others wait for that and fork it (``coordinator.choices``)."""
        if turn.state.round < turn.draft_refused_until:
            return None
        forks = turn.request.forks if turn.draft is None else None
        if forks is None or not forks.draft.first():
            source = None if forks is None else await forks.draft.wait()
            return await self._draft(turn, plan, span, source)
        call = None
        try:
            call = await self._draft(turn, plan, span, None)
        finally:
            forks.draft.settle(turn.draft if call is not None and call.result is not None else None)
        return call

    async def _draft(self, turn: Turn, plan: RoundPlan, span: trace.Span, source: CacheRef | None) -> DraftCall | None:
        """``draft``; ``source``: another choice's draft cache over this prompt, to fork."""
        self._probe_due(self.drafts)
        replica = self.drafts.pick(turn.draft or source)
        if replica is None:
            return None
        ref = left = turn.draft
        caught_up = None
        try:
            if ref is not None and ref.address == replica.address:
                try:
                    caught_up = len(turn.committed) - ref.committed
                    result = await self._propose(replica, ref, turn, plan)
                except CacheLost:
                    caught_up = None
            if caught_up is None:
                ref = await self._new_draft_cache(replica, turn, source, span)
                result = await self._propose(replica, ref, turn, plan)
        except BackendUnavailable as error:
            if not turn.out_of_time():
                self._failed(self.drafts, error, span, "draft", "draft failed, this round runs target-only")
            return DraftCall(None)
        except BackendRejected as error:
            # The refusal is this session's (its field, or the replica's KV budget while it is full):
            # the replica serves everyone else on, and this session runs target-only a while.
            turn.draft_refused_until = turn.state.round + REFUSED_ROUNDS
            span.add_event("specdec.draft_refused", {"error": str(error)})
            log.info("draft refused a session's call, it runs target-only for %d rounds: %s", REFUSED_ROUNDS, error)
            return DraftCall(None)
        assert ref is not None
        self.drafts.succeeded(replica.address)
        turn.draft = replace(ref, committed=result.committed)
        turn.hidden.clear()
        self._release_left(self.drafts, left, turn.draft)
        return DraftCall(result, caught_up)

    async def _new_draft_cache(
        self, replica: DraftBackend, turn: Turn, source: CacheRef | None, span: trace.Span
    ) -> CacheRef:
        """A draft cache over the turn's committed tokens: a fork of ``source`` (another choice's draft
        cache over the same prompt) when it lies on ``replica``, else a prefill. A fork's copy makes the
        target hidden rows it holds already needless: the turn sends only those after them."""
        if source is not None and source.address == replica.address:
            try:
                forked = await replica.fork(source, turn.committed, turn.remaining_s(), turn.fence)
            except CacheLost as exc:
                span.add_event("specdec.fork_lost", {"error": str(exc)})
            else:
                turn.hidden.drop_before(forked.copied)
                return forked.ref
        return await replica.prefill(turn.committed, turn.remaining_s(), turn.fence)

    @staticmethod
    async def _propose(replica: DraftBackend, ref: CacheRef, turn: Turn, plan: RoundPlan) -> DraftResult:
        return await replica.propose(
            ref,
            turn.committed,
            plan.k,
            turn.sampling,
            turn.state.round,
            turn.remaining_s(),
            turn.hidden.message(),
            plan.min_confidence,
            plan.ahead,
            plan.tree,
        )

    async def verify(
        self, turn: Turn, draft: DraftResult | None, span: trace.Span, features: bool = True
    ) -> VerifyResult:
        """Verifies on the turn's target replica, moving ``turn.target`` along and adding the hidden
        states the target fed to ``turn.hidden`` (when a feature draft reads them and ``features``).

        A replica that lost the cache gets it again from the committed tokens. A replica that is
        unreachable hands the session to another: the same round, with the same draft and round
        index, is verified there, so the stream goes on as if nothing happened.
        """
        assert turn.target is not None
        ref, committed, want, fed = turn.target, turn.committed, self.want_hidden and features, None
        asks = (want, self.side_layers)
        logprobs = turn.request.top_logprobs
        left = ref
        for _ in range(len(self.targets) + 1):
            if not self.targets.stays(ref.address):
                ref, fed = await self.place_target(committed, turn.remaining_s, span, ref.fence)
            # The replica may have left while the cache was placed: the call then fails over below.
            target = self.targets.find(ref.address)
            try:
                if target is None:
                    raise BackendUnavailable("target", ref.address, "the replica left")
                try:
                    result = await target.verify(
                        ref, committed, draft, turn.sampling, turn.state.round, turn.remaining_s(), *asks, logprobs
                    )
                except CacheLost:
                    ref, fed = await target.prefill_with_hidden(
                        committed, turn.remaining_s(), want, ref.fence, side_layers=self.side_layers
                    )
                    result = await target.verify(
                        ref, committed, draft, turn.sampling, turn.state.round, turn.remaining_s(), *asks, logprobs
                    )
                self.targets.succeeded(target.address)
                turn.target = replace(ref, committed=result.committed)
                self._release_left(self.targets, left, turn.target)
                turn.hidden.add(fed)  # a cache placed anew: its prompt's rows come first
                turn.hidden.add(result.hidden)
                return result
            except BackendUnavailable as exc:
                if turn.out_of_time():
                    raise
                self._failed(self.targets, exc, span, "target", "target unreachable, moving the session")
        raise BackendUnavailable("target", ref.address, "no target replica could verify this round")

    def _probe_due(self, replicas: ReplicaSet) -> None:
        """Starts a probe of every replica whose rest has ended (``ReplicaSet.probes_due``)."""
        for replica in replicas.probes_due():
            self._in_background(self._probe(replicas, replica))

    @staticmethod
    async def _probe(replicas: ReplicaSet, replica) -> None:
        ok = False
        try:
            await replica.facts(PROBE_TIMEOUT_S)
            ok = True
        except Exception as exc:  # noqa: BLE001 - any failure keeps the replica resting
            log.info("probe of %s failed, it rests longer: %s", replica.address, exc)
        finally:
            replicas.probed(replica.address, ok)

    def _release_left(self, replicas: ReplicaSet, left: CacheRef | None, now: CacheRef | None) -> None:
        """Releases, in the background and best effort, the cache a session left on another replica:
        otherwise it would hold memory there until it idled out. ``now`` None: ``left`` is released
        wherever it is (a fresh cache replaced it on its own replica)."""
        if left is None or (now is not None and left.address == now.address):
            return
        replica = replicas.find(left.address)
        if replica is not None:
            failed = f"could not release cache {left.cache_id} on {replica.address}"
            self._in_background(_best_effort(partial(replica.release, left.cache_id, PROBE_TIMEOUT_S), failed))

    def turn_ended(self, draft: CacheRef | None, target: CacheRef | None) -> None:
        """Tells the replicas holding a finished turn's caches, in the background and best effort, that
        its session has no round in flight: their next batched pass does not wait for it (a whole
        gathering window otherwise, at every request's end)."""
        for replicas, ref in ((self.drafts, draft), (self.targets, target)):
            if ref is not None and (replica := replicas.find(ref.address)) is not None:
                failed = f"could not tell {replica.address} that cache {ref.cache_id} is idle"
                self._in_background(_best_effort(partial(replica.idle, ref.cache_id, PROBE_TIMEOUT_S), failed))

    def _in_background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _failed(
        self,
        replicas: ReplicaSet,
        error: BackendUnavailable | BackendRejected,
        span: trace.Span,
        service: str,
        what: str,
    ) -> None:
        """Notes a failed call (a ``specdec.<service>_failed`` span event): the replica rests a while."""
        replicas.failed(error.address)
        span.add_event(f"specdec.{service}_failed", {"error": str(error)})
        log.warning("%s: %s", what, error)


class Holding:
    """The replicas one running turn keeps caches on, counted in their replica sets while it runs."""

    def __init__(self, drafts: ReplicaSet, targets: ReplicaSet) -> None:
        self._sets = (drafts, targets)
        self._held: list[str | None] = [None, None]

    def update(self, draft: CacheRef | None, target: CacheRef | None) -> None:
        """The turn's caches are now at ``draft`` and ``target``."""
        for i, ref in enumerate((draft, target)):
            address = None if ref is None else ref.address
            self._sets[i].hold(self._held[i], address)
            self._held[i] = address

    def __enter__(self) -> Holding:
        return self

    def __exit__(self, *exc) -> None:
        self.update(None, None)


async def _best_effort(call: Callable[[], Awaitable[None]], failed: str) -> None:
    """Awaits a call a replica may miss without harm (a release: the cache idles out in the end; an
    idle notice: the replica waits one window instead); ``failed`` is logged if it fails."""
    try:
        await call()
    except Exception as exc:  # noqa: BLE001 - nothing depends on it
        log.info("%s: %s", failed, exc)
