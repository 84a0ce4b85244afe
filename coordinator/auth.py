"""API keys on the coordinator: reading them at the edge, and checking them on every call.

Clients send ``authorization: Bearer <key>`` as gRPC metadata. The coordinator holds only the SHA-256
digests of its keys and compares digests in constant time; a key itself is never stored or logged.
Health checks and server reflection stay open, because Kubernetes probes cannot send a key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

HASH_PREFIX = "sha256:"
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
# Services any caller may reach: probes and tooling must work without a key.
OPEN_SERVICES = (health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
MISSING = "missing API key: send gRPC metadata 'authorization: Bearer <key>'"
INVALID = "invalid API key"


def hash_key(key: str) -> str:
    """The SHA-256 hex digest under which a key is held."""
    return hashlib.sha256(key.encode()).hexdigest()


def parse_key_entries(entries: Iterable[str], source: str) -> tuple[str, ...]:
    """Digests of key entries: a plain key, or ``sha256:<hex>`` naming the digest of one.

    Blank entries and ``#`` comments are skipped. A malformed digest raises ValueError naming
    ``source`` and the entry's position, never the entry, which may be a key pasted by mistake.
    """
    hashes = []
    for number, raw in enumerate(entries, 1):
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        if entry.lower().startswith(HASH_PREFIX):
            digest = entry[len(HASH_PREFIX) :].strip().lower()
            if not _HEX_DIGEST.fullmatch(digest):
                raise ValueError(f"{source}, entry {number}: a sha256: entry needs 64 hex digits")
            hashes.append(digest)
        else:
            hashes.append(hash_key(entry))
    return tuple(dict.fromkeys(hashes))


def read_api_key_hashes(keys_file: Path | None, env_keys: str | None) -> tuple[str, ...]:
    """Every configured key's digest: one entry per line of ``keys_file``, plus the comma-separated
    entries of ``env_keys`` (the SPECDEC_API_KEYS variable). Called once, at the CLI edge."""
    hashes: list[str] = []
    if keys_file is not None:
        hashes += parse_key_entries(keys_file.read_text().splitlines(), str(keys_file))
    if env_keys:
        hashes += parse_key_entries(env_keys.split(","), "SPECDEC_API_KEYS")
    return tuple(dict.fromkeys(hashes))


def bearer_token(authorization: str) -> str | None:
    """The token of an ``authorization`` value ``Bearer <token>`` (gRPC metadata or HTTP header), or None."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of the first ``authorization: Bearer`` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            return bearer_token(value)
    return None


def _denial(handler: grpc.RpcMethodHandler | None, detail: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED without reading the request."""

    async def deny(_request, context: grpc.aio.ServicerContext) -> None:
        # The peer and reason help an operator; the key itself never reaches a log.
        log.info("refused a call from %s: %s", context.peer(), detail)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, detail)

    request_streaming = handler is not None and handler.request_streaming
    response_streaming = handler is not None and handler.response_streaming
    if request_streaming and response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only with a known API key, except to the open services."""

    def __init__(self, key_hashes: Iterable[str]) -> None:
        self._digests = tuple(bytes.fromhex(h) for h in key_hashes)
        if not self._digests:
            raise ValueError("an API key interceptor needs at least one key")

    def allows(self, token: str) -> bool:
        """Whether ``token`` is one of the keys; every digest is compared, so timing tells nothing."""
        digest = hashlib.sha256(token.encode()).digest()
        found = False
        for known in self._digests:
            found |= hmac.compare_digest(digest, known)
        return found

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        """Passes open-service calls and calls with a valid key on; answers the rest UNAUTHENTICATED."""
        service = handler_call_details.method.lstrip("/").partition("/")[0]
        if service in OPEN_SERVICES:
            return await continuation(handler_call_details)
        token = _bearer(handler_call_details.invocation_metadata)
        if token is not None and self.allows(token):
            return await continuation(handler_call_details)
        # Looked up only to learn the method's shape (unary or streaming); it is never run.
        return _denial(await continuation(handler_call_details), MISSING if token is None else INVALID)
