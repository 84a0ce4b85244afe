"""Per-session KV caches that keep the committed-prefix invariant.

A service holds, for each session, the committed tokens it has been told about and a KV cache over
a prefix of them, possibly followed by speculative tokens (a draft's own proposals). Every call
first *syncs*: it crops to the ``start`` committed tokens the caller expects and appends the ones
the service has not seen. KV entries are kept only where they still match the committed tokens, so
a cache is never silently wrong.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer

from specdec.errors import CacheBehind, CacheBudgetExceeded, CacheNotFound, StaleFence
from specdec.invariance import round_up
from specdec.side_layers import layer_outputs, with_sides
from specdec.token_lists import common_prefix_len  # noqa: F401 - also imported from here


class GrowableLayer(DynamicLayer):
    """One layer's keys and values in a buffer that doubles when full, instead of growing by concat.

    ``torch.cat`` per step reallocates and copies the whole cache every token; here a step writes
    only its own keys and values, and cropping just moves the length back. ``keys`` / ``values``
    stay views of the valid prefix, so attention reads exactly the same numbers.

    Buffers are zero-initialised and their capacity is a multiple of ``KEY_BLOCK``: the batch-invariant
    attention widens these views to whole key blocks in place (``specdec.invariance.padded_keys``), and
    masked entries past the length must be finite, so that their zero weights make exact zeros.
    """

    _INITIAL = 256

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._length = 0
        self._key_buf = self._alloc(key_states, self._INITIAL)
        self._value_buf = self._alloc(value_states, self._INITIAL)
        self._expose()
        self.is_initialized = True

    @staticmethod
    def _alloc(like: torch.Tensor, capacity: int) -> torch.Tensor:
        batch, heads, _, dim = like.shape
        return like.new_zeros((batch, heads, round_up(capacity), dim))  # [B, H, capacity, D]

    def _expose(self) -> None:
        # narrow, not [:, :, :T]: one op instead of three, and a pass makes this call per session and layer
        self.keys = self._key_buf.narrow(2, 0, self._length)  # [B, H, T, D]
        self.values = self._value_buf.narrow(2, 0, self._length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._length + key_states.shape[-2]
        self._grow(end)
        self._key_buf.narrow(2, self._length, end - self._length).copy_(key_states)
        self._value_buf.narrow(2, self._length, end - self._length).copy_(value_states)
        self._length = end
        self._expose()
        return self.keys, self.values

    def claim(self, like: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Counts ``n`` more entries in, shaped like ``like [1, H, *, hd]``, without writing them: returns
        the key and value buffers ``[1, H, capacity, hd]`` and the first new entry's position, for a
        caller that writes the entries itself before anything reads them (the attention kernel,
        ``specdec.attention_kernel``), saving ``update``'s per-layer copies and views."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
        start = self._length
        self._grow(start + n)
        self._length = start + n
        self._expose()
        return self._key_buf, self._value_buf, start

    def _grow(self, end: int) -> None:
        """Doubles the buffers (at least to ``end`` entries) when ``end`` would not fit."""
        capacity = self._key_buf.shape[-2]
        if end <= capacity:
            return
        capacity = max(2 * capacity, end)
        for name in ("_key_buf", "_value_buf"):
            old = getattr(self, name)
            new = self._alloc(old, capacity)
            new[:, :, : self._length].copy_(old[:, :, : self._length])
            setattr(self, name, new)

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    @torch.inference_mode()
    def clone(self, keep: int) -> GrowableLayer:
        """A new layer holding a copy of this one's first ``keep`` entries, in fresh zeroed buffers:
        the numbers a pass that fed those positions would have written (a fork's KV)."""
        layer = GrowableLayer()
        if not self.is_initialized:
            return layer
        keep = min(keep, self._length)
        layer.device = self.device
        layer._length = keep
        for name in ("_key_buf", "_value_buf"):
            old = getattr(self, name)
            new = self._alloc(old, max(self._INITIAL, keep))
            new[:, :, :keep].copy_(old[:, :, :keep])
            setattr(layer, name, new)
        layer._expose()
        layer.is_initialized = True
        return layer

    @torch.inference_mode()
    def compact(self, start: int, keep: list[int]) -> None:
        """Keeps the entries at ``start + keep[i]`` (``keep`` increasing) as ``start + i`` and drops the
        rest past ``start``: a verified tree's accepted path, moved to follow the committed entries."""
        if not self.is_initialized:
            return
        index = torch.tensor(keep, dtype=torch.long, device=self._key_buf.device) + start
        end = start + len(keep)
        for buf in (self._key_buf, self._value_buf):
            buf[:, :, start:end] = buf[:, :, index]  # the gather copies before the write
        self._length = end
        self._expose()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count: the number of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._length = max(0, self._length + tokens_to_remove)
        self._expose()


class GrowableCache(DynamicCache):
    """A DynamicCache whose layers write into preallocated, doubling buffers.

    Every layer keeps every entry, a sliding-window layer's too (Mistral, Qwen2/3, Gemma 2): the
    window is the attention mask's business, transformers' own and ``specdec.ragged``'s alike, so the
    cache crops and extends the same way for every family.
    """

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowableLayer)

    def layer(self, index: int) -> GrowableLayer:
        """Layer ``index``'s keys and values, created (empty) with the layers before it if missing."""
        while len(self.layers) <= index:
            self.layers.append(GrowableLayer())
        return self.layers[index]


