"""Which session holds a chat conversation this coordinator served, so that the next request of a
stateless OpenAI client (the whole conversation again, one user message longer) continues it and
its caches instead of prefilling everything again.

A conversation is named by a chain of digests over its client and messages, one per prefix: entry
j names the first j messages. A session is found only for a prefix whose messages equal, exactly,
those the session's record holds (the request's own messages and the assistant's answer as served),
so the chat template renders the same tokens as for a fresh session and the output is the same.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable

# Conversations remembered at once; the least recently served is forgotten past it.
MAX_CONVERSATIONS = 4096


def prefix_digests(client: str, messages: list[dict[str, str]]) -> list[str]:
    """Digest of each prefix of ``messages`` (entry j: the first j), salted by ``client`` so that one
    client's conversations are never continued (or timed) by another. A message's fields beyond role
    and content (an assistant's ``tool_calls``, a result's ``tool_call_id``) are part of it."""
    digest = hashlib.sha256(client.encode()).hexdigest()
    chain = [digest]
    for m in messages:
        extra = sorted((k, v) for k, v in m.items() if k not in ("role", "content"))
        digest = hashlib.sha256((digest + json.dumps([m["role"], m["content"], *extra])).encode()).hexdigest()
        chain.append(digest)
    return chain


class Conversations:
    """A bounded map from a conversation's digest to the session holding it."""

    def __init__(
        self, ttl_s: float, max_entries: int = MAX_CONVERSATIONS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._ttl_s = ttl_s
        self._max = max_entries
        self._clock = clock
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()  # digest -> (session id, expiry)

    def __len__(self) -> int:
        return len(self._sessions)

    def take(self, client: str, messages: list[dict[str, str]]) -> tuple[str, int] | None:
        """The session holding the longest proper prefix of ``messages``, and that prefix's length.

        The entry is removed: the request that continues the session owns it, and a concurrent
        request with the same history starts a session of its own rather than fence this one.
        """
        chain = prefix_digests(client, messages)
        now = self._clock()
        for length in range(len(messages) - 1, 0, -1):
            found = self._sessions.pop(chain[length], None)
            if found is not None and found[1] > now:
                return found[0], length
        return None

    def put(self, client: str, messages: list[dict[str, str]], session_id: str) -> None:
        """Remembers that ``session_id`` holds ``messages`` (ending in the answer it served)."""
        key = prefix_digests(client, messages)[-1]
        self._sessions.pop(key, None)
        self._sessions[key] = (session_id, self._clock() + self._ttl_s)
        while len(self._sessions) > self._max:
            self._sessions.popitem(last=False)
