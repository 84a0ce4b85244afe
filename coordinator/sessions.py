"""Session records and where they are kept: Redis in every deployment, memory in unit tests.

A record says which draft and target replica hold the session's caches, under which ids and at
which committed length, plus the committed tokens themselves, so any coordinator can continue the
session or rebuild a lost cache. While a turn runs, the record also holds that turn's progress,
checkpointed as it goes (coordinator.checkpoints), so another coordinator can resume a stream its client lost.

Records are written whole (one SET inside a script), so none is ever half written. Each turn takes a
fencing token (an INCR per session): a write carrying an older token than the session's latest is
refused, so of two coordinators racing for one session only the later one's writes land.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from coordinator.replicas import CacheRef, Fenced


def new_session_id() -> str:
    """A fresh session id: 32 lowercase hex digits."""
    return uuid.uuid4().hex


def is_session_id(text: str) -> bool:
    """Whether ``text`` has the form ``new_session_id`` gives. Nothing else names a session, so a
    client's id of any other form is unknown without asking the store (where, say, a session's fence
    counter sits under its id plus ``:fence``)."""
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


class StoreUnavailable(RuntimeError):
    """The session store could not be reached, even after bounded retries."""


@dataclass
class TurnState:
    """The turn running (or last run) on a session, as of its latest round.

    With the session's committed tokens this is all a coordinator needs to continue the turn exactly:
    the next round index and the acceptance history steer k (and so, for a seeded sampled request, the
    random draws) just as they would have on the coordinator that wrote them.
    """

    # Digest of the request (session and resume fields cleared): a resume must be the same request.
    fingerprint: str
    # Committed length where this turn's generation began.
    prompt_len: int
    seed: int
    # The conversation including this turn's messages (None for plain text).
    messages: list[dict[str, str]] | None = None
    round: int = 0
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    tried: list[int] = field(default_factory=list)
    rounds_without_draft: int = 0
    # Set once the turn ended: "stop", "length" or "context".
    finish: str | None = None


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
    turn: TurnState | None = None
    # The fencing token of the turn that wrote this record (0: written outside any turn).
    fence: int = 0
    # The caller that created the session (``coordinator.identity``); only it may continue it.
    owner: str = ""

    def to_json(self) -> str:
        """Serialized form stored under the session's key.

        Built field by field rather than with ``dataclasses.asdict``, which deep-copies every list
        first, several times slower for a record of a few hundred tokens; a coordinator writes one a
        round for each of its sessions.
        """
        data = {**vars(self), "draft": _fields(self.draft), "target": _fields(self.target), "turn": _fields(self.turn)}
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> SessionRecord:
        """Parses a stored record."""
        data = json.loads(raw)
        for role in ("draft", "target"):
            if data.get(role) is not None:
                data[role] = CacheRef(**data[role])
        if data.get("turn") is not None:
            data["turn"] = TurnState(**data["turn"])
        return cls(**data)


def _fields(value: CacheRef | TurnState | None) -> dict | None:
    """A flat dataclass's fields as a dict (its lists shared, not copied), or None."""
    return None if value is None else vars(value)


class SessionStore(Protocol):
    """Where session records live."""

    async def get(self, session_id: str) -> SessionRecord | None:
        """The record, refreshing its expiry, or None when unknown or expired."""

    async def put(self, record: SessionRecord) -> None:
        """Writes the whole record and refreshes its expiry; raises Fenced when a turn with a newer
        fencing token than ``record.fence`` holds the session."""

    async def take_fence(self, session_id: str, at_least: int = 0) -> int:
        """A fencing token newer than every earlier one of this session and than ``at_least`` (the
        fence of the record the caller loaded): the caller's turn now holds the session, and older
        turns' writes are refused. A counter lost with the store's data never makes fences go back."""

    async def claim(self, client: str, session_id: str, limit: int) -> bool:
        """Counts ``session_id`` among ``client``'s live sessions (those used within the TTL) unless
        that would make more than ``limit``; returns whether it is counted."""

    async def unclaim(self, client: str, session_id: str) -> None:
        """Stops counting ``session_id`` among ``client``'s live sessions."""

    async def delete(self, session_id: str) -> None:
        """Forgets a session."""

    async def ping(self) -> None:
        """Raises when the store is unreachable."""

    async def close(self) -> None:
        """Releases connections."""


# KEYS: record, fence counter; ARGV: record JSON, writer's fence, TTL seconds. Returns 0 when a newer
# turn holds the session. One script, so the check and the write cannot interleave with another's.
# The counter is written back with the record: one lost on its own (evicted) is restored at once.
_FENCED_SET = """
local latest = tonumber(redis.call('GET', KEYS[2]) or '0')
local mine = tonumber(ARGV[2])
if latest > mine then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
if mine > 0 then redis.call('SET', KEYS[2], mine, 'EX', ARGV[3]) end
return 1
"""

# KEYS: fence counter; ARGV: the loaded record's fence, TTL seconds. The new fence passes both the
# counter and the record, so a counter that restarted from nothing still moves forward.
_TAKE_FENCE = """
local fence = math.max(tonumber(redis.call('GET', KEYS[1]) or '0'), tonumber(ARGV[1])) + 1
redis.call('SET', KEYS[1], fence, 'EX', ARGV[2])
return fence
"""


# KEYS: the client's sorted set of sessions (score: expiry time); ARGV: session id, now, expiry,
# limit, TTL. Expired members go first; a member already counted is refreshed.
_CLAIM = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then
  return 0
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


