"""Who a request comes from: the identity its limits count against and the owner of its sessions.

Both derive from what the caller proved, never from what it merely said: the digest of its API key,
else the subject of its client certificate (mutual TLS), else, on an open coordinator, its peer
host. A session belongs to the key or certificate that created it; any other caller that names it is
told it does not exist, exactly as for an unknown id, so session ids leak nothing. An open
coordinator (no keys, no client certificates) has no owners: there a session id is the capability.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Caller:
    """The proven identity of a request's sender."""

    # What fair queueing and per-client limits count the request against.
    client: str
    # Who owns the sessions the request creates or continues ("" on an open coordinator).
    owner: str


def caller_of(bearer: str | None, certificate: str | None, peer_host: str) -> Caller:
    """The identity of a caller that presented ``bearer`` (an API key the coordinator accepted, or
    None) and a client certificate naming ``certificate`` (or None), from ``peer_host``."""
    if bearer:
        proven = "key:" + hashlib.sha256(bearer.encode()).hexdigest()[:24]
    elif certificate:
        proven = "cert:" + certificate[:256]
    else:
        return Caller("peer:" + peer_host, "")
    return Caller(proven, proven)


def span_session(session_id: str) -> str:
    """What a trace may carry of a session id: a digest that correlates spans but cannot continue it."""
    return hashlib.sha256(session_id.encode()).hexdigest()[:16]