def copy_kv(kv: Cache, keep: int) -> GrowableCache:
    """A GrowableCache holding a copy of the first ``keep`` entries of every layer of ``kv``."""
    out = GrowableCache()
    for layer in kv.layers:
        assert isinstance(layer, GrowableLayer), "session caches are GrowableCaches"
        out.layers.append(layer.clone(keep))
    return out


@dataclass(frozen=True)
class HiddenRows:
    """The target's final-norm hidden states ``rows [n, D]`` at committed positions ``start ..`` (with
    side layers, ``[n, D * (1 + S)]``: see ``specdec.side_layers``)."""

    start: int
    rows: torch.Tensor


def check_sync(held_fence: int, committed: int, start: int, new: int, fence: int) -> int:
    """Checks a sync against a cache holding ``committed`` tokens and fencing token ``held_fence``
    before it changes anything; returns the fencing token the cache keeps.

    A caller with an older token is stale (StaleFence); one expecting more tokens than the cache holds
    must prefill again (CacheBehind); a sync may not leave the cache without a committed token.
    """
    if fence < held_fence:
        raise StaleFence(
            f"fencing token {fence} is older than this cache's {held_fence}: a newer turn owns the session"
        )
    if start > committed:
        raise CacheBehind(f"cache holds {committed} committed tokens, caller expected at least {start}")
    if start + new == 0:
        raise ValueError("sync: the cache must keep at least one committed token")
    return fence


