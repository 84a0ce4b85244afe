"""The target's core: sync a session cache, score draft tokens in one pass, and decide acceptance.

No gRPC here; ``target_service.server`` converts messages to these calls.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from specdec.batching import PassLoad, waves
from specdec.compiled import CompiledPass
from specdec.config import MAX_K
from specdec.constrain import grammar_at, mask_logits
from specdec.errors import CacheBudgetExceeded
from specdec.grammar import GrammarCompiler, GrammarMatcher, compiler_for
from specdec.kvcache import CacheTable, HiddenRows, SessionCache, fit_fork
from specdec.models import LoadedModel
from specdec.ragged import RaggedItem, ragged_forward, ragged_unsupported
from specdec.sampling import (
    MAX_TOP_LOGPROBS,
    Sampling,
    TokenLogprob,
    Verdict,
    chain_paths,
    penalize_logits,
    round_generator,
    sparse_to_dense,
    token_logprobs,
    verify_coupled,
    verify_greedy,
    verify_sampled,
    warp_probs,
)
from specdec.side_layers import check_side_layers
from specdec.tree_verify import TreeVerdict, verify_tree_coupled, verify_tree_greedy, verify_tree_sampled
from specdec.trees import MAX_TREE_NODES, check_parents, depths, is_chain, node_paths
from specdec.vocab import ModelFacts
from target_service.pass_costs import PassCosts

log = logging.getLogger("specdec.target")

TARGET_STREAM = 2
# Own rows (pending token + draft tokens) a reply's pass-cost curve covers: k up to 15.
CURVE_ROWS = 16
# Pass sizes (token rows) measured at start-up.
WARMUP_ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
# Most hidden-state rows a prefill (or a verify that fed a long new turn) returns (2048 x 576 fp16 is
# 2.4 MB, well inside a message); the draft attends to the newest ones only. Rows that carry side
# layers are wider: fewer of them fit the byte budget, well inside the default 8 MiB message limit.
PREFILL_HIDDEN_ROWS = 2048
PREFILL_HIDDEN_BYTES = 6 * 1024 * 1024
# Rows whose prompt logprobs one LM-head call computes (``prompt_logprobs``): 256 rows of a 49k
# vocabulary are 50 MB of float32 logits.
PROMPT_LOGPROB_ROWS = 256


@dataclass(frozen=True)
class SparseQ:
    """A draft distribution restricted to its support."""

    token_ids: list[int]
    probs: list[float]


@dataclass(frozen=True)
class VerifyCall:
    """One session's verification request, as the engine takes it."""

    cache_id: str
    start: int
    new_tokens: list[int]
    draft_tokens: list[int]
    q: list[SparseQ]
    sampling: Sampling
    round_index: int
    with_hidden: bool = False
    # The caller's fencing token (see SessionCache.sync).
    fence: int = 0
    # > 0: not a round but a chunk of a long prompt (see ``feed_call``): the pass feeds this many of
    # the cache's pending committed tokens, never the last, and verifies nothing.
    feed_rows: int = 0
    # With ``with_hidden``: target layers whose outputs follow the hidden states (specdec.side_layers).
    side_layers: tuple[int, ...] = ()
    # A token tree: each draft token's parent (``specdec.trees``); empty: the draft tokens are a chain.
    draft_parents: tuple[int, ...] = ()
    # Not None: report each committed token's log probability with this many alternatives.
    top_logprobs: int | None = None

    @property
    def tree(self) -> tuple[int, ...] | None:
        """The draft tokens' parents when they form a tree (not a plain chain), else None."""
        return self.draft_parents if self.draft_parents and not is_chain(self.draft_parents) else None


def wire_ready(rows: torch.Tensor) -> torch.Tensor:
    """Hidden rows ``[n, W]`` in a dtype the wire's numpy conversion has: a bfloat16 target's upcast (on
    its device, before they leave it), float32 and float16 ones as they are."""
    return rows.float() if rows.dtype == torch.bfloat16 else rows


