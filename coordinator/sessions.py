"""Session records and where they are kept: Redis in every deployment, memory in unit tests.

A record says which draft and target replica hold the session's caches, under which ids and at
which committed length, plus the committed tokens themselves, so any coordinator can continue the
session or rebuild a lost cache. Records are written whole (one SET), so none is ever half written.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

import redis.asyncio as aioredis

from coordinator.backends import CacheRef


@dataclass
class SessionRecord:
    """Everything needed to continue a session on any coordinator."""

    session_id: str
    tokens: list[int] = field(default_factory=list)
    # Chat history (role/content dicts, answers included) when the session speaks chat; else None.
    messages: list[dict[str, str]] | None = None
    draft: CacheRef | None = None
    target: CacheRef | None = None
    updated_at: float = field(default_factory=time.time)

    def to_json(self) -> str:
        """Serialized form stored under the session's key."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> SessionRecord:
        """Parses a stored record."""
        data = json.loads(raw)
        for role in ("draft", "target"):
            if data.get(role) is not None:
                data[role] = CacheRef(**data[role])
        return cls(**data)


class SessionStore(Protocol):
    """Where session records live."""

    async def get(self, session_id: str) -> SessionRecord | None:
        """The record, refreshing its expiry, or None when unknown or expired."""

    async def put(self, record: SessionRecord) -> None:
        """Writes the whole record and refreshes its expiry."""

    async def delete(self, session_id: str) -> None:
        """Forgets a session."""

    async def ping(self) -> None:
        """Raises when the store is unreachable."""

    async def close(self) -> None:
        """Releases connections."""


class RedisSessionStore:
    """Session records in Redis under ``specdec:session:<id>``, with a TTL refreshed on use."""

    def __init__(self, url: str, ttl_s: int, prefix: str = "specdec:session:") -> None:
        self._redis = aioredis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)
        self._ttl_s = ttl_s
        self._prefix = prefix

    async def get(self, session_id: str) -> SessionRecord | None:
        raw = await self._redis.getex(self._prefix + session_id, ex=self._ttl_s)
        return None if raw is None else SessionRecord.from_json(raw)

    async def put(self, record: SessionRecord) -> None:
        record.updated_at = time.time()
        await self._redis.set(self._prefix + record.session_id, record.to_json(), ex=self._ttl_s)

    async def delete(self, session_id: str) -> None:
        await self._redis.delete(self._prefix + session_id)

    async def ping(self) -> None:
        """Fails fast when Redis is unreachable."""
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()


class MemorySessionStore:
    """In-process records for unit tests; they expire like Redis keys."""

    def __init__(self, ttl_s: int) -> None:
        self._ttl_s = ttl_s
        self._records: dict[str, tuple[float, str]] = {}

    async def get(self, session_id: str) -> SessionRecord | None:
        entry = self._records.get(session_id)
        if entry is None or entry[0] < time.monotonic():
            self._records.pop(session_id, None)
            return None
        self._records[session_id] = (time.monotonic() + self._ttl_s, entry[1])
        return SessionRecord.from_json(entry[1])

    async def put(self, record: SessionRecord) -> None:
        record.updated_at = time.time()
        self._records[record.session_id] = (time.monotonic() + self._ttl_s, record.to_json())

    async def delete(self, session_id: str) -> None:
        self._records.pop(session_id, None)

    async def ping(self) -> None:
        """Always reachable."""

    async def close(self) -> None:
        self._records.clear()


def open_store(url: str, ttl_s: int) -> RedisSessionStore | MemorySessionStore:
    """A store for ``redis://...`` (or ``rediss://``) URLs, or ``memory://`` for tests."""
    if url.startswith("memory://"):
        return MemorySessionStore(ttl_s)
    return RedisSessionStore(url, ttl_s)
