"""The Python client SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio) for the coordinator.

Both speak plaintext unless given ``tls=TlsClientConfig(...)``, and send ``api_key`` (when given) as
``authorization: Bearer <key>`` metadata on every call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc

from specdec.config import TlsClientConfig
from specdec.metadata import CLIENT_METADATA, RETRY_AFTER_METADATA
from specdec.rpc import aio_channel, channel_credentials, channel_options
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

Prompt = str | list[dict[str, str]]


class SpecdecError(Exception):
    """A failed call; ``code`` is the gRPC status and ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgument(SpecdecError):
    """The request had a bad field (INVALID_ARGUMENT)."""


class SessionNotFound(SpecdecError):
    """The session id is unknown or expired (NOT_FOUND)."""


class Unavailable(SpecdecError):
    """The coordinator or a service behind it could not be reached (UNAVAILABLE)."""


class DeadlineExceeded(SpecdecError):
    """The request ran past its deadline (DEADLINE_EXCEEDED)."""


class ResourceExhausted(SpecdecError):
    """A limit was hit (RESOURCE_EXHAUSTED); retry later, after ``retry_after_s`` when the server said."""

    retry_after_s: float | None = None


class Unauthenticated(SpecdecError):
    """The coordinator requires an API key and none, or a wrong one, was sent (UNAUTHENTICATED)."""


_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: SessionNotFound,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}


def _error(exc: grpc.RpcError) -> SpecdecError:
    code, details = exc.code(), exc.details() or ""
    error = _ERRORS.get(code, SpecdecError)(code, details)
    if isinstance(error, ResourceExhausted):
        trailing = dict(exc.trailing_metadata() or ()) if hasattr(exc, "trailing_metadata") else {}
        if RETRY_AFTER_METADATA in trailing:
            error.retry_after_s = int(trailing[RETRY_AFTER_METADATA]) / 1000
    return error


@dataclass(frozen=True)
class Stats:
    """Counters of one request (see GenerationStats in coordinator.proto)."""

    prompt_tokens: int
    generated_tokens: int
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    draft_ms: float
    verify_ms: float
    other_ms: float
    total_ms: float
    time_to_first_token_ms: float
    drafted_at_position: list[int]
    accepted_at_position: list[int]
    prefill_ms: float

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per wall-clock second."""
        return self.generated_tokens / (self.total_ms / 1000) if self.total_ms else 0.0


@dataclass(frozen=True)
class Chunk:
    """A streamed piece; the last one has ``finish_reason`` and ``stats``."""

    text: str
    token_ids: list[int]
    session_id: str
    finish_reason: str | None = None
    stats: Stats | None = None


@dataclass(frozen=True)
class Completion:
    """A whole answer."""

    text: str
    token_ids: list[int]
    finish_reason: str
    session_id: str
    stats: Stats = field(repr=False)


def _stats(msg: coordinator_pb2.GenerationStats) -> Stats:
    values = {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}
    values["drafted_at_position"] = list(msg.drafted_at_position)
    values["accepted_at_position"] = list(msg.accepted_at_position)
    return Stats(**values)


def build_request(
    prompt: Prompt,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: list[str] | tuple[str, ...] = (),
    session_id: str | None = None,
    k: int | None = None,
) -> coordinator_pb2.GenerateRequest:
    """The wire request for a prompt: a ``str`` is plain text, a list of dicts is chat."""
    request = coordinator_pb2.GenerateRequest(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop=list(stop),
        session_id=session_id or "",
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.messages.messages.extend(coordinator_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
        # An empty list must still select the messages branch, so the server can name the problem.
        request.messages.SetInParent()
    if seed is not None:
        request.seed = seed
    if k is not None:
        request.k = k
    return request


def _chunk(msg: coordinator_pb2.GenerateChunk) -> Chunk:
    return Chunk(
        text=msg.text,
        token_ids=list(msg.token_ids),
        session_id=msg.session_id,
        finish_reason=msg.finish_reason or None,
        stats=_stats(msg.stats) if msg.HasField("stats") else None,
    )


def _completion(msg: coordinator_pb2.CompleteReply) -> Completion:
    return Completion(msg.text, list(msg.token_ids), msg.finish_reason, msg.session_id, _stats(msg.stats))


_MAX_BYTES = 8 * 1024 * 1024


def _call_metadata(api_key: str | None, client_id: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata every call carries: the API key as a bearer token, and the client's name."""
    out = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    return out + ((CLIENT_METADATA, client_id),) if client_id else out


class Client:
    """Blocking client. ``timeout`` (seconds) is the deadline of each call; ``api_key`` is sent with
    every call; ``tls`` opens a TLS channel (its ``ca`` to trust, its ``cert``/``key`` for mutual TLS);
    ``client_id`` names this client for the coordinator's fair queueing and per-client limits (by
    default it counts the API key, or else the peer address)."""

    def __init__(
        self, address: str, timeout: float | None = 300.0, *, api_key: str | None = None,
        tls: TlsClientConfig | None = None, client_id: str | None = None,
    ) -> None:
        options = channel_options(_MAX_BYTES)
        credentials = channel_credentials(tls)
        self._channel = (
            grpc.insecure_channel(address, options=options) if credentials is None
            else grpc.secure_channel(address, credentials, options=options)
        )
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._timeout = timeout
        self._metadata = _call_metadata(api_key, client_id)

    def complete(self, prompt: Prompt, *, timeout: float | None = None, **options) -> Completion:
        """Generates a whole answer; options are those of ``build_request``."""
        try:
            reply = self._stub.Complete(
                build_request(prompt, **options), timeout=timeout or self._timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return _completion(reply)

    def stream(self, prompt: Prompt, *, timeout: float | None = None, **options) -> Iterator[Chunk]:
        """Yields chunks as rounds commit tokens; the last carries the finish reason and stats."""
        try:
            for msg in self._stub.Generate(
                build_request(prompt, **options), timeout=timeout or self._timeout, metadata=self._metadata
            ):
                yield _chunk(msg)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def close(self) -> None:
        """Closes the channel."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client with the same calls and options as ``Client``."""

    def __init__(
        self, address: str, timeout: float | None = 300.0, *, api_key: str | None = None,
        tls: TlsClientConfig | None = None, client_id: str | None = None,
    ) -> None:
        self._channel = aio_channel(address, channel_options(_MAX_BYTES), channel_credentials(tls))
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._timeout = timeout
        self._metadata = _call_metadata(api_key, client_id)

    async def complete(self, prompt: Prompt, *, timeout: float | None = None, **options) -> Completion:
        """Generates a whole answer; options are those of ``build_request``."""
        try:
            reply = await self._stub.Complete(
                build_request(prompt, **options), timeout=timeout or self._timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return _completion(reply)

    async def stream(self, prompt: Prompt, *, timeout: float | None = None, **options) -> AsyncIterator[Chunk]:
        """Yields chunks as rounds commit tokens; the last carries the finish reason and stats."""
        try:
            async for msg in self._stub.Generate(
                build_request(prompt, **options), timeout=timeout or self._timeout, metadata=self._metadata
            ):
                yield _chunk(msg)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    async def close(self) -> None:
        """Closes the channel."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