def prompt_logprobs(model: torch.nn.Module, rows: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The logprob of each of ``tokens[1:]`` (and ``top`` alternatives) from the prefill pass's rows
    ``[n - 1, W]`` (row i: the final-norm hidden state at position i, side layers after it), through the
    model's LM head (and its final logit soft-capping, where it has one) in blocks of
    PROMPT_LOGPROB_ROWS rows."""
    width = model.config.hidden_size
    cap = getattr(model.config, "final_logit_softcapping", None)
    head = model.get_output_embeddings()
    out: list[TokenLogprob] = []
    with torch.inference_mode():
        for lo in range(0, len(tokens) - 1, PROMPT_LOGPROB_ROWS):
            block = rows[lo : lo + PROMPT_LOGPROB_ROWS, :width]  # [b, D]
            logits = head(block).float()  # [b, V]
            if cap:
                logits = torch.tanh(logits / cap) * cap
            out += token_logprobs(logits, tokens[lo + 1 : lo + 1 + len(block)], top)
    return out


def newest_hidden(rows: list[HiddenRows]) -> HiddenRows | None:
    """Consecutive hidden rows as one block, cut to the newest PREFILL_HIDDEN_ROWS, or fewer where wide
    rows would pass PREFILL_HIDDEN_BYTES (None: no rows)."""
    if not rows:
        return None
    kept = rows[0].rows if len(rows) == 1 else torch.cat([r.rows for r in rows])
    kept = kept[-min(PREFILL_HIDDEN_ROWS, PREFILL_HIDDEN_BYTES // (2 * kept.shape[1])) :]  # [n, W]
    return HiddenRows(rows[-1].start + len(rows[-1].rows) - len(kept), kept)


def feed_call(
    cache_id: str,
    rows: int,
    with_hidden: bool = False,
    sync: VerifyCall | None = None,
    side_layers: tuple[int, ...] = (),
) -> VerifyCall:
    """A call that feeds the next ``rows`` pending tokens of a long prompt (or a long new turn) into its
    cache, beside other sessions' rounds in a shared pass; its outcome commits nothing and carries the
    fed rows' hidden states. With ``sync`` (a round's call) it first syncs the cache as that call would."""
    start, tokens, fence = (sync.start, sync.new_tokens, sync.fence) if sync is not None else (0, [], 0)
    return VerifyCall(
        cache_id,
        start,
        list(tokens),
        [],
        [],
        Sampling(),
        0,
        with_hidden,
        fence,
        feed_rows=rows,
        side_layers=side_layers,
    )


@dataclass(frozen=True)
class VerifyOutcome:
    """A verified round: what was accepted, the committed tokens, and the cache's committed length."""

    accepted: int
    tokens: list[int]
    committed: int
    hidden: HiddenRows | None = None
    load: PassLoad | None = None
    # A tree's accepted nodes, root to leaf (indices into its draft tokens); None for a chain.
    path: list[int] | None = None
    # When asked: one per committed token, from the target's raw logits of this pass.
    logprobs: list[TokenLogprob] | None = None


def stamp_queue_wait(outcome: VerifyOutcome, queue_ms: float) -> VerifyOutcome:
    """The outcome with the time its call waited before its pass recorded in its load."""
    if outcome.load is None:
        return outcome
    return replace(outcome, load=replace(outcome.load, queue_ms=queue_ms))


@dataclass
class _Prepared:
    """A call whose cache is synced and ready to feed: index into the batch, cache, and fed tokens."""

    index: int
    call: VerifyCall
    cache: SessionCache
    fed: list[int]

    @property
    def feeds_prompt(self) -> bool:
        """Whether the pass feeds more committed tokens than the round's last one: a deferred prompt
        (or a chunk of one)."""
        return self.call.feed_rows > 0 or len(self.fed) > len(self.call.draft_tokens) + 1


