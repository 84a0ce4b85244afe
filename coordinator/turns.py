"""A request's turn: what a client asks for, what it gets back, and the state one running turn keeps.

``Turns.open`` loads (or creates) the session, starts or resumes the turn, counts the session
against its client's limit and takes the session's lease. ``Turn`` then carries everything the round
loop and the speculation policy read and update from round to round.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from coordinator.adaptive import AcceptanceTracker, add_counts
from coordinator.choices import PromptForks
from coordinator.hidden_backlog import HiddenBacklog
from coordinator.prompts import build_turn
from coordinator.replicas import CacheRef
from coordinator.sessions import SessionRecord, SessionStore, StoreUnavailable, TurnState, is_session_id
from coordinator.tree_choice import TreeAcceptance
from specdec.grammar import GrammarCompiler, GrammarMatcher, ResponseFormat, compiler_for
from specdec.sampling_params import Sampling, TokenLogprob, check_penalties
from specdec.token_lists import common_prefix_len
from specdec.trees import depths
from specdec.vocab import ModelFacts

log = logging.getLogger(__name__)

# Characters a prompt may carry per token of context. No tokenizer of a served model packs more
# than a few characters of ordinary text into a token, so a prompt past this cannot fit, and is
# refused before tokenizing it (which would take the event loop that serves everyone).
MAX_PROMPT_CHARS_PER_TOKEN = 32


class ContextOverflow(ValueError):
    """A turn's prompt does not fit the model's context (INVALID_ARGUMENT; OpenAI's
    ``context_length_exceeded``)."""


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
    """A validated request; exactly one of ``text``, ``messages`` and ``prompt_token_ids`` is set."""

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
    # Who sent it (``coordinator.identity.Caller``): the limits' count and the sessions' owner.
    client: str = ""
    owner: str = ""
    # Most nodes of a round's token tree; None: the coordinator's default, 0: chains only.
    tree_nodes: int | None = None
    # Logit transforms (``specdec.sampling.penalize_logits``), applied to draft and target alike.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The prompt as token ids, appended to the session's tokens as given (no template, no special tokens).
    prompt_token_ids: tuple[int, ...] | None = None
    # Structured output: ``specdec.grammar.ResponseFormat.key()`` of the format the output must match
    # ("" for none); the services mask the draft's q and the target's p by its grammar.
    response_format: str = ""
    # Set: report each generated token's logprob under the target with this many alternatives.
    top_logprobs: int | None = None
    # Set: also report the prompt's logprobs (each prompt token's from the second on, given the ones
    # before it, under the target) with this many alternatives, in a chunk before any output. The
    # target's cache is then built afresh by a prefill that computes them. 0 ``max_new_tokens`` asks
    # for them alone (scoring a text).
    prompt_logprobs: int | None = None
    # Chat: OpenAI tool definitions (JSON text, "" for none) rendered into the prompt
    # (``coordinator.tools``); a forced call is enforced through ``response_format``.
    tools: str = ""
    # Chat with a session: ``messages`` are the whole conversation, rendered afresh, rather than
    # messages to append to the session's (the OpenAI API's stateless clients resend everything).
    whole_conversation: bool = False
    # Set when this is one of several choices of one prompt: what they share to prefill the prompt
    # once (``coordinator.choices``). Not part of what the request asks for.
    forks: PromptForks | None = field(default=None, compare=False, repr=False)

    def sampling(self, seed: int, coupled: bool, output_start: int) -> Sampling:
        """The turn's sampling settings; ``output_start``: the committed length where its output begins
        (the presence and frequency penalties count the tokens from there on)."""
        return Sampling(
            self.temperature,
            self.top_k,
            self.top_p,
            seed,
            coupled,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            output_start=output_start,
            response_format=self.response_format,
        )


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
    # from a higher prior than the draft's.
    lookup: AcceptanceTracker = field(default_factory=lambda: AcceptanceTracker(prior=0.7))
    # Token trees: rounds, nodes verified, accepted paths by depth reached and accepted nodes by rank.
    tree_rounds: int = 0
    tree_nodes: int = 0
    accepted_at_depth: list[int] = field(default_factory=list)
    accepted_at_rank: list[int] = field(default_factory=list)
    tree_depths: int = 0
    tree_levels_judged: int = 0
    # Acceptance by depth and sibling rank of this turn's trees (a sampled turn's tree choice reads it).
    trees: TreeAcceptance = field(default_factory=TreeAcceptance)

    def add_round(
        self, drafted: int, accepted: int, committed: int, looked_up: bool = False, forced: bool = False
    ) -> None:
        """Counts one finished round; ``looked_up``: the coordinator's prompt lookup drafted it;
        ``forced``: the tokens the grammar forces, which say nothing of either's acceptance."""
        self._count(drafted, accepted, committed)
        if not forced:
            (self.lookup if looked_up else self.positions).record(drafted, accepted)

    def add_tree_round(
        self, parents: tuple[int, ...], path: tuple[int, ...], path_ranks: tuple[int, ...], committed: int
    ) -> None:
        """Counts one finished tree round: its nodes' ``parents``, the accepted ``path`` and its nodes'
        sibling ranks."""
        self._count(len(parents), len(path), committed)
        self.tree_rounds += 1
        self.tree_nodes += len(parents)
        depth = max(depths(parents), default=0)
        self.tree_depths += depth
        self.tree_levels_judged += min(depth, len(path) + 1)
        add_counts(self.accepted_at_depth, [1] * len(path))
        for rank in path_ranks:
            add_counts(self.accepted_at_rank, [0] * rank + [1])
        self.trees.record(parents, path)

    def _count(self, drafted: int, accepted: int, committed: int) -> None:
        self.rounds += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.committed_in_rounds += committed

    def by_position(self) -> tuple[list[int], list[int]]:
        """Drafted and accepted counts by draft position, over every source of proposals."""
        drafted, accepted = list(self.positions.drafted), list(self.positions.accepted)
        add_counts(drafted, self.lookup.drafted)
        add_counts(accepted, self.lookup.accepted)
        return drafted, accepted

    @property
    def judged_tokens(self) -> int:
        """Draft tokens the target judged (each round's up to its first rejection), every source."""
        return sum(self.positions.tried) + sum(self.lookup.tried) + self.tree_levels_judged

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
    # With ``GenerationRequest.top_logprobs``: one per token of ``token_ids``; None when not asked for,
    # or for tokens committed before a resume on another coordinator.
    logprobs: list[TokenLogprob] | None = None
    # With ``GenerationRequest.prompt_logprobs``, on a chunk of its own before any output: the prompt's
    # tokens, and the logprob of each from the second on (``prompt_logprobs[i]`` is token i + 1's).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class Turn:
    """One running turn: the request, its session record, and where its caches are.

    ``record.tokens`` are the committed tokens (prompt and output so far); ``record.turn`` the state a
    resume on another coordinator continues from. ``draft`` and ``target`` are the caches this turn
    uses now; they reach the record at each checkpoint.
    """

    request: GenerationRequest
    record: SessionRecord
    resumed: bool
    sampling: Sampling
    stats: Stats
    remaining_s: Callable[[], float | None]
    draft: CacheRef | None = None
    target: CacheRef | None = None
    # Target hidden states the draft has not been sent yet.
    hidden: HiddenBacklog = field(default_factory=HiddenBacklog)
    # The round before which the session drafts no more, after a draft replica refused its call.
    draft_refused_until: int = 0
    # With logprobs asked for: each output token's, by its index in the turn's output.
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    # With prompt logprobs asked for, once the target's cache is placed: the logprob of each committed
    # token from the second on, as that placement's prefill computed them.
    prompt_logprobs: list[TokenLogprob] | None = None
    # Structured output: the grammar's state over the turn's output (``forced_tokens`` advances it).
    grammar: GrammarMatcher | None = None

    @property
    def committed(self) -> list[int]:
        """The session's committed tokens (extended in place as rounds commit)."""
        return self.record.tokens

    @property
    def state(self) -> TurnState:
        """The turn's resumable state."""
        assert self.record.turn is not None
        return self.record.turn

    @property
    def fence(self) -> int:
        """The turn's fencing token: services and the store refuse older turns' calls."""
        return self.record.fence

    def forced_tokens(self, limit: int) -> list[int]:
        """The next tokens the turn's grammar allows alone, at most ``limit`` (``GrammarMatcher.forced``),
        after the output committed so far; none without a grammar. A grammar the output has left (it
        cannot: the services mask by the same one) is dropped rather than trusted."""
        if self.grammar is None or limit <= 0:
            return []
        output = self.committed[self.state.prompt_len :]
        try:
            self.grammar.advance_many(output[self.grammar.consumed :])
        except (ValueError, RuntimeError):
            self.grammar = None
            return []
        return self.grammar.forced(limit)

    def out_of_time(self) -> bool:
        """Whether the request's own deadline has passed. A call that failed then failed on the client's
        clock, not the replica's: resting the replica would fail every other session on it."""
        return deadline_passed(self.remaining_s)