@dataclass
class SessionCache:
    """The committed tokens a service knows for one session, and its KV cache over them."""

    committed: list[int]
    kv: DynamicCache = field(default_factory=GrowableCache)
    kv_tokens: list[int] = field(default_factory=list)
    # The highest fencing token a caller showed: callers with a lower one are stale.
    fence: int = 0
    # A constrained session's grammar state at its committed tokens (``specdec.constrain.SessionGrammar``).
    grammar: Any = None

    def sync(self, start: int, new_tokens: list[int], fence: int = 0) -> None:
        """Crops to ``start`` committed tokens, appends ``new_tokens``, and drops stale KV entries.

        A caller whose ``fence`` is below the highest seen is refused before anything changes.
        """
        self.fence = check_sync(self.fence, len(self.committed), start, len(new_tokens), fence)
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

    def drop_unrecorded_kv(self) -> None:
        """Crops KV entries a failed pass wrote beyond ``kv_tokens``, restoring the invariant.

        A pass that failed midway may have grown some layers and not others, so each layer is cut alone.
        """
        for layer in self.kv.layers:
            extra = layer.get_seq_length() - len(self.kv_tokens)
            if extra > 0:
                layer.crop(-extra)

    def keep_path(self, start: int, lead: int, path: list[int], tokens: list[int]) -> None:
        """After a pass that fed ``lead`` chain rows then a tree's nodes from KV entry ``start`` on, keeps
        the chain rows and the accepted ``path``'s nodes (whose ``tokens`` they are), in order, and
        drops the other nodes' entries."""
        keep = list(range(lead)) + [lead + node for node in path]
        for layer in self.kv.layers:
            layer.compact(start, keep)
        del self.kv_tokens[start + lead :]
        self.kv_tokens.extend(tokens)

    def pending(self) -> list[int]:
        """Committed tokens not yet in the KV cache (at least the last one after a sync)."""
        return self.committed[len(self.kv_tokens) :]

    def reusable(self, tokens: list[int]) -> int:
        """Positions of ``tokens`` whose state a fork of this cache copies: its KV entries where their
        tokens match, never the last token (a round feeds it)."""
        return max(0, min(common_prefix_len(self.kv_tokens, tokens), len(tokens) - 1))

    def fork(self, tokens: list[int], fence: int = 0) -> SessionCache:
        """A new session's cache over the committed ``tokens``, holding a copy of this cache's KV
        entries where its tokens match (``reusable``); the rest is pending."""
        keep = self.reusable(tokens)
        return SessionCache(list(tokens), copy_kv(self.kv, keep), self.kv_tokens[:keep], fence)

    @property
    def copied_end(self) -> int:
        """One past the last committed position whose state the cache holds (its KV entries)."""
        return len(self.kv_tokens)

    @torch.inference_mode()
    def forward(self, model: PreTrainedModel, extra: list[int], logits_to_keep: int) -> torch.Tensor:
        """Feeds the pending committed tokens plus ``extra`` in one pass.

        Returns the logits ``[logits_to_keep, V]`` of the last positions; the fed tokens join the
        KV cache.
        """
        fed = self.pending() + list(extra)
        input_ids = torch.tensor([fed], dtype=torch.long, device=model.device)  # [1, n]
        out = model(input_ids=input_ids, cache=self.kv, use_cache=True, logits_to_keep=logits_to_keep)
        self.kv_tokens.extend(fed)
        return out.logits[0].float()  # [logits_to_keep, V]

    @torch.inference_mode()
    def forward_with_hidden(
        self, model: PreTrainedModel, extra: list[int], logits_to_keep: int, side_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, HiddenRows]:
        """``forward``, also returning the final-norm hidden states of every fed position (followed by
        the outputs of ``side_layers``, see ``specdec.side_layers``).

        The same decoder pass and LM head as the model's own forward, run in two calls so the hidden
        states are at hand; the logits are the same numbers.
        """
        start = len(self.kv_tokens)
        fed = self.pending() + list(extra)
        hidden = self._hidden(model, fed, side_layers)  # [n, W]
        logits = model.get_output_embeddings()(hidden[-logits_to_keep:, : model.config.hidden_size])  # [keep, V]
        return logits.float(), HiddenRows(start, hidden)

    def _hidden(self, model: PreTrainedModel, fed: list[int], side_layers: tuple[int, ...]) -> torch.Tensor:
        """Feeds ``fed`` into the cache; their final-norm hidden states and side outputs ``[n, W]``."""
        decoder = model.get_decoder()
        input_ids = torch.tensor([fed], dtype=torch.long, device=model.device)  # [1, n]
        with layer_outputs(decoder.layers, side_layers) as sides:
            hidden = decoder(input_ids=input_ids, cache=self.kv, use_cache=True).last_hidden_state  # [1, n, D]
        self.kv_tokens.extend(fed)
        return with_sides(hidden, sides, side_layers)[0]

    @torch.inference_mode()
    def prefill(
        self, model: PreTrainedModel, with_hidden: bool = False, side_layers: tuple[int, ...] = ()
    ) -> HiddenRows | None:
        """Caches every committed token but the last, so the next call starts with one pending (a
        fork's cache feeds only what its copy does not hold).

        With ``with_hidden``, returns the hidden states of the positions it fed (and the outputs of
        ``side_layers``).
        """
        start = len(self.kv_tokens)
        rest = self.committed[start:-1]
        if not rest:
            width = model.config.hidden_size * (1 + len(side_layers))
            return HiddenRows(start, torch.zeros(0, width)) if with_hidden else None
        if with_hidden:
            return HiddenRows(start, self._hidden(model, rest, side_layers))  # [n, W]
        self.forward_without_logits(model, rest)
        return None

    def forward_without_logits(self, model: PreTrainedModel, tokens: list[int]) -> None:
        """Feeds tokens into the KV cache, computing as few logits as the model allows."""
        input_ids = torch.tensor([tokens], dtype=torch.long, device=model.device)  # [1, n]
        model(input_ids=input_ids, cache=self.kv, use_cache=True, logits_to_keep=1)
        self.kv_tokens.extend(tokens)


