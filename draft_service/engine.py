"""The draft's core: keep session caches in step with the committed tokens and propose k tokens.

Three drafters share one interface: ``ModelDrafter`` (a small causal LM that shares the target's
tokenizer), ``FeatureDrafter`` (EAGLE-style, from the target's hidden states) and ``NgramDrafter``
(prompt lookup). No gRPC here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from draft_service.feature_draft import KIND as FEATURE_KIND
from draft_service.feature_draft import AheadDraft, DraftTail, FeatureDraft, FeatureSession, on_host
from draft_service.model_trees import grow_model_trees, grows_ragged_trees
from draft_service.picking import TokenPicker, take_next
from draft_service.tree_draft import TREE_BEAM, TreeGrower, TreeRows, grow_level, level_layout
from specdec.batching import waves
from specdec.config import MAX_K
from specdec.constrain import grammar_at
from specdec.grammar import GrammarCompiler, GrammarMatcher, compiler_for
from specdec.kvcache import CacheTable, HiddenRows, SessionCache, fit_fork
from specdec.models import LoadedModel
from specdec.ngram import LOOKUP_MAX_N, lookup_tree, propose_ngram, whole_continuation
from specdec.ragged import RaggedLayout
from specdec.sampling import Sampling, ranked_top
from specdec.trees import TreeShape
from specdec.vocab import ModelFacts


def point_tree(tokens: list[int], grower: TreeGrower, max_n: int, min_n: int) -> tuple[list[int], list, tuple]:
    """The lookup tree (``specdec.ngram.lookup_tree``) for a grower's shape and sampling: tokens, q (a
    point mass on each node for sampled requests) and parents."""
    shape = grower.shape
    found, parents = lookup_tree(tokens, shape.nodes, shape.depth, shape.width, max_n, min_n)
    return found, ([] if grower.sampling.greedy else [([t], [1.0]) for t in found]), parents


@dataclass(frozen=True)
class ProposeCall:
    """One session's proposal request, as the engine takes it."""

    cache_id: str
    start: int
    new_tokens: list[int]
    k: int
    sampling: Sampling
    round_index: int
    hidden: HiddenRows | None = None
    # The caller's fencing token (see SessionCache.sync).
    fence: int = 0
    # Confidence cut-off (see ``draft_service.picking``); 0 proposes all k tokens.
    min_confidence: float = 0.0
    # Tokens to draft ahead after the reply (``draft_ahead``); 0: none.
    ahead: int = 0
    # Propose a token tree of this shape instead of a chain of k (``draft_service.tree_draft``).
    tree: TreeShape | None = None


@dataclass(frozen=True)
class Proposal:
    """Proposed tokens; for sampled requests, ``q[i]`` is the sparse distribution token i was drawn from."""

    tokens: list[int]
    q: list[tuple[list[int], list[float]]]
    committed: int
    # Drafted ahead, while the target verified the previous round (``draft_ahead``).
    from_ahead: bool = False
    # Prompt lookup answered in place of the draft model (a feature draft's lookup first): what the
    # call cost says nothing of what the model's drafting costs.
    looked_up: bool = False
    # A tree proposal: each token's parent (``specdec.trees``); empty for a chain.
    parents: tuple[int, ...] = ()