class Turns:
    """Opens turns on sessions kept in a store: new, continued or resumed."""

    def __init__(self, tokenizer, facts: ModelFacts, store: SessionStore, max_sessions_per_client: int = 0) -> None:
        self._tokenizer = tokenizer
        self._facts = facts
        self.store = store
        self._max_sessions_per_client = max_sessions_per_client
        self._grammars: GrammarCompiler | None = None

    def matcher(self, key: str) -> GrammarMatcher:
        """A matcher at the start of the format with this ``ResponseFormat.key()`` (checked by ``open``)."""
        fmt = ResponseFormat.from_key(key)
        self.check_format(fmt)
        assert self._grammars is not None
        return self._grammars.matcher(fmt)

    def check_format(self, fmt: ResponseFormat) -> None:
        """Compiles ``fmt`` for the served tokenizer (cached), so that a format the services could not
        enforce is refused before a session opens: ValueError ``response_format: <the engine's reason>``
        (``tools:`` for a ``lark`` format, which only tool calls build), naming the schema keyword. The
        compiler is built at the first format (about a second for a 49k vocabulary, once per
        coordinator); a compile takes about a millisecond."""
        if self._grammars is None:
            facts = self._facts
            self._grammars = compiler_for(self._tokenizer, facts.vocab_size, facts.eos_token_ids)
        try:
            self._grammars.compile(fmt)
        except ValueError as error:
            param = "tools" if fmt.kind == "lark" else "response_format"
            raise ValueError(f"{param}: {error}") from None

    async def open(self, request: GenerationRequest, new_id: str) -> tuple[SessionRecord, bool]:
        """The session's record with this request's turn in ``record.turn``, and whether the turn is
        resumed (it ran before, on this or another coordinator). The turn takes the session's lease."""
        # The biased token ids are checked here, where the served vocabulary is known.
        check_penalties(
            request.presence_penalty,
            request.frequency_penalty,
            request.repetition_penalty,
            request.logit_bias,
            self._facts.vocab_size,
        )
        if request.response_format:
            self.check_format(ResponseFormat.from_key(request.response_format))
        record = await self._load(request, new_id)
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
        limit = self._facts.max_context
        chars = len(request.text or "") + len(request.tools)
        chars += sum(len(value) for m in request.messages or () for value in m.values())
        if chars > limit * MAX_PROMPT_CHARS_PER_TOKEN:
            raise ContextOverflow(f"prompt: {chars} characters cannot fit in the context of {limit} tokens")
        if request.prompt_token_ids is not None:
            tokens, messages = [*record.tokens, *self._checked_ids(request.prompt_token_ids)], record.messages
        else:
            turn = build_turn(
                self._tokenizer,
                record.tokens,
                record.messages,
                request.text,
                request.messages,
                request.tools,
                request.whole_conversation,
            )
            tokens, messages = turn.tokens, turn.messages
        if len(tokens) >= limit:
            raise ContextOverflow(f"prompt: {len(tokens)} tokens leave no room in the context of {limit}")
        # The caches keep the prefix this turn shares with what the session committed before.
        shared = common_prefix_len(record.tokens, tokens)
        record.draft, record.target = clip(record.draft, shared), clip(record.target, shared)
        record.tokens = list(tokens)
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        record.turn = TurnState(request.fingerprint, len(tokens), seed, messages)
        await self._claim(request, record)
        await self._take_lease(record)
        return record, False

    def _checked_ids(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        """Prompt token ids, each checked to name a token of the served vocabulary (an id past it would
        index past the models' embeddings)."""
        vocab = self._facts.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: {bad} is not a token id of this model (ids lie in [0, {vocab}))")
        return ids

    async def unclaim(self, request: GenerationRequest, session_id: str) -> None:
        """Stops counting a session that never reached its client against the client's limit."""
        if not (self._max_sessions_per_client and request.client):
            return
        try:
            await asyncio.shield(self.store.unclaim(request.client, session_id))
        except StoreUnavailable as exc:  # the claim expires with the session's TTL instead
            log.warning("session %s still counts for its client until it expires: %s", session_id, exc)

    async def _load(self, request: GenerationRequest, new_id: str) -> SessionRecord:
        """The session the request continues, or a new one it owns. Another owner's session is not
        found, exactly like an unknown one: its id alone reveals and grants nothing."""
        session_id = request.session_id
        if not session_id:
            return SessionRecord(session_id=new_id, owner=request.owner)
        record = await self.store.get(session_id) if is_session_id(session_id) else None
        if record is None or record.owner != request.owner:
            raise SessionNotFound(f"session_id: no session {session_id!r} (unknown or expired)")
        return record

    async def _claim(self, request: GenerationRequest, record: SessionRecord) -> None:
        """Counts the session among its client's live ones, refusing one past the client's limit."""
        limit = self._max_sessions_per_client
        if limit and request.client and not await self.store.claim(request.client, record.session_id, limit):
            raise TooManySessions(
                f"session_id: this client already keeps {limit} live sessions; continue one of them or wait "
                "for one to expire"
            )

    async def _take_lease(self, record: SessionRecord) -> None:
        """Takes a fencing token newer than any earlier turn's, for the record and its caches: from
        now on the services and the store refuse the older turns' calls and writes."""
        record.fence = await self.store.take_fence(record.session_id, record.fence)
        if record.draft is not None:
            record.draft = replace(record.draft, fence=record.fence)
        if record.target is not None:
            record.target = replace(record.target, fence=record.fence)


def deadline_passed(remaining_s: Callable[[], float | None]) -> bool:
    """Whether a deadline reported as seconds left (None: none) has passed."""
    left = remaining_s()
    return left is not None and left <= 0


def clip(ref: CacheRef | None, committed: int) -> CacheRef | None:
    """A cache reference that claims no more committed tokens than ``committed``."""
    return None if ref is None else replace(ref, committed=min(ref.committed, committed))
