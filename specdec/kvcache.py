"""Per-session KV caches that keep the committed-prefix invariant.

A service holds, for each session, the committed tokens it has been told about and a KV cache over
a prefix of them, possibly followed by speculative tokens (a draft's own proposals). Every call
first *syncs*: it crops to the ``start`` committed tokens the caller expects and appends the ones
the service has not seen. KV entries are kept only where they still match the committed tokens, so
a cache is never silently wrong.
"""

from __future__ import annotations

import itertools
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from specdec.errors import CacheBehind, CacheNotFound


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class SessionCache:
    """The committed tokens a service knows for one session, and its KV cache over them."""

    committed: list[int]
    kv: DynamicCache = field(default_factory=DynamicCache)
    kv_tokens: list[int] = field(default_factory=list)

    def sync(self, start: int, new_tokens: list[int]) -> None:
        """Crops to ``start`` committed tokens, appends ``new_tokens``, and drops stale KV entries."""
        if start > len(self.committed):
            raise CacheBehind(
                f"cache holds {len(self.committed)} committed tokens, caller expected at least {start}"
            )
        self.committed = self.committed[:start] + list(new_tokens)
        self.trim()

    def trim(self) -> None:
        """Drops KV entries that no longer match the committed tokens.

        The last committed token always stays un-cached: feeding it is what yields the logits for
        the next position.
        """
        keep = min(common_prefix_len(self.kv_tokens, self.committed), len(self.committed) - 1)
        keep = max(keep, 0)
        drop = len(self.kv_tokens) - keep
        if drop > 0:
            self.kv.crop(-drop)
            del self.kv_tokens[keep:]

    def pending(self) -> list[int]:
        """Committed tokens not yet in the KV cache (at least the last one after a sync)."""
        return self.committed[len(self.kv_tokens) :]

    @torch.inference_mode()
    def forward(self, model: PreTrainedModel, extra: list[int], logits_to_keep: int) -> torch.Tensor:
        """Feeds the pending committed tokens plus ``extra`` in one pass.

        Returns the logits ``[logits_to_keep, V]`` of the last positions; the fed tokens join the
        KV cache.
        """
        fed = self.pending() + list(extra)
        input_ids = torch.tensor([fed], dtype=torch.long)  # [1, n]
        out = model(input_ids=input_ids, cache=self.kv, use_cache=True, logits_to_keep=logits_to_keep)
        self.kv_tokens.extend(fed)
        return out.logits[0].float()  # [logits_to_keep, V]

    @torch.inference_mode()
    def prefill(self, model: PreTrainedModel) -> None:
        """Caches every committed token but the last, so the next call starts with one pending."""
        if len(self.committed) > 1:
            self.forward_without_logits(model, self.committed[:-1])

    def forward_without_logits(self, model: PreTrainedModel, tokens: list[int]) -> None:
        """Feeds tokens into the KV cache, computing as few logits as the model allows."""
        input_ids = torch.tensor([tokens], dtype=torch.long)  # [1, n]
        model(input_ids=input_ids, cache=self.kv, use_cache=True, logits_to_keep=1)
        self.kv_tokens.extend(tokens)


class CacheTable:
    """Session caches of one service by id, evicting the least recently used past ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._caches: OrderedDict[str, SessionCache] = OrderedDict()
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._caches)

    def create(self, committed: list[int]) -> tuple[str, SessionCache]:
        """Adds a cache for ``committed`` tokens, evicting the least recently used if full."""
        while len(self._caches) >= self._capacity:
            self._caches.popitem(last=False)
        cache_id = f"{uuid.uuid4().hex[:16]}-{next(self._ids)}"
        cache = SessionCache(committed=list(committed))
        self._caches[cache_id] = cache
        return cache_id, cache

    def get(self, cache_id: str) -> SessionCache:
        """The cache under ``cache_id``, marked as most recently used."""
        try:
            cache = self._caches[cache_id]
        except KeyError:
            raise CacheNotFound(f"no cache {cache_id!r} (released, evicted, or held by another replica)") from None
        self._caches.move_to_end(cache_id)
        return cache

    def release(self, cache_id: str) -> bool:
        """Drops a cache; returns whether it existed."""
        return self._caches.pop(cache_id, None) is not None