class DraftEngine:
    """Session caches plus a drafting rule; subclasses implement ``_draft``."""

    kind = "draft"
    # Whether it proposes token trees (``ProposeCall.tree``); one that does not answers with a chain.
    trees = True
    # Width of the target hidden states the drafter reads; None: it reads none.
    hidden_size: int | None = None
    # A sampled draft narrows its q to its top this many tokens (0: no narrowing).
    _sample_top_k: int = 0
    # The tokenizer a constrained request's grammar is compiled for; None: proposals are not masked,
    # which costs acceptance, never exactness (q is still what the draft drew from). Lookup drafts
    # leave it unset.
    grammar_tokenizer: object | None = None
    _grammars: GrammarCompiler | None = None

    def __init__(
        self,
        facts: ModelFacts,
        max_sessions: int,
        cache_factory=SessionCache,
        *,
        budget_bytes: int = 0,
        idle_s: float = 0.0,
        reuse_min: int = 0,
    ) -> None:
        """``max_sessions``, ``budget_bytes`` and ``idle_s`` bound the session caches, ``reuse_min`` sets
        their prefix reuse (see CacheTable)."""
        self._facts = facts
        self._caches = CacheTable(
            max_sessions, factory=cache_factory, budget_bytes=budget_bytes, idle_s=idle_s, reuse_min=reuse_min
        )

    @property
    def facts(self) -> ModelFacts:
        """The model facts this service reports."""
        return replace(self._facts, trees=self.trees)

    @property
    def caches(self) -> CacheTable:
        """The session caches; the metrics scrape reads their count and size from another thread."""
        return self._caches

    def _check_tokens(self, tokens: list[int], what: str) -> None:
        vocab = self._facts.vocab_size
        if any(t < 0 or t >= vocab for t in tokens):
            raise ValueError(f"{what}: token ids must lie in [0, {vocab})")

    def prefill(self, tokens: list[int], fence: int = 0) -> tuple[str, int]:
        """Creates a session cache over ``tokens`` for a caller with fencing token ``fence``; returns
        its id and committed length."""
        self._check_prefill(tokens)
        cache_id, cache = self._caches.create(tokens, fence)
        self._prefill(cache)
        self._caches.fit_budget(cache_id)
        return cache_id, len(cache.committed)

    def fork(self, source_id: str, tokens: list[int], fence: int = 0) -> tuple[str, int, int]:
        """Creates a session cache over ``tokens`` that copies the state of cache ``source_id`` where
        its tokens match (KV entries; a feature draft's features and KV pairs), then builds what the copy
        lacks as a prefill would; returns its id, committed length and the positions copied. An unknown
        source is CacheNotFound; past the KV budget while the other caches are in use, CacheBudgetExceeded."""
        self._check_prefill(tokens)
        cache_id, cache = self._caches.fork(source_id, tokens, fence)
        copied = cache.copied_end
        self._prefill(cache)
        fit_fork(self._caches, cache_id, source_id)
        return cache_id, len(cache.committed), copied

    def _check_prefill(self, tokens: list[int]) -> None:
        """Refuses a prompt that is empty, names a token outside the vocabulary or fills the context."""
        if not tokens:
            raise ValueError("tokens: prefill needs at least one token")
        self._check_tokens(tokens, "tokens")
        if len(tokens) >= self._facts.max_context:
            raise ValueError(f"tokens: {len(tokens)} tokens exceed the context of {self._facts.max_context}")

    def propose(
        self,
        cache_id: str,
        start: int,
        new_tokens: list[int],
        k: int,
        sampling: Sampling,
        round_index: int,
        hidden: HiddenRows | None = None,
        min_confidence: float = 0.0,
    ) -> Proposal:
        """Syncs the cache with the committed tokens (and, for a feature draft, the target's hidden
        states), then proposes up to ``k`` tokens, fewer where the draft's confidence falls below
        ``min_confidence``."""
        call = ProposeCall(cache_id, start, new_tokens, k, sampling, round_index, hidden, min_confidence=min_confidence)
        outcome = self.propose_batch([call])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def propose_batch(self, calls: list[ProposeCall]) -> list[Proposal | Exception]:
        """Proposes for many sessions; each call gets its proposal or the error it alone caused.

        Drafters that can batch (``FeatureDrafter``) override ``_draft_many``; the rest draft one
        session after another.
        """
        results: list[Proposal | Exception | None] = [None] * len(calls)
        for wave in waves(calls):
            jobs = []
            for i in wave:
                try:
                    cache, k = self._sync(calls[i])
                except Exception as exc:  # noqa: BLE001 - the error belongs to this call alone
                    results[i] = exc
                    continue
                tree = calls[i].tree if self.trees else None
                ready = None if tree is not None else self._drafted_ahead(cache, calls[i], k)
                if ready is not None:
                    results[i] = ready
                elif k <= 0 and tree is None:
                    results[i] = Proposal([], [], len(cache.committed))
                else:
                    jobs.append((i, cache, k, tree))
            chains = [(i, c, k) for i, c, k, tree in jobs if tree is None]
            trees = [(i, c, tree) for i, c, _, tree in jobs if tree is not None]
            try:
                drafted = self._draft_many([(c, k, self._picker(calls[i], c)) for i, c, k in chains])
                drafted = [(*out, ()) if not isinstance(out, Exception) else out for out in drafted]
            except Exception as exc:  # noqa: BLE001 - a failed pass fails only its own calls
                drafted = [exc] * len(chains)
            try:
                grown = self._draft_trees([(c, self._grower(calls[i], c, tree)) for i, c, tree in trees])
            except Exception as exc:  # noqa: BLE001 - a failed pass fails only its own calls
                grown = [exc] * len(trees)
            for (i, cache, *_), outcome in zip(chains + trees, drafted + grown):
                if isinstance(outcome, Exception):
                    results[i] = outcome
                else:
                    tokens, q, looked_up, parents = outcome
                    results[i] = Proposal(tokens, q, len(cache.committed), looked_up=looked_up, parents=parents)
        return results  # type: ignore[return-value]

    def _grower(self, call: ProposeCall, cache, tree: TreeShape) -> TreeGrower:
        """The tree ``call`` asks for, to grow (``draft_service.tree_draft``)."""
        position = call.start + len(call.new_tokens)
        return TreeGrower(
            tree,
            call.sampling,
            call.round_index,
            position,
            self.tree_beam,
            self._sample_top_k,
            committed=cache.committed,
            grammar=self._grammar(call, cache),
        )

    def _grammar(self, call: ProposeCall, cache) -> GrammarMatcher | None:
        """A constrained call's grammar state after the committed tokens, as a copy its picker or tree
        may advance (``_sync`` brought the session's state there); None where nothing is masked."""
        if not call.sampling.constrained or cache.grammar is None:
            return None
        return cache.grammar.matcher.fork()

    # Nodes a level of the tree expands (``TreeGrower.beam``): 1 for drafters that feed one path.
    tree_beam = 1

    def _draft_trees(self, jobs: list[tuple]) -> list:
        """Grows trees for ``(cache, grower)`` jobs: ``(tokens, q, looked_up, parents)`` or an error each.

        The base rule feeds one path (beam 1) with ``_tree_logits``; drafters that batch override it."""
        out: list = []
        for cache, grower in jobs:
            try:
                out.append(self._grow_one(cache, grower))
            except Exception as exc:  # noqa: BLE001 - the error belongs to this call alone
                out.append(exc)
        return out

    def _grow_one(self, cache, grower: TreeGrower) -> tuple:
        """One tree along one path: the root's logits, then each frontier node's (``_tree_logits``)."""
        grower.grow(-1, self._tree_logits(cache, None))
        while frontier := grower.frontier():
            node = frontier[0]
            grower.grow(node, self._tree_logits(cache, grower.nodes[node].token))
        tokens, parents, qs = grower.result()
        self._after_tree(cache)
        return tokens, qs, False, parents

    def _tree_logits(self, cache, token: int | None) -> torch.Tensor:
        """The draft's logits ``[V]`` after feeding ``token`` (None: the pending committed tokens)."""
        raise NotImplementedError

    def _after_tree(self, cache) -> None:
        """Hook: drops what growing a tree left in the cache that no committed token follows."""

    def _picker(self, call: ProposeCall, cache) -> TokenPicker:
        """How this call's tokens are picked (after ``cache``'s committed tokens), and when its proposal stops."""
        return TokenPicker(
            call.sampling,
            call.round_index,
            self._sample_top_k,
            call.min_confidence,
            position=call.start + len(call.new_tokens),
            committed=cache.committed,
            grammar=self._grammar(call, cache),
        )

    def _sync(self, call: ProposeCall):
        """Checks a call, syncs its cache (and hidden states); returns the cache and the k it allows."""
        self._check_tokens(call.new_tokens, "sync.tokens")
        self._check_tokens([t for t, _ in call.sampling.logit_bias], "sampling.logit_bias")
        if not 0.0 <= call.min_confidence <= 1.0:
            raise ValueError("min_confidence: must lie in [0, 1]")
        # Drafting is sequential on the model's one thread: an unbounded k or ahead would hold it for good.
        if not 0 <= call.k <= MAX_K:
            raise ValueError(f"k: must lie in [0, {MAX_K}]")
        if not 0 <= call.ahead <= MAX_K:
            raise ValueError(f"ahead: must lie in [0, {MAX_K}]")
        if call.tree is not None:
            call.tree.check()
        cache = self._caches.get(call.cache_id)
        cache.sync(call.start, call.new_tokens, call.fence)
        if call.sampling.constrained and self.grammar_tokenizer is not None:
            if self._grammars is None:  # built once: reading a 49k vocabulary takes about a second
                facts = self._facts
                self._grammars = compiler_for(self.grammar_tokenizer, facts.vocab_size, facts.eos_token_ids)
            cache.grammar = grammar_at(cache.grammar, self._grammars, call.sampling, cache.committed)
        if call.hidden is not None:
            self._take_hidden(cache, call.hidden)
        return cache, min(call.k, self._facts.max_context - len(cache.committed) - 1)

    def _drafted_ahead(self, cache, call: ProposeCall, k: int) -> Proposal | None:
        """Hook, right after ``call``'s sync: the proposal drafted ahead for exactly the tokens now
        committed, if any (a feature draft's; see ``draft_ahead``)."""
        return None

    def draft_ahead(self, call: ProposeCall) -> int:
        """Goes on drafting past the proposal just made for ``call``, while the target verifies it;
        returns how many tokens it drafted ahead. Only a feature draft does (0 here)."""
        return 0

    def _draft_many(self, jobs: list) -> list:
        """Drafts for ``(cache, k, pick)`` jobs: ``(tokens, q, looked_up)`` or an error each."""
        out = []
        for cache, k, pick in jobs:
            try:
                out.append((*self._draft(cache, k, pick), False))
            except Exception as exc:  # noqa: BLE001 - the error belongs to this call alone
                out.append(exc)
        return out

    def release(self, cache_id: str) -> bool:
        """Drops a session cache."""
        return self._caches.release(cache_id)

    def warmup(self) -> None:
        """Runs one prefill and proposal so the first real request pays no start-up costs."""
        cache_id, committed = self.prefill([0, 1, 2, 0, 1])
        self.propose(cache_id, committed, [], 2, Sampling(), 0)
        self.release(cache_id)

    def _prefill(self, cache: SessionCache) -> None:
        """Hook: builds whatever state a new cache needs."""

    def _take_hidden(self, cache, hidden: HiddenRows) -> None:
        """Hook: a feature draft stores the target's hidden states; other drafts ignore them."""

    def _draft(
        self, cache: SessionCache, k: int, pick: TokenPicker
    ) -> tuple[list[int], list[tuple[list[int], list[float]]]]:
        raise NotImplementedError


