"""The target's core: sync a session cache, score draft tokens in one pass, and decide acceptance.

No gRPC here; ``target_service.server`` converts messages to these calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.kvcache import CacheTable, HiddenRows
from specdec.models import LoadedModel, ModelFacts
from specdec.sampling import Sampling, Verdict, round_generator, sparse_to_dense, verify_greedy, verify_sampled, warp_probs

TARGET_STREAM = 2
# Most hidden-state rows a prefill returns (2048 x 576 fp16 is 2.4 MB, well inside a message).
PREFILL_HIDDEN_ROWS = 2048


@dataclass(frozen=True)
class SparseQ:
    """A draft distribution restricted to its support."""

    token_ids: list[int]
    probs: list[float]


@dataclass(frozen=True)
class VerifyOutcome:
    """A verified round: what was accepted, the committed tokens, and the cache's committed length."""

    accepted: int
    tokens: list[int]
    committed: int
    hidden: HiddenRows | None = None


class TargetEngine:
    """Verifies draft proposals for many sessions against one target model (one call at a time)."""

    def __init__(self, loaded: LoadedModel, max_sessions: int) -> None:
        self._loaded = loaded
        self._caches = CacheTable(max_sessions)

    @property
    def facts(self) -> ModelFacts:
        """The model facts this service reports."""
        return self._loaded.facts("target")

    @property
    def caches(self) -> CacheTable:
        """The session caches; the metrics scrape reads their count and size from another thread."""
        return self._caches

    def _check_tokens(self, tokens: list[int], what: str) -> None:
        vocab = self._loaded.vocab_size
        if any(t < 0 or t >= vocab for t in tokens):
            raise ValueError(f"{what}: token ids must lie in [0, {vocab})")

    def prefill(self, tokens: list[int], with_hidden: bool = False) -> tuple[str, int, HiddenRows | None]:
        """Creates a session cache over ``tokens``; returns its id, committed length and, when asked,
        the hidden states of the positions it fed."""
        if not tokens:
            raise ValueError("tokens: prefill needs at least one token")
        if len(tokens) >= self._loaded.max_context:
            raise ValueError(f"tokens: {len(tokens)} tokens exceed the context of {self._loaded.max_context}")
        self._check_tokens(tokens, "tokens")
        cache_id, cache = self._caches.create(tokens)
        hidden = cache.prefill(self._loaded.model, with_hidden)
        if hidden is not None and len(hidden.rows) > PREFILL_HIDDEN_ROWS:
            # A long prompt's rows would outgrow a message; the draft attends to the newest ones only.
            cut = len(hidden.rows) - PREFILL_HIDDEN_ROWS
            hidden = HiddenRows(hidden.start + cut, hidden.rows[cut:])
        return cache_id, len(cache.committed), hidden

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
    ) -> VerifyOutcome:
        """Scores ``draft_tokens`` after the committed tokens and commits accepted + 1 tokens.

        With ``with_hidden``, the outcome carries the hidden states of the committed positions fed.
        """
        self._check_tokens(new_tokens, "sync.tokens")
        self._check_tokens(draft_tokens, "draft_tokens")
        if not sampling.greedy:
            if len(q) != len(draft_tokens):
                raise ValueError(f"q: sampled verification needs one q per draft token ({len(draft_tokens)}), got {len(q)}")
            for dist in q:
                self._check_tokens(dist.token_ids, "q.token_ids")
                if len(dist.probs) != len(dist.token_ids) or any(not 0.0 <= x <= 1.0 for x in dist.probs):
                    raise ValueError("q.probs: need one probability in [0, 1] per token id")
        cache = self._caches.get(cache_id)
        cache.sync(start, new_tokens)
        if len(cache.committed) + len(draft_tokens) >= self._loaded.max_context:
            raise ValueError(f"draft_tokens: the round would exceed the context of {self._loaded.max_context}")
        k = len(draft_tokens)
        hidden = None
        if with_hidden:
            logits, hidden = cache.forward_with_hidden(self._loaded.model, draft_tokens, logits_to_keep=k + 1)
        else:
            logits = cache.forward(self._loaded.model, draft_tokens, logits_to_keep=k + 1)  # [k + 1, V]
        if sampling.greedy:
            verdict = verify_greedy(logits, draft_tokens)
        else:
            verdict = self._verify_sampled(logits, draft_tokens, q, sampling, round_index)
        cache.committed.extend(verdict.tokens)
        cache.trim()
        if hidden is not None:  # keep fed positions that were committed; the newest token is fed next round
            hidden = HiddenRows(hidden.start, hidden.rows[: len(cache.committed) - 1 - hidden.start])
        return VerifyOutcome(verdict.accepted, verdict.tokens, len(cache.committed), hidden)

    def _verify_sampled(
        self, logits: torch.Tensor, draft_tokens: list[int], q: list[SparseQ], sampling: Sampling, round_index: int
    ) -> Verdict:
        vocab = logits.shape[-1]
        p = warp_probs(logits, sampling)  # [k + 1, V]
        q_dense = torch.stack([sparse_to_dense(d.token_ids, d.probs, vocab) for d in q]) if q else p[:0]  # [k, V]
        generator = round_generator(sampling.seed, round_index, TARGET_STREAM)
        return verify_sampled(p, q_dense, draft_tokens, generator)

    def release(self, cache_id: str) -> bool:
        """Drops a session cache."""
        return self._caches.release(cache_id)

    def warmup(self) -> None:
        """Runs a prefill and a verify once so the first real request pays no start-up costs."""
        cache_id, committed, _ = self.prefill([0, 1, 2, 3], with_hidden=True)
        self.verify(cache_id, committed, [], [4, 5], [], Sampling(), 0, with_hidden=True)
        self.release(cache_id)
