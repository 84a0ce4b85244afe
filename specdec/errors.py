"""Errors the service cores raise; ``specdec.rpc`` maps each to a gRPC status."""


class CacheNotFound(LookupError):
    """No cache under the given id (never created, released, or evicted)."""


class CacheBudgetExceeded(RuntimeError):
    """A new cache would take the KV budget past its limit while every other cache is in use."""


class StaleFence(RuntimeError):
    """A call carried an older fencing token than its cache has seen: a newer turn owns the session."""


class CacheBehind(ValueError):
    """The caller expects more committed tokens than the cache has seen; it must prefill again."""