class TargetEngine:
    """Verifies draft proposals for many sessions against one target model (one pass at a time).

    Calls that arrive together are verified in one ragged pass (``specdec.ragged``) when the model
    supports it, so a batch costs about one weight read instead of one per session.

    With a ``compiled`` pass (``specdec.compiled``), every pass runs through it once its graphs are
    built, prompts included. The compiled pass's bits are not the eager one's, so a session must not
    mix them: at the switch the engine drops every cache (their sessions are prefilled again, from
    their committed tokens, by the compiled pass) and measures its pass costs again.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        max_sessions: int,
        curve_rows: int = CURVE_ROWS,
        *,
        budget_bytes: int = 0,
        idle_s: float = 0.0,
        reuse_min: int = 0,
        compiled: CompiledPass | None = None,
    ) -> None:
        """``max_sessions``, ``budget_bytes`` and ``idle_s`` bound the session caches, ``reuse_min`` sets
        their prefix reuse (see CacheTable); ``compiled`` takes over the passes once ready (see the
        class docstring)."""
        self._loaded = loaded
        self._caches = CacheTable(max_sessions, budget_bytes=budget_bytes, idle_s=idle_s, reuse_min=reuse_min)
        unsupported = ragged_unsupported(loaded.model.config)
        self._ragged = unsupported is None
        if unsupported is not None:
            # Still exact, only slower under load: say so where an operator looks first.
            log.warning(
                "target %s: %s; verifying one pass per session, without batching or prompt folding",
                loaded.name,
                unsupported,
            )
        self._compiled = compiled if self._ragged else None
        self._switched = False  # passes run through the compiled graphs
        self._costs = PassCosts()
        self._warming = False  # passes now are warm-up's (PassCosts.record)
        self._curve_rows = curve_rows
        # Built at the first constrained call: reading a 49k vocabulary into the engine takes a second.
        self._grammars: GrammarCompiler | None = None
        self._reset_totals()

    def _reset_totals(self) -> None:
        """Totals since warm-up, read by the metrics scrape (``specdec.metrics.PassStats``): batched
        passes run, rounds verified in them, the most rounds one pass held, the passes' seconds, and
        the rows they fed for rounds (pending token + draft tokens) and for prompts (folded, chunked);
        besides them, the prompt rows prefills fed in passes of their own and the KV rows copied
        instead of computed, by forks (``fork``) and by prefix reuse (``prefill``)."""
        self.passes = self.verified = self.largest_pass = self.round_rows = self.prompt_rows = 0
        self.prefill_rows = self.forked_rows = self.reused_rows = 0
        self.pass_seconds = 0.0

    @property
    def facts(self) -> ModelFacts:
        """The model facts this service reports: trees are verified in the ragged pass only."""
        return replace(self._loaded.facts("target"), trees=self._ragged)

    @property
    def model(self) -> torch.nn.Module:
        """The target model the passes run."""
        return self._loaded.model

    @property
    def caches(self) -> CacheTable:
        """The session caches; the metrics scrape reads their count and size from another thread."""
        return self._caches

    @property
    def batches(self) -> bool:
        """True when calls that arrive together share one pass."""
        return self._ragged

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler for this model's tokenizer, built once."""
        if self._grammars is None:
            loaded = self._loaded
            self._grammars = compiler_for(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
        return self._grammars

    @property
    def compiled(self) -> bool:
        """Whether passes run through the compiled graphs now."""
        return self._switched

    def _switch_when_compiled(self) -> None:
        """Moves every later pass to the compiled graphs once they are built (on the model's thread,
        between passes); see the class docstring."""
        if self._switched or self._compiled is None or not self._compiled.ready:
            return
        dropped = self._caches.ids()
        for cache_id in dropped:
            self._caches.release(cache_id)
        self._switched = True
        log.info(
            "target %s: passes now run compiled (built in %.0f s); dropped %d session caches, which their "
            "coordinators prefill again",
            self._loaded.name,
            self._compiled.compile_s or 0.0,
            len(dropped),
        )
        self._costs = PassCosts()
        if not self._warming:  # a switch inside warm-up: that warm-up measures the compiled passes
            self.warmup()

    def forward(self, items: list[RaggedItem]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One ragged pass over ``items``, compiled once switched."""
        if self._switched:
            assert self._compiled is not None
            return self._compiled.forward(items)
        return ragged_forward(self._loaded.model, items)

    def _check_tokens(self, tokens: list[int], what: str) -> None:
        vocab = self._loaded.vocab_size
        if any(t < 0 or t >= vocab for t in tokens):
            raise ValueError(f"{what}: token ids must lie in [0, {vocab})")

    def prefill(
        self,
        tokens: list[int],
        with_hidden: bool = False,
        fence: int = 0,
        cache_id: str | None = None,
        defer: bool = False,
        side_layers: tuple[int, ...] = (),
    ) -> tuple[str, int, HiddenRows | None]:
        """Creates a session cache over ``tokens`` (under ``cache_id``, or a fresh id); returns its id,
        committed length and, when asked, the hidden states of the positions it fed (followed by the
        outputs of ``side_layers``).

        With ``defer`` nothing is fed yet: the session's first verify pass feeds the prompt beside the
        other sessions' rows (and returns its hidden states), instead of a pass of its own that every
        other session waits for. The reply then carries no hidden states.

        A prefix another cache holds is copied, not fed (``CacheTable`` prefix reuse): the hidden
        states then start after it.
        """
        self._switch_when_compiled()
        side_layers = self._check_prefill(tokens, side_layers)
        cache_id, cache = self._caches.create(tokens, fence, cache_id)
        self.reused_rows += len(cache.kv_tokens)
        if defer:
            return cache_id, len(cache.committed), None
        hidden = self._feed_prompt(cache, with_hidden, side_layers)
        if hidden is not None:
            hidden = HiddenRows(hidden.start, wire_ready(hidden.rows))
        self._caches.fit_budget(cache_id)
        # A long prompt's rows would outgrow a message; the draft attends to the newest ones only.
        return cache_id, len(cache.committed), newest_hidden([hidden] if hidden is not None else [])

    def prefill_scored(
        self,
        tokens: list[int],
        top: int,
        with_hidden: bool = False,
        fence: int = 0,
        side_layers: tuple[int, ...] = (),
    ) -> tuple[str, int, HiddenRows | None, list[TokenLogprob]]:
        """``prefill`` (fed now, into a fresh cache), also returning the prompt logprobs: for each token
        from position 1 on, its log probability under the target given the tokens before it, with the
        ``top`` likeliest alternatives (``token_logprobs`` on the pass's raw logits).

        The pass is today's prefill pass (the same kernels fill the cache, so the session's later
        rounds are unchanged); only the LM head also runs over every fed row, in blocks of
        PROMPT_LOGPROB_ROWS, so a long prompt never holds all its ``[n, V]`` logits at once.
        """
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs: must lie in [0, {MAX_TOP_LOGPROBS}]")
        self._switch_when_compiled()
        side_layers = self._check_prefill(tokens, side_layers)
        cache_id, cache = self._caches.create(tokens, fence, reuse=False)  # every position is scored
        try:
            rows = self._feed_prompt(cache, True, side_layers if with_hidden else ())
            assert rows is not None  # asked for
            scored = prompt_logprobs(self._loaded.model, rows.rows, tokens, top)
        except BaseException:
            self._caches.release(cache_id)  # a half-fed cache serves no one
            raise
        hidden = HiddenRows(rows.start, wire_ready(rows.rows)) if with_hidden else None
        self._caches.fit_budget(cache_id)
        return cache_id, len(cache.committed), newest_hidden([hidden] if hidden is not None else []), scored

    def fork(
        self, source_id: str, tokens: list[int], fence: int = 0, cache_id: str | None = None
    ) -> tuple[str, int, int]:
        """Creates a session cache over ``tokens`` (under ``cache_id``, or a fresh id) whose KV entries
        are copied from cache ``source_id`` where its tokens match, instead of computed; returns its id,
        committed length and the rows copied. Tokens the copy does not hold stay pending: the session's
        first verify pass feeds them, as a deferred prompt's.

        A position's KV does not depend on the pass that computed it (batch invariance), so the copy is
        what a prefill of ``tokens`` would hold, bit for bit. An unknown source is CacheNotFound; a copy
        past the KV budget while every other cache is in use, CacheBudgetExceeded (nothing is kept)."""
        self._switch_when_compiled()  # a switch drops the source: the caller then prefills
        self._check_prefill(tokens, ())
        cache_id, cache = self._caches.fork(source_id, tokens, fence, cache_id)
        fit_fork(self._caches, cache_id, source_id)
        self.forked_rows += len(cache.kv_tokens)
        return cache_id, len(cache.committed), len(cache.kv_tokens)

    def _check_prefill(self, tokens: list[int], side_layers: tuple[int, ...]) -> tuple[int, ...]:
        """Refuses a prompt that is empty, fills the context or names a token outside the vocabulary;
        returns the checked side layers."""
        if not tokens:
            raise ValueError("tokens: prefill needs at least one token")
        if len(tokens) >= self._loaded.max_context:
            raise ValueError(f"tokens: {len(tokens)} tokens exceed the context of {self._loaded.max_context}")
        self._check_tokens(tokens, "tokens")
        return check_side_layers(side_layers, self._loaded.model.config.num_hidden_layers)

    def _feed_prompt(self, cache: SessionCache, with_hidden: bool, side_layers: tuple[int, ...]) -> HiddenRows | None:
        """Caches a new session's committed tokens but the last (``SessionCache.prefill``: those its
        cache does not hold yet), through the compiled pass once switched."""
        self.prefill_rows += len(cache.pending()) - 1
        if not self._switched or len(cache.pending()) <= 1:
            return cache.prefill(self._loaded.model, with_hidden, side_layers)
        start = len(cache.kv_tokens)
        fed = cache.committed[start:-1]
        _, hidden = self.forward([RaggedItem(cache.kv, fed, 0, side_layers if with_hidden else ())])
        cache.kv_tokens.extend(fed)
        return HiddenRows(start, hidden[0]) if with_hidden else None

    def verify(
        self,
        cache_id: str,
        start: int,
        new_tokens: list[int],
        draft_tokens: list[int],
        q: list[SparseQ],
        sampling: Sampling,
        round_index: int,
        with_hidden: bool = False,
        side_layers: tuple[int, ...] = (),
    ) -> VerifyOutcome:
        """Scores ``draft_tokens`` after the committed tokens and commits accepted + 1 tokens.

        With ``with_hidden``, the outcome carries the hidden states of the committed positions fed
        (followed by the outputs of ``side_layers``).
        """
        call = VerifyCall(
            cache_id, start, new_tokens, draft_tokens, q, sampling, round_index, with_hidden, side_layers=side_layers
        )
        outcome = self.verify_batch([call])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def verify_batch(self, calls: list[VerifyCall]) -> list[VerifyOutcome | Exception]:
        """Verifies many sessions' rounds, one pass per wave of distinct caches.

        Each call gets its outcome, or the error that call alone caused (a bad field, a lost cache);
        one session's bad request never fails the others.
        """
        self._switch_when_compiled()
        results: list[VerifyOutcome | Exception | None] = [None] * len(calls)
        for wave in waves(calls):
            prepared = []
            for i in wave:
                try:
                    prepared.append(self._prepare(i, calls[i]))
                except Exception as exc:  # noqa: BLE001 - the error belongs to this call alone
                    results[i] = exc
            if prepared:
                try:
                    for i, outcome in self._run_pass(prepared):
                        results[i] = outcome
                except Exception as exc:  # noqa: BLE001 - a failed pass fails only its own calls
                    for item in prepared:
                        item.cache.drop_unrecorded_kv()
                        results[item.index] = exc
                    continue
                for item in prepared:
                    if item.feeds_prompt:
                        # A deferred prompt's KV arrived with this pass: the budget check its prefill skipped.
                        try:
                            self._caches.fit_budget(item.call.cache_id)
                        except CacheBudgetExceeded as exc:
                            results[item.index] = exc
        return results  # type: ignore[return-value]

    def _prepare(self, index: int, call: VerifyCall) -> _Prepared:
        """Checks a call's fields and syncs its cache to the committed tokens it names."""
        check_side_layers(call.side_layers, self._loaded.model.config.num_hidden_layers)
        if call.feed_rows:
            return self._prepare_feed(index, call)
        self._check_tokens(call.draft_tokens, "draft_tokens")
        self._check_tokens([t for t, _ in call.sampling.logit_bias], "sampling.logit_bias")
        reach = len(call.draft_tokens)
        if call.draft_parents:
            if len(call.draft_parents) != len(call.draft_tokens):
                raise ValueError(
                    f"draft_parents: one parent per draft token ({len(call.draft_tokens)}), "
                    f"got {len(call.draft_parents)}"
                )
            check_parents(call.draft_parents, MAX_TREE_NODES)
            if call.tree is not None and not self._ragged:
                raise ValueError("draft_parents: this target verifies chains only (its model has no ragged pass)")
            reach = max(depths(call.draft_parents), default=0)
        elif len(call.draft_tokens) > MAX_K:
            raise ValueError(f"draft_tokens: at most {MAX_K} per round, got {len(call.draft_tokens)}")
        if call.top_logprobs is not None and not 0 <= call.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs: must lie in [0, {MAX_TOP_LOGPROBS}]")
        if not call.sampling.greedy:
            if len(call.q) != len(call.draft_tokens):
                raise ValueError(
                    f"q: sampled verification needs one q per draft token ({len(call.draft_tokens)}), got {len(call.q)}"
                )
            for dist in call.q:
                self._check_tokens(dist.token_ids, "q.token_ids")
                if len(dist.probs) != len(dist.token_ids) or any(not 0.0 <= x <= 1.0 for x in dist.probs):
                    raise ValueError("q.probs: need one probability in [0, 1] per token id")
        cache = self._synced(call)
        if call.sampling.constrained:
            # The grammar's state at the committed tokens: what this round's masks start from.
            cache.grammar = grammar_at(cache.grammar, self.grammar_compiler(), call.sampling, cache.committed)
        if len(cache.committed) + reach >= self._loaded.max_context:
            raise ValueError(f"draft_tokens: the round would exceed the context of {self._loaded.max_context}")
        return _Prepared(index, call, cache, cache.pending() + list(call.draft_tokens))

    def _prepare_feed(self, index: int, call: VerifyCall) -> _Prepared:
        """A prompt chunk: the next ``feed_rows`` pending tokens (after the sync it may carry), leaving
        the last one for a round."""
        if not self._ragged:
            raise ValueError("feed_rows: this target feeds a prompt in one pass (no ragged batching)")
        cache = self._synced(call) if call.new_tokens else self._caches.get(call.cache_id)
        pending = cache.pending()
        if not 0 < call.feed_rows < len(pending):
            raise ValueError(f"feed_rows: {call.feed_rows} rows of a prompt with {len(pending)} pending tokens")
        return _Prepared(index, call, cache, pending[: call.feed_rows])

    def _synced(self, call: VerifyCall) -> SessionCache:
        """The call's cache, synced to the committed tokens it names (see ``SessionCache.sync``)."""
        self._check_tokens(call.new_tokens, "sync.tokens")
        cache = self._caches.get(call.cache_id)
        cache.sync(call.start, call.new_tokens, call.fence)
        return cache

    def _run_pass(self, batch: list[_Prepared]) -> list[tuple[int, VerifyOutcome | Exception]]:
        """One forward pass over every prepared call, then each call's acceptance decision (or the
        error deciding it raised)."""
        model = self._loaded.model
        t0 = time.perf_counter()
        # A lone session takes the ragged path too: its plain layer loop skips transformers' generic
        # per-call work (mask building, cache objects, output classes) for bit-identical logits, and
        # measured 85 against 95 ms for a one-token pass of the default target on 2 cores.
        if self._ragged:
            logits, hidden = self.forward(
                [
                    RaggedItem(
                        p.cache.kv,
                        p.fed,
                        0 if p.call.feed_rows else len(p.call.draft_tokens) + 1,
                        p.call.side_layers if p.call.with_hidden else (),
                        p.call.tree,
                    )
                    for p in batch
                ],
            )
            for p in batch:
                p.cache.kv_tokens.extend(p.fed)
            starts = [len(p.cache.kv_tokens) - len(p.fed) for p in batch]
        else:
            logits, hidden, starts = [], [], []
            for p in batch:
                keep = len(p.call.draft_tokens) + 1
                if p.call.with_hidden:
                    item_logits, rows = p.cache.forward_with_hidden(
                        model, p.call.draft_tokens, keep, p.call.side_layers
                    )
                    hidden.append(rows.rows)
                    starts.append(rows.start)
                else:
                    item_logits = p.cache.forward(model, p.call.draft_tokens, keep)  # [k + 1, V]
                    hidden.append(None)
                    starts.append(0)
                logits.append(item_logits)
        hidden = [None if rows is None else wire_ready(rows) for rows in hidden]
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)  # the pass's kernels run asynchronously: time all of them
        pass_ms = (time.perf_counter() - t0) * 1000
        rows = sum(len(p.fed) for p in batch)
        # A pass that also fed a deferred prompt is a prefill's cost, not a verify's: the curve the
        # coordinators price draft rows with keeps only passes of one pending token per session.
        if not any(p.feeds_prompt for p in batch):
            self._costs.record(rows, pass_ms, warmup=self._warming)
        rounds = sum(not p.call.feed_rows for p in batch)
        round_rows = sum(len(p.call.draft_tokens) + 1 for p in batch if not p.call.feed_rows)
        self.passes += 1
        self.verified += rounds
        self.largest_pass = max(self.largest_pass, rounds)
        self.pass_seconds += pass_ms / 1000
        self.round_rows += round_rows
        self.prompt_rows += rows - round_rows

        outcomes = []
        for p, item_logits, item_hidden, start in zip(batch, logits, hidden, starts):
            call, cache = p.call, p.cache
            if call.feed_rows:
                rows_out = HiddenRows(start, item_hidden) if call.with_hidden else None
                outcomes.append((p, VerifyOutcome(0, [], len(cache.committed), rows_out)))
                continue
            try:
                grammar = cache.grammar.matcher if call.sampling.constrained else None
                verdict = self._verdict(call, item_logits, cache.committed, grammar)
            except Exception as exc:  # noqa: BLE001 - one session's verdict never fails the others in its pass
                cache.trim()  # the draft rows this pass cached follow no committed token
                outcomes.append((p, exc))
                continue
            path = verdict.path if isinstance(verdict, TreeVerdict) else None
            logprobs = None
            if call.top_logprobs is not None:
                # Committed token j came from row j of a chain; from the root's row, then each accepted
                # node's row, of a tree.
                scored = list(range(len(verdict.tokens))) if path is None else [0, *(node + 1 for node in path)]
                logprobs = token_logprobs(item_logits[scored], verdict.tokens, call.top_logprobs)
            if path is not None:
                # Only the accepted path's entries follow committed tokens: move them behind the chain rows.
                lead = len(p.fed) - len(call.draft_tokens)
                cache.keep_path(start, lead, path, verdict.tokens[: len(path)])
                if item_hidden is not None:
                    item_hidden = item_hidden[list(range(lead)) + [lead + node for node in path]]
            cache.committed.extend(verdict.tokens)
            cache.trim()
            if call.sampling.constrained:
                try:
                    cache.grammar.advance(verdict.tokens)
                except ValueError:
                    cache.grammar = None  # rebuilt from the committed output at the next call, which names it
            rows_out = None
            if call.with_hidden:  # keep fed positions that were committed; the newest token is fed next round
                rows_out = HiddenRows(start, item_hidden[: len(cache.committed) - 1 - start])
            outcomes.append(
                (
                    p,
                    VerifyOutcome(
                        verdict.accepted, verdict.tokens, len(cache.committed), rows_out, path=path, logprobs=logprobs
                    ),
                )
            )
        committed_all = sum(len(o.tokens) for _, o in outcomes if not isinstance(o, Exception))
        alone = self._costs.curve(0, self._curve_rows)
        return [
            (
                p.index,
                o
                if isinstance(o, Exception)
                else replace(
                    o,
                    load=PassLoad(
                        sessions=len(batch),
                        rows=rows,
                        others_committed=committed_all - len(o.tokens),
                        pass_ms=pass_ms,
                        curve_ms=self._costs.curve(rows - len(p.fed), self._curve_rows),
                        alone_ms=alone,
                        fed_rows=len(p.fed),
                    ),
                ),
            )
            for p, o in outcomes
        ]

    def _verdict(
        self, call: VerifyCall, logits: torch.Tensor, committed: list[int], grammar: GrammarMatcher | None = None
    ) -> Verdict | TreeVerdict:
        """The round's acceptance decision over its chain or tree, after ``committed`` (whose length is
        the sequence position of the root's children).

        A penalised request's rows are penalised first, each by the committed tokens and the draft
        tokens on its own path (``specdec.sampling.penalize_logits``): greedy then takes their argmax,
        sampling warps them. The draft transformed its q the same way. A constrained request's rows are
        then masked by ``grammar`` (its state at ``committed``), each by the mask after its own path
        (``specdec.constrain.mask_logits``): every rule below sees the constrained p."""
        tree = call.tree
        position = len(committed)
        if call.sampling.penalized:
            paths = chain_paths(call.draft_tokens) if tree is None else node_paths(call.draft_tokens, tree)
            logits = penalize_logits(logits, call.sampling, committed, paths)  # [k + 1, V] or [n + 1, V]
        if grammar is not None:
            masks = (
                grammar.masks_along(call.draft_tokens)
                if tree is None
                else grammar.masks_for_tree(call.draft_tokens, tree)
            )  # [k + 1, V] or [n + 1, V]
            logits = mask_logits(logits, masks)
        if tree is None:
            if call.sampling.greedy:
                return verify_greedy(logits, call.draft_tokens)
            return self._verify_sampled(logits, call.draft_tokens, call.q, call.sampling, call.round_index, position)
        if call.sampling.greedy:
            return verify_tree_greedy(logits, call.draft_tokens, tree)
        p = warp_probs(logits.cpu(), call.sampling)  # [n + 1, V]
        if call.sampling.coupled:
            return verify_tree_coupled(p, call.draft_tokens, tree, call.sampling.seed, position)
        q = torch.stack([sparse_to_dense(d.token_ids, d.probs, logits.shape[-1]) for d in call.q])  # [n, V]
        generator = round_generator(call.sampling.seed, call.round_index, TARGET_STREAM)
        return verify_tree_sampled(p, q, call.draft_tokens, tree, generator)

    def _verify_sampled(
        self,
        logits: torch.Tensor,
        draft_tokens: list[int],
        q: list[SparseQ],
        sampling: Sampling,
        round_index: int,
        position: int,
    ) -> Verdict:
        """``position``: the sequence position of the first draft token (coupled sampling's noise)."""
        vocab = logits.shape[-1]
        # The draws come from a CPU generator (the same numbers on every device), so p joins them there.
        p = warp_probs(logits.cpu(), sampling)  # [k + 1, V]
        if sampling.coupled:
            return verify_coupled(p, draft_tokens, sampling.seed, position)
        q_dense = torch.stack([sparse_to_dense(d.token_ids, d.probs, vocab) for d in q]) if q else p[:0]  # [k, V]
        generator = round_generator(sampling.seed, round_index, TARGET_STREAM)
        return verify_sampled(p, q_dense, draft_tokens, generator)

    def release(self, cache_id: str) -> bool:
        """Drops a session cache."""
        return self._caches.release(cache_id)

    def warmup_sizes(self, sizes: tuple[int, ...] = WARMUP_ROWS) -> tuple[int, ...]:
        """The pass sizes of ``sizes`` this engine can run as one pass, smallest first."""
        fitting = []
        for rows in sizes:
            sessions = -(-rows // 3)
            if sessions > 1 and not self._ragged or sessions > self._caches.capacity:
                break
            fitting.append(rows)
        return tuple(fitting)

    def warmup(self, sizes: tuple[int, ...] | None = None) -> None:
        """Runs a prefill and passes of several sizes (by default every one of WARMUP_ROWS that fits),
        so the first real request pays no start-up costs and the pass-cost curve starts from
        measurements rather than guesses (until serving measures its own: ``PassCosts``)."""
        self._warming = True
        try:
            self._warmup_passes(sizes)
        finally:
            self._warming = False
        self._reset_totals()

    def _warmup_passes(self, sizes: tuple[int, ...] | None) -> None:
        cache_id, committed, _ = self.prefill([0, 1, 2, 3], with_hidden=True)
        self.verify(cache_id, committed, [], [4, 5], [], Sampling(), 0, with_hidden=True)
        self.release(cache_id)
        sizes = self.warmup_sizes() if sizes is None else sizes
        # Sessions of up to 3 rows each (one pending token + 2 drafts), the shape of a loaded batch.
        # One set of caches serves every size: each pass grows them by a token or three, which costs
        # nothing measurable, while a prefill per session per pass made warm-up minutes long on slow
        # (tensor-parallel) targets.
        prompt = [0, 1, 2, 3]
        ids = [
            self.prefill(prompt, defer=self._ragged)[0]
            for _ in range(max((-(-rows // 3) for rows in sizes), default=0))
        ]
        if self._ragged and ids:  # their prompts fed together, as folded prompts are, not a pass each
            self.verify_batch([VerifyCall(i, len(prompt), [], [], [], Sampling(), 0) for i in ids])
        # One pass per size: a shape's first pass costs what its later ones do (default target, 2 cores:
        # 88 against 93 ms at 1 row, 408 against 439 ms at 64), so a second pass only doubled warm-up.
        for rows in sizes:
            per_session = [min(3, rows - i) for i in range(0, rows, 3)]
            calls = [
                VerifyCall(i, len(self._caches.get(i).committed), [], [4] * (n - 1), [], Sampling(), 0)
                for i, n in zip(ids, per_session)
            ]
            self.verify_batch(calls)
        for i in ids:
            self.release(i)
