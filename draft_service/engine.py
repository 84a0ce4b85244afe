"""The draft's core: keep session caches in step with the committed tokens and propose k tokens.

Two drafters share one interface: ``ModelDrafter`` (a small causal LM that shares the target's
tokenizer) and ``NgramDrafter`` (prompt lookup). No gRPC here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draft_service.ngram import propose_ngram
from specdec.kvcache import CacheTable, SessionCache
from specdec.models import LoadedModel, ModelFacts
from specdec.sampling import Sampling, dense_to_sparse, round_generator, warp_probs

DRAFT_STREAM = 1


@dataclass(frozen=True)
class Proposal:
    """Proposed tokens; for sampled requests, ``q[i]`` is the sparse distribution token i was drawn from."""

    tokens: list[int]
    q: list[tuple[list[int], list[float]]]
    committed: int


class DraftEngine:
    """Session caches plus a drafting rule; subclasses implement ``_draft``."""

    kind = "draft"

    def __init__(self, facts: ModelFacts, max_sessions: int) -> None:
        self._facts = facts
        self._caches = CacheTable(max_sessions)

    @property
    def facts(self) -> ModelFacts:
        """The model facts this service reports."""
        return self._facts

    def _check_tokens(self, tokens: list[int], what: str) -> None:
        vocab = self._facts.vocab_size
        if any(t < 0 or t >= vocab for t in tokens):
            raise ValueError(f"{what}: token ids must lie in [0, {vocab})")

    def prefill(self, tokens: list[int]) -> tuple[str, int]:
        """Creates a session cache over ``tokens``; returns its id and committed length."""
        if not tokens:
            raise ValueError("tokens: prefill needs at least one token")
        self._check_tokens(tokens, "tokens")
        cache_id, cache = self._caches.create(tokens)
        self._prefill(cache)
        return cache_id, len(cache.committed)

    def propose(
        self, cache_id: str, start: int, new_tokens: list[int], k: int, sampling: Sampling, round_index: int
    ) -> Proposal:
        """Syncs the cache with the committed tokens, then proposes up to ``k`` tokens."""
        self._check_tokens(new_tokens, "sync.tokens")
        cache = self._caches.get(cache_id)
        cache.sync(start, new_tokens)
        k = min(k, self._facts.max_context - len(cache.committed) - 1)
        if k <= 0:
            return Proposal([], [], len(cache.committed))
        tokens, q = self._draft(cache, k, sampling, round_index)
        return Proposal(tokens, q, len(cache.committed))

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

    def _draft(
        self, cache: SessionCache, k: int, sampling: Sampling, round_index: int
    ) -> tuple[list[int], list[tuple[list[int], list[float]]]]:
        raise NotImplementedError


class NgramDrafter(DraftEngine):
    """Model-free prompt-lookup drafting; q is a point mass on each proposed token."""

    kind = "ngram"

    def __init__(self, facts: ModelFacts, max_sessions: int, max_n: int, min_n: int) -> None:
        super().__init__(facts, max_sessions)
        self._max_n = max_n
        self._min_n = min_n

    def _draft(self, cache, k, sampling, round_index):
        tokens = propose_ngram(cache.committed, k, self._max_n, self._min_n)
        q = [] if sampling.greedy else [([t], [1.0]) for t in tokens]
        return tokens, q


class ModelDrafter(DraftEngine):
    """A small causal LM proposes k tokens autoregressively, one cached forward step each."""

    kind = "model"

    def __init__(self, loaded: LoadedModel, max_sessions: int, sample_top_k: int) -> None:
        super().__init__(loaded.facts("model"), max_sessions)
        self._loaded = loaded
        self._sample_top_k = sample_top_k

    def _prefill(self, cache: SessionCache) -> None:
        cache.prefill(self._loaded.model)

    def _draft(self, cache, k, sampling, round_index):
        model = self._loaded.model
        generator = None if sampling.greedy else round_generator(sampling.seed, round_index, DRAFT_STREAM)
        tokens: list[int] = []
        q: list[tuple[list[int], list[float]]] = []
        logits = cache.forward(model, [], logits_to_keep=1)  # [1, V]
        for i in range(k):
            if generator is None:
                token = int(logits[0].argmax())
            else:
                probs = warp_probs(logits, sampling, extra_top_k=self._sample_top_k)[0]  # [V]
                token = int(torch.multinomial(probs, 1, generator=generator))
                q.append(dense_to_sparse(probs))
            tokens.append(token)
            if i + 1 < k:
                logits = cache.forward(model, [token], logits_to_keep=1)  # [1, V]
        return tokens, q