class RedisSessionStore:
    """Session records in Redis under ``specdec:session:<id>``, with a TTL refreshed on use.

    Commands that fail to connect are retried with backoff for about ``retry_s`` seconds (a Redis
    restart), then raise StoreUnavailable.
    """

    def __init__(
        self,
        url: str,
        ttl_s: int,
        prefix: str = "specdec:session:",
        retry_s: float = 3.0,
        password: str | None = None,
        ca: Path | None = None,
    ) -> None:
        retries = max(1, int(retry_s / 0.5))
        tls = {"ssl_ca_certs": str(ca)} if ca is not None and url.startswith("rediss://") else {}
        auth = {"password": password} if password else {}
        self._redis = aioredis.from_url(
            url,
            socket_timeout=5.0,
            socket_connect_timeout=2.0,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            **tls,
            **auth,
        )
        self._ttl_s = ttl_s
        self._prefix = prefix
        self._fenced_set = self._redis.register_script(_FENCED_SET)
        self._claim = self._redis.register_script(_CLAIM)
        self._take_fence = self._redis.register_script(_TAKE_FENCE)

    async def _do(self, command):
        try:
            return await command
        except RedisError as exc:
            raise StoreUnavailable(f"session store unreachable: {exc}") from None

    async def get(self, session_id: str) -> SessionRecord | None:
        raw = await self._do(self._redis.getex(self._prefix + session_id, ex=self._ttl_s))
        return None if raw is None else SessionRecord.from_json(raw)

    async def put(self, record: SessionRecord) -> None:
        record.updated_at = time.time()
        keys = [self._prefix + record.session_id, self._prefix + record.session_id + ":fence"]
        if not await self._do(self._fenced_set(keys=keys, args=[record.to_json(), record.fence, self._ttl_s])):
            raise Fenced(f"session {record.session_id}: a newer turn holds it (this turn's fence {record.fence})")

    async def take_fence(self, session_id: str, at_least: int = 0) -> int:
        key = self._prefix + session_id + ":fence"
        return int(await self._do(self._take_fence(keys=[key], args=[at_least, self._ttl_s])))

    async def claim(self, client: str, session_id: str, limit: int) -> bool:
        now = time.time()
        args: list[str | float | int] = [session_id, now, now + self._ttl_s, limit, self._ttl_s]
        return bool(await self._do(self._claim(keys=[self._client_key(client)], args=args)))

    def _client_key(self, client: str) -> str:
        return self._prefix.replace("session:", "client:") + client

    async def unclaim(self, client: str, session_id: str) -> None:
        await self._do(self._redis.zrem(self._client_key(client), session_id))

    async def delete(self, session_id: str) -> None:
        await self._do(self._redis.delete(self._prefix + session_id, self._prefix + session_id + ":fence"))

    async def ping(self) -> None:
        """Fails fast when Redis is unreachable."""
        await self._do(self._redis.ping())

    async def close(self) -> None:
        await self._redis.aclose()


class MemorySessionStore:
    """In-process records for unit tests; they expire like Redis keys."""

    def __init__(self, ttl_s: int) -> None:
        self._ttl_s = ttl_s
        self._records: dict[str, tuple[float, str]] = {}
        self._fences: dict[str, int] = {}
        self._clients: dict[str, dict[str, float]] = {}

    async def get(self, session_id: str) -> SessionRecord | None:
        entry = self._records.get(session_id)
        if entry is None or entry[0] < time.monotonic():
            self._records.pop(session_id, None)
            return None
        self._records[session_id] = (time.monotonic() + self._ttl_s, entry[1])
        return SessionRecord.from_json(entry[1])

    async def put(self, record: SessionRecord) -> None:
        if self._fences.get(record.session_id, 0) > record.fence:
            raise Fenced(f"session {record.session_id}: a newer turn holds it (this turn's fence {record.fence})")
        record.updated_at = time.time()
        self._records[record.session_id] = (time.monotonic() + self._ttl_s, record.to_json())
        if record.fence > 0:
            self._fences[record.session_id] = record.fence

    async def take_fence(self, session_id: str, at_least: int = 0) -> int:
        self._fences[session_id] = max(self._fences.get(session_id, 0), at_least) + 1
        return self._fences[session_id]

    async def claim(self, client: str, session_id: str, limit: int) -> bool:
        now = time.monotonic()
        live = {s: t for s, t in self._clients.get(client, {}).items() if t > now}
        if session_id not in live and len(live) >= limit:
            self._clients[client] = live
            return False
        live[session_id] = now + self._ttl_s
        self._clients[client] = live
        return True

    async def unclaim(self, client: str, session_id: str) -> None:
        self._clients.get(client, {}).pop(session_id, None)

    async def delete(self, session_id: str) -> None:
        self._records.pop(session_id, None)
        self._fences.pop(session_id, None)

    async def ping(self) -> None:
        """Always reachable."""

    async def close(self) -> None:
        self._records.clear()


def open_store(
    url: str, ttl_s: int, password: str | None = None, ca: Path | None = None
) -> RedisSessionStore | MemorySessionStore:
    """A store for ``redis://...`` (or ``rediss://``, trusting ``ca``) URLs, or ``memory://`` for tests."""
    if url.startswith("memory://"):
        return MemorySessionStore(ttl_s)
    return RedisSessionStore(url, ttl_s, password=password, ca=ca)