class NgramDrafter(DraftEngine):
    """Model-free prompt-lookup drafting; q is a point mass on each proposed token."""

    kind = "ngram"

    def __init__(self, facts: ModelFacts, max_sessions: int, max_n: int, min_n: int, **limits) -> None:
        super().__init__(facts, max_sessions, **limits)
        self._max_n = max_n
        self._min_n = min_n

    def _draft(self, cache, k, pick):
        tokens = propose_ngram(cache.committed, k, self._max_n, self._min_n)
        q = [] if pick.sampling.greedy else [([t], [1.0]) for t in tokens]
        return tokens, q

    def _draft_trees(self, jobs):
        """Every continuation the lookup finds is a branch (q: a point mass on each, exact)."""
        out = []
        for cache, grower in jobs:
            tokens, q, parents = point_tree(cache.committed, grower, self._max_n, self._min_n)
            out.append((tokens, q, False, parents))
        return out


class ModelDrafter(DraftEngine):
    """A small causal LM proposes k tokens autoregressively, one cached forward step each."""

    kind = "model"

    def __init__(self, loaded: LoadedModel, max_sessions: int, sample_top_k: int, tree_beam: int = 1, **limits) -> None:
        super().__init__(loaded.facts("model"), max_sessions, **limits)
        self._loaded = loaded
        self._sample_top_k = sample_top_k
        self.grammar_tokenizer = loaded.tokenizer
        # Where the model runs ragged, every session's tree level is one pass (``draft_service.model_trees``)
        # and may expand ``tree_beam`` nodes; otherwise trees grow along one path, a session at a time.
        # One path is the default: on the development CPU the shipped token draft's wider levels
        # cost more draft time than their extra nodes gained.
        self._ragged_trees = grows_ragged_trees(loaded.model)
        self.tree_beam = tree_beam if self._ragged_trees else 1

    def _draft_trees(self, jobs):
        if not self._ragged_trees:
            return super()._draft_trees(jobs)
        return grow_model_trees(self._loaded.model, jobs)

    def _prefill(self, cache: SessionCache) -> None:
        cache.prefill(self._loaded.model)

    def _tree_logits(self, cache, token):
        extra = [] if token is None else [token]
        return on_host(cache.forward(self._loaded.model, extra, logits_to_keep=1))[0]  # [V]

    def _after_tree(self, cache) -> None:
        cache.trim()  # the path's entries follow no committed token

    def _draft(self, cache, k, pick):
        model = self._loaded.model
        tokens: list[int] = []
        q: list[tuple[list[int], list[float]]] = []
        logits = on_host(cache.forward(model, [], logits_to_keep=1))  # [1, V]
        for i in range(k):
            if not take_next(pick, logits, tokens, q):
                break
            if i + 1 < k:
                logits = on_host(cache.forward(model, [tokens[-1]], logits_to_keep=1))  # [1, V]
        return tokens, q