class CacheTable:
    """Session caches of one service by id, in least recently used order.

    Three limits keep it bounded: at most ``capacity`` caches; caches idle for ``idle_s`` seconds
    are dropped (their sessions expired, or moved elsewhere); and past ``budget_bytes`` of KV
    buffers, idle caches go, least recently used first. A cache used within ``active_s`` seconds
    counts as in use: when only those remain over the budget, a new cache is refused (CacheBudgetExceeded)
    rather than evicting a running session's. 0 turns a limit off. An evicted session is not lost:
    its coordinator prefills it again.

    Prefix reuse (``reuse_min``, 0: off): a new cache whose first ``reuse_min`` or more tokens some
    held cache has state for starts as a copy of that cache's state over them (``create``), so a
    prompt sharing a system prompt, a template or a whole earlier prompt with another session computes
    only the rest. A position's state does not depend on the pass that computed it (batch invariance),
    so the copy is what feeding those tokens would hold, bit for bit.
    """

    def __init__(
        self,
        capacity: int,
        factory=SessionCache,
        budget_bytes: int = 0,
        idle_s: float = 0.0,
        active_s: float = 5.0,
        reuse_min: int = 0,
    ) -> None:
        self._capacity = capacity
        self._reuse_min = reuse_min
        self._factory = factory
        self._budget_bytes = budget_bytes
        self._idle_s = idle_s
        self._active_s = active_s
        self._caches: OrderedDict[str, SessionCache] = OrderedDict()
        self._used: dict[str, float] = {}
        self._ids = itertools.count()
        # Caches evicted to make room since start-up; the metrics scrape reads it.
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._caches)

    @property
    def capacity(self) -> int:
        """Most caches held at once."""
        return self._capacity

    def new_id(self) -> str:
        """A fresh cache id."""
        return f"{uuid.uuid4().hex[:16]}-{next(self._ids)}"

    def ids(self) -> set[str]:
        """The ids of the caches held now."""
        return set(self._caches)

    def create(
        self, committed: list[int], fence: int = 0, cache_id: str | None = None, reuse: bool = True
    ) -> tuple[str, SessionCache]:
        """Adds a cache for ``committed`` tokens (for a caller with fencing token ``fence``), under
        ``cache_id`` or a fresh id, evicting the least recently used if full. With ``reuse`` (and
        ``reuse_min`` set), it copies the state of the held cache that covers the longest prefix of
        ``committed`` (``prefix_source``), as a fork would; its ``copied_end`` says how far."""
        source = self.prefix_source(committed) if reuse else None
        if source is not None:
            cache = self._caches[source].fork(committed, fence)
        else:
            cache = self._factory(committed=list(committed))
            cache.fence = fence
        return self._add(cache, cache_id), cache

    def prefix_source(self, tokens: list[int]) -> str | None:
        """The held cache with state for the longest prefix of ``tokens``, at least ``reuse_min``
        positions (the least recently used of equals), or None."""
        if not self._reuse_min:
            return None
        best, longest = None, self._reuse_min - 1
        for cache_id, cache in self._caches.items():
            if (n := cache.reusable(tokens)) > longest:
                best, longest = cache_id, n
        return best

    def fork(
        self, source_id: str, committed: list[int], fence: int = 0, cache_id: str | None = None
    ) -> tuple[str, Any]:
        """Adds a cache for ``committed`` tokens (a caller with fencing token ``fence``) that copies
        the state of cache ``source_id`` where its tokens match (``SessionCache.fork``), under
        ``cache_id`` or a fresh id. The source is copied before anything is evicted to make room, and
        is left as it was; an unknown source is CacheNotFound."""
        try:
            source = self.get(source_id)
        except CacheNotFound as exc:
            raise CacheNotFound(f"fork_of: {exc}") from None
        cache = source.fork(committed, fence)
        return self._add(cache, cache_id), cache

    def _add(self, cache: Any, cache_id: str | None) -> str:
        """Holds ``cache`` under ``cache_id`` (or a fresh id), evicting the least recently used if full."""
        self.expire_idle()
        while len(self._caches) >= self._capacity:
            self._drop(next(iter(self._caches)))
            self.evictions += 1
        cache_id = cache_id or self.new_id()
        self._caches[cache_id] = cache
        self._used[cache_id] = time.monotonic()
        return cache_id

    def _drop(self, cache_id: str) -> None:
        del self._caches[cache_id]
        del self._used[cache_id]

    def expire_idle(self) -> int:
        """Drops caches idle for ``idle_s`` or longer; returns how many."""
        if not self._idle_s:
            return 0
        cutoff = time.monotonic() - self._idle_s
        dropped = 0
        while self._caches and self._used[next(iter(self._caches))] <= cutoff:
            self._drop(next(iter(self._caches)))
            dropped += 1
        return dropped

    def fit_budget(self, new_id: str) -> None:
        """Brings the KV buffers within the budget after cache ``new_id`` grew: idle caches go first,
        least recently used first. If the caches in use still exceed it, ``new_id`` is dropped and
        CacheBudgetExceeded raised."""
        if not self._budget_bytes:
            return
        total = self.kv_bytes()
        busy_since = time.monotonic() - self._active_s
        for cache_id in list(self._caches):
            if total <= self._budget_bytes:
                return
            if cache_id != new_id and self._used[cache_id] < busy_since:
                total -= kv_buffer_bytes(self._caches[cache_id].kv)
                self._drop(cache_id)
                self.evictions += 1
        if total > self._budget_bytes:
            in_use = len(self._caches) - 1
            self._drop(new_id)
            raise CacheBudgetExceeded(
                f"KV cache budget of {self._budget_bytes / 2**20:.0f} MiB is held by {in_use} sessions in use; "
                "retry shortly"
            )

    def peek(self, cache_id: str) -> SessionCache | None:
        """The cache under ``cache_id`` or None, not marked as used: for estimates made off the engine's
        thread (each read is atomic; the figures may be a pass old)."""
        return self._caches.get(cache_id)

    def get(self, cache_id: str) -> SessionCache:
        """The cache under ``cache_id``, marked as most recently used."""
        try:
            cache = self._caches[cache_id]
        except KeyError:
            raise CacheNotFound(f"no cache {cache_id!r} (released, evicted, or held by another replica)") from None
        self._caches.move_to_end(cache_id)
        self._used[cache_id] = time.monotonic()
        return cache

    def release(self, cache_id: str) -> bool:
        """Drops a cache; returns whether it existed."""
        if cache_id not in self._caches:
            return False
        self._drop(cache_id)
        return True

    def kv_bytes(self) -> int:
        """Bytes of every cache's key and value buffers; safe to call from a thread other than the model's."""
        # The model's worker thread may add or evict caches meanwhile: iterate over a copy, and take
        # the copy again in the unlikely case the table changed while it was being made.
        for _ in range(3):
            try:
                caches = list(self._caches.values())
                break
            except RuntimeError:
                continue
        else:
            return 0
        return sum(kv_buffer_bytes(cache.kv) for cache in caches)


def fit_fork(caches: CacheTable, cache_id: str, source_id: str) -> None:
    """``CacheTable.fit_budget`` for a fork just made: its refusal names the fork and its source."""
    try:
        caches.fit_budget(cache_id)
    except CacheBudgetExceeded as exc:
        raise CacheBudgetExceeded(f"fork_of: no room to copy {source_id!r}: {exc}") from None


def kv_buffer_bytes(kv: Cache) -> int:
    """Allocated bytes of a GrowableCache's key and value buffers (capacity, not just the filled part)."""
    total = 0
    for layer in list(getattr(kv, "layers", ())):
        for name in ("_key_buf", "_value_buf"):
            buf = getattr(layer, name, None)  # absent until the layer's first update
            if buf is not None:
                total += buf.numel() * buf.element_size()
    return total