class FeatureDrafter(DraftEngine):
    """An EAGLE-style draft: it reads the target's hidden states, which arrive with each proposal.

    Prompt lookup goes first when it finds a whole continuation (``lookup_min`` 0 turns it off).
    """

    kind = FEATURE_KIND

    def __init__(
        self,
        draft: FeatureDraft,
        facts: ModelFacts,
        max_sessions: int,
        sample_top_k: int,
        lookup_max: int = LOOKUP_MAX_N,
        lookup_min: int = 2,
        tree_beam: int = TREE_BEAM,
        **limits,
    ) -> None:
        super().__init__(
            replace(facts, kind=FEATURE_KIND, side_layers=draft.arch.side_layers),
            max_sessions,
            FeatureSession,
            **limits,
        )
        self.tree_beam = tree_beam
        self._draft_model = draft
        self._sample_top_k = sample_top_k
        self._lookup_max = lookup_max
        self._lookup_min = lookup_min

    @property
    def hidden_size(self) -> int:
        """Width of the hidden-state rows it reads (the final-norm feature, then any side layers)."""
        return self._draft_model.feature_width

    def warmup(self) -> None:
        cache_id, committed = self.prefill([0, 1, 2, 0, 1])
        rows = torch.zeros(committed - 1, self.hidden_size)  # [n, W] on the host, as rows off the wire are
        self.propose(cache_id, committed, [], 2, Sampling(), 0, HiddenRows(0, rows))
        self.release(cache_id)

    def _take_hidden(self, cache, hidden: HiddenRows) -> None:
        if hidden.rows.shape[1] != self.hidden_size:
            raise ValueError(f"hidden.dim: this draft reads hidden states of width {self.hidden_size}")
        if hidden.start + len(hidden.rows) > len(cache.committed):
            raise ValueError("hidden: rows reach past the committed tokens")
        # [n, W], moved once, in the dtype ``fc`` reads them in (the same numbers, in half the memory
        # of the wire's float32 for a bf16 draft).
        draft = self._draft_model
        cache.add_features(hidden.start, hidden.rows.to(draft.device, draft.dtype))

    def _lookup(self, cache, k, sampling):
        """Prompt lookup's whole k-token continuation, or None."""
        # Text that repeats its own context (summaries, answers quoting a passage, code) is drafted
        # best by prompt lookup: when the context's last n >= lookup_min tokens occurred before and a
        # whole k-token continuation follows, propose that (q: a point mass, exact). On the benchmark
        # prompts this lifted the mean accepted length at k = 4 from 1.53 to 1.93.
        tokens = whole_continuation(cache.committed, k, min_n=self._lookup_min, max_n=self._lookup_max)
        if tokens is None:
            return None
        return tokens, ([] if sampling.greedy else [([t], [1.0]) for t in tokens])

    def _drafted_ahead(self, cache: FeatureSession, call: ProposeCall, k: int) -> Proposal | None:
        ahead, cache.ahead = cache.ahead, None
        # A sync keeps every token before its start: from a start at or past the ahead base, the
        # tokens before it are still those the draft saw, so matching the rest matches the whole.
        if (
            ahead is None
            or k <= 0
            or not ahead.tokens
            or call.start < ahead.base
            or cache.committed[ahead.base :] != ahead.path
        ):
            return None
        return Proposal(ahead.tokens[:k], ahead.q[:k], len(cache.committed), from_ahead=True)

    @torch.inference_mode()
    def draft_ahead(self, call: ProposeCall) -> int:
        """Drafts past the proposal on the guess that the target accepts all of it and then commits
        the draft's likeliest token; the next proposal serves these tokens if the guess holds.

        Why it pays: on separate hosts the draft idles while the target verifies; a hit saves the
        next round its whole draft call. The guess is a point guess, so sampled requests stay exact:
        the ahead tokens are drawn from the q they report, on the guessed path, and only used on it.
        The round's next draft stream is used (round + 1), as the next proposal would.
        """
        cache = self._caches.get(call.cache_id)
        tail, cache.tail = cache.tail, None
        if (
            tail is None
            or call.ahead <= 0
            # A penalised guess would count the proposal and the guess; a plain one only costs acceptance.
            or call.sampling.penalized
            # A guess under a grammar would need the state after the proposal and the guess.
            or call.sampling.constrained
            or len(cache.committed) != tail.base
            or cache.kv.get_seq_length() != tail.kv_length
        ):
            return 0
        draft = self._draft_model
        device = draft.device
        predicted, pending, position = tail.predicted, tail.pending, tail.position
        pick = TokenPicker(call.sampling, call.round_index + 1, self._sample_top_k, call.min_confidence, cut_first=True)
        guess: int | None = None
        tokens: list[int] = []
        qs: list = []
        try:
            while len(tokens) < call.ahead:
                if pending is not None:
                    layout = RaggedLayout.of([1], [cache.kv.get_seq_length()], [position], device=device)
                    predicted = draft.predict_ragged(
                        predicted, torch.tensor([pending], device=device), [cache.kv], layout
                    )  # [1, D]
                    position += 1
                logits = draft.head_rows(predicted)  # [1, N]
                if guess is None:
                    pending = guess = logits.argmax()
                    continue
                if not take_next(pick, logits, tokens, qs):
                    break
                pending = tokens[-1]
        except Exception:
            cache.reset_kv()  # a pass that failed midway leaves its KV unknown
            raise
        cache.ahead = AheadDraft(tail.base, [*tail.proposal, guess], tokens, qs)
        return len(tokens)

    @torch.inference_mode()
    def _draft_many(self, jobs):
        """Sessions without a lookup hit draft together: one ragged pass for every session's catch-up
        pairs, then one per draft position over the sessions still drafting."""
        out: list = [None] * len(jobs)
        model_jobs = []
        for j, (cache, k, pick) in enumerate(jobs):
            found = self._lookup(cache, k, pick.sampling)
            if found is not None:
                out[j] = (*found, True)
            elif not cache.ready():
                out[j] = ([], [], False)
            else:
                model_jobs.append((j, cache, k, pick))
        if model_jobs:
            # A lone session takes the ragged path too: its plain layer loop skips transformers'
            # per-call work, 4.6 against 5.0 ms for a one-token step here, with identical features.
            try:
                drafted = self._draft_together([(c, k, pick) for _, c, k, pick in model_jobs])
            except Exception:
                for _, cache, _, _ in model_jobs:
                    cache.reset_kv()  # a pass that failed midway leaves its KV unknown
                raise
            for (j, *_), (tokens, q) in zip(model_jobs, drafted):
                out[j] = (tokens, q, False)
        return out

    @torch.inference_mode()
    def _draft_trees(self, jobs):
        """Lookup first, as for chains: a whole continuation found makes every continuation a branch.
        The other sessions grow their trees together: one ragged pass for every session's catch-up
        pairs, then one per level over every session's frontier (``_grow_together``)."""
        out: list = [None] * len(jobs)
        model_jobs = []
        for j, (cache, grower) in enumerate(jobs):
            shape = grower.shape
            if whole_continuation(cache.committed, shape.depth, min_n=self._lookup_min, max_n=self._lookup_max):
                tokens, q, parents = point_tree(cache.committed, grower, self._lookup_max, self._lookup_min)
                out[j] = (tokens, q, True, parents)
            elif not cache.ready():
                out[j] = ([], [], False, ())
            else:
                model_jobs.append(j)
        if model_jobs:
            try:
                grown = self._grow_together([jobs[j] for j in model_jobs])
            except Exception:
                for j in model_jobs:
                    jobs[j][0].reset_kv()  # a pass that failed midway leaves its KV unknown
                raise
            for j, result in zip(model_jobs, grown):
                out[j] = result
        return out

    def _grow_together(self, jobs: list) -> list[tuple]:
        """Level-wise tree growth for ``(cache, grower)`` jobs over the draft's KV caches
        (``draft_service.tree_draft.level_layout``). A node is fed as the pair (its parent's predicted
        feature, its token); the next catch-up crops the nodes' rows."""
        draft = self._draft_model
        device = draft.device
        roots, positions = self._catch_up_together([cache for cache, _ in jobs])  # [B, D]
        trees = [
            TreeRows(grower, cache.kv, cache.kv.get_seq_length(), position - 1)
            for (cache, grower), position in zip(jobs, positions)
        ]
        predicted: list[dict[int, torch.Tensor]] = [{-1: roots[b]} for b in range(len(jobs))]
        self._grow_rows(roots, [(grower, -1) for _, grower in jobs])
        while (level := level_layout(trees, device)) is not None:
            layout, ordered = level
            sessions = list(dict.fromkeys(b for b, _ in ordered))
            inputs = torch.stack([predicted[b][trees[b].grower.nodes[node].parent] for b, node in ordered])  # [R, D]
            tokens = torch.tensor([trees[b].grower.nodes[node].token for b, node in ordered], device=device)  # [R]
            out = draft.predict_ragged(inputs, tokens, [trees[b].cache for b in sessions], layout)  # [R, D]
            for r, (b, node) in enumerate(ordered):
                predicted[b][node] = out[r]
            self._grow_rows(out, [(trees[b].grower, node) for b, node in ordered])
        results = []
        for _, grower in jobs:
            tokens, parents, qs = grower.result()
            results.append((tokens, qs, False, parents))
        return results

    def _grow_rows(self, features: torch.Tensor, growing: list[tuple[TreeGrower, int]]) -> None:
        """Adds children to each ``(grower, node)`` from the draft's predicted ``features [R, D]`` (row r:
        after that node). Greedy trees take their top ``width`` on the draft's reduced head: its
        softmax is the full vocabulary's, which is -inf outside the head."""
        draft = self._draft_model

        def top(rows: list[int], width: int) -> tuple[list[list[int]], list[list[float]]]:
            reduced = torch.log_softmax(draft.head_logits(features[rows]).float(), dim=-1)  # [G, H]
            best = ranked_top(reduced, width)  # [G, width]
            return on_host(draft.head_ids[best]).tolist(), on_host(reduced.gather(-1, best).exp()).tolist()

        grow_level(growing, top, lambda rows: on_host(draft.full_logits(features[rows])))  # [S, V]

    def _catch_up_together(self, sessions: list[FeatureSession]) -> tuple[torch.Tensor, list[int]]:
        """One ragged pass over every session's catch-up pairs (``FeatureSession.catch_up``): the
        predicted features ``[B, D]`` after each session's last true pair, and the position each
        session's first draft token is fed at."""
        draft = self._draft_model
        device = draft.device
        catch = [cache.catch_up() for cache in sessions]
        caches = [cache.kv for cache in sessions]
        layout = RaggedLayout.of(
            [len(f) for f, _, _ in catch],
            [kv.get_seq_length() for kv in caches],
            [start for _, _, start in catch],
            device=device,
        )
        feats = torch.cat([f for f, _, _ in catch])  # [N, D]
        toks = torch.tensor([t for _, tokens, _ in catch for t in tokens], device=device)  # [N]
        predicted = draft.predict_ragged(feats, toks, caches, layout)[[b - 1 for b in layout.bounds[1:]]]  # [B, D]
        return predicted, [start + len(f) for f, _, start in catch]

    def _draft_together(self, jobs: list) -> list[tuple[list[int], list]]:
        draft = self._draft_model
        device = draft.device
        caches = [cache.kv for cache, _, _ in jobs]
        predicted, positions = self._catch_up_together([cache for cache, _, _ in jobs])  # [B, D]
        tokens: list[list[int]] = [[] for _ in jobs]
        qs: list[list] = [[] for _ in jobs]
        live = list(range(len(jobs)))
        stopped: set[int] = set()  # jobs whose confidence ran out before k
        while live:
            logits = draft.head_rows(predicted)  # [B', N]
            for row, j in enumerate(live):
                if not take_next(jobs[j][2], logits.row(row), tokens[j], qs[j]):
                    stopped.add(j)
            going = [(row, j) for row, j in enumerate(live) if j not in stopped and len(tokens[j]) < jobs[j][1]]
            for row, j in enumerate(live):
                if j in stopped or len(tokens[j]) >= jobs[j][1]:
                    cache = jobs[j][0]
                    # A stopped job's row already follows its last token; a finished one's gave it.
                    # A view: ``predicted`` is replaced each step, never written in place.
                    cache.tail = DraftTail(
                        len(cache.committed),
                        tokens[j],
                        predicted[row : row + 1],
                        None if j in stopped else tokens[j][-1],
                        positions[j],
                        caches[j].get_seq_length(),
                    )
            if not going:
                break
            live = [j for _, j in going]
            step = RaggedLayout.of(
                [1] * len(live), [caches[j].get_seq_length() for j in live], [positions[j] for j in live], device=device
            )
            predicted = draft.predict_ragged(
                predicted[[row for row, _ in going]],
                torch.tensor([tokens[j][-1] for j in live], device=device),
                [caches[j] for j in live],
                step,
            )  # [B', D]
            for j in live:
                positions[j] += 1
        return list(zip(tokens, qs))
