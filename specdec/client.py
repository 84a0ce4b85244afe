"""The Python client SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio) for the coordinator.

Both speak plaintext unless given ``tls=TlsClientConfig(...)``, and send ``api_key`` (when given) as
``authorization: Bearer <key>`` metadata on every call.

Given several coordinator addresses, a client rides out a coordinator that dies or drains: a call
that fails with UNAVAILABLE (or is cancelled by the server) is sent again to the next address, and a
stream that broke off resumes from the last token received, so the caller sees one unbroken answer,
the same one the first coordinator would have given.
"""

from __future__ import annotations

import asyncio
import json
import numbers
import operator
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from specdec.channels import aio_channel, channel_credentials, channel_options
from specdec.config import TlsClientConfig
from specdec.metadata import CLIENT_METADATA, RETRY_AFTER_METADATA
from specdec.sampling_params import TokenLogprob
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc
from specdec.wire import logprobs_from_pb

# None: the prompt is build_request's prompt_token_ids.
Prompt = str | list[dict[str, str]] | None


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


class Aborted(SpecdecError):
    """A later request on the same session took it over while this one ran (ABORTED)."""


_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: SessionNotFound,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.ABORTED: Aborted,
}

# Statuses after which the same request may go to another coordinator: it was not served, or its
# stream broke off and can be resumed.
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


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
    ahead_rounds: int
    judged_tokens: int
    tree_rounds: int = 0
    tree_nodes: int = 0
    accepted_at_depth: list[int] = field(default_factory=list)
    accepted_at_rank: list[int] = field(default_factory=list)
    tree_depths: int = 0
    tree_levels_judged: int = 0

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
    # With ``top_logprobs``: one per token of ``token_ids`` (the target's, see ``build_request``).
    logprobs: list[TokenLogprob] | None = None
    # The choice (0 to n - 1) the chunk belongs to; with n > 1 the choices' chunks interleave, and
    # each choice ends with its own chunk carrying ``finish_reason`` and ``stats``.
    index: int = 0


@dataclass(frozen=True)
class Completion:
    """A whole answer."""

    text: str
    token_ids: list[int]
    finish_reason: str
    session_id: str
    stats: Stats = field(repr=False)
    # With ``top_logprobs``: one per generated token.
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)
    # With n > 1: every choice in index order, each a Completion of its own session (the fields above
    # are choice 0's); empty with one choice.
    choices: list[Completion] = field(default_factory=list, repr=False)


def _stats(msg: coordinator_pb2.GenerationStats) -> Stats:
    values = {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}
    values["drafted_at_position"] = list(msg.drafted_at_position)
    values["accepted_at_position"] = list(msg.accepted_at_position)
    values["accepted_at_depth"] = list(msg.accepted_at_depth)
    values["accepted_at_rank"] = list(msg.accepted_at_rank)
    return Stats(**values)


def build_request(
    prompt: Prompt,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: str | list[str] | tuple[str, ...] = (),
    session_id: str | None = None,
    k: int | None = None,
    tree_nodes: int | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    response_format: Mapping[str, Any] | None = None,
    top_logprobs: int | None = None,
    n: int = 1,
) -> coordinator_pb2.GenerateRequest:
    """The wire request for a prompt: a ``str`` is plain text, a list of dicts is chat. With ``prompt``
    None, ``prompt_token_ids`` are the prompt, token ids taken as given (no template, no special tokens).

    Raises InvalidArgument, naming the field, for what the wire cannot carry (a wrong type, an
    integer outside its field's range); the coordinator checks the rest. ``stop`` may be one string.

    ``presence_penalty`` and ``frequency_penalty`` (OpenAI's, in [-2, 2], over this turn's output),
    ``repetition_penalty`` (vLLM's, in (0, 2]; None: off) and ``logit_bias`` (token id -> bias in
    [-100, 100]) transform the draft's and the target's logits alike, so speculation stays exact.

    ``response_format`` is OpenAI's object: ``{"type": "json_object"}``, ``{"type": "json_schema",
    "json_schema": {"schema": {...}, "strict": True}}`` or the extension ``{"type": "regex", "regex":
    "..."}``; the output then matches it, exactly as the constrained target alone would write it.

    ``top_logprobs`` (0 to 20) asks for each generated token's log probability under the target, from
    its own verify pass (before penalties, bias and sampling settings; never the draft's), with that
    many likeliest alternatives: ``Chunk.logprobs`` and ``Completion.logprobs``.

    ``n`` (1 to 64) asks for that many choices, each in a session of its own, choice i sampled as the
    same request with ``seed`` + i (unseeded, each draws its own seed); they share one prefill of the
    prompt. ``stream`` then yields every choice's chunks, each with its ``Chunk.index``, and ``complete``
    answers choice 0 with every choice in ``Completion.choices``. Several choices take no
    ``session_id``, and a stream of them is not resumed on another coordinator once a chunk arrived.
    """
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if response_format is not None and not isinstance(response_format, Mapping):
        raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "response_format: give a mapping (OpenAI's object)")
    _check_fields(
        prompt,
        stop,
        max_new_tokens=max_new_tokens,
        top_k=top_k,
        seed=seed,
        k=k,
        temperature=temperature,
        top_p=top_p,
        tree_nodes=tree_nodes,
        top_logprobs=top_logprobs,
        n=n,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        logit_bias=logit_bias,
    )
    request = coordinator_pb2.GenerateRequest(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop=stop,
        session_id=session_id or "",
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        logit_bias={int(t): float(b) for t, b in (logit_bias or {}).items()},
    )
    if repetition_penalty is not None:
        request.repetition_penalty = repetition_penalty
    if response_format is not None:
        request.response_format = json.dumps(response_format)
    if prompt_token_ids is not None:
        # The wire's int32; the coordinator checks the ids against its vocabulary.
        integers = all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt_token_ids)
        if not integers or not all(0 <= t < 2**31 for t in prompt_token_ids):
            raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: give integers in [0, 2**31)")
        request.prompt_token_ids.extend(int(t) for t in prompt_token_ids)
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.messages.messages.extend(
            coordinator_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt
        )
        # An empty list must still select the messages branch, so the server can name the problem.
        request.messages.SetInParent()
    if seed is not None:
        request.seed = seed
    if k is not None:
        request.k = k
    if tree_nodes is not None:
        request.tree_nodes = tree_nodes
    if top_logprobs is not None:
        request.top_logprobs = top_logprobs
    if n != 1:
        request.n = n
    return request


# The integer fields of a request and the range of each one's wire type.
_WIRE_INTS = {
    "max_new_tokens": (0, 2**32 - 1),
    "top_k": (-(2**31), 2**31 - 1),
    "seed": (0, 2**64 - 1),
    "k": (-(2**31), 2**31 - 1),
    "tree_nodes": (0, 2**32 - 1),
    "top_logprobs": (0, 2**32 - 1),
    "n": (1, 2**32 - 1),
}


def _check_fields(prompt: Prompt, stop: tuple, **fields) -> None:
    """Raises InvalidArgument for a field ``build_request`` could not put on the wire."""

    def invalid(details: str) -> InvalidArgument:
        return InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, details)

    if prompt is not None and not isinstance(prompt, str):
        if not isinstance(prompt, Sequence) or not all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        ):
            raise invalid("prompt: give a string, or a list of {'role': str, 'content': str} messages")
    if not all(isinstance(s, str) for s in stop):
        raise invalid("stop: give a string or a list of strings")
    for name, (lo, hi) in _WIRE_INTS.items():
        value = fields[name]
        # Anything that is an integer (numpy's too, through __index__), but not a bool.
        if value is not None and (
            isinstance(value, bool) or not hasattr(value, "__index__") or not lo <= operator.index(value) <= hi
        ):
            raise invalid(f"{name}: must be an integer in [{lo}, {hi}]")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = fields[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise invalid(f"{name}: must be a number")
    bias = fields["logit_bias"]
    if bias is not None and (
        not isinstance(bias, Mapping)
        or not all(
            isinstance(t, numbers.Integral)
            and not isinstance(t, bool)
            and 0 <= t < 2**31
            and isinstance(b, numbers.Real)
            and not isinstance(b, bool)
            for t, b in bias.items()
        )
    ):
        raise invalid("logit_bias: give a mapping of token ids in [0, 2**31) to numbers")


def _attempts(
    prompt: Prompt, options: dict, retry: RetryPolicy, timeout: float | None, default_timeout: float | None
) -> _Attempts:
    """A new request's attempts; ``timeout`` None takes the client's default (0 is a deadline now)."""
    return _Attempts(build_request(prompt, **options), retry, default_timeout if timeout is None else timeout)


@dataclass(frozen=True)
class RetryPolicy:
    """How a client retries a call whose coordinator went away: ``attempts`` calls in all, waiting
    ``backoff_s`` before the second, doubling up to ``max_backoff_s``."""

    attempts: int = 6
    backoff_s: float = 0.1
    max_backoff_s: float = 2.0

    def wait_s(self, attempt: int) -> float:
        """Seconds to wait before call number ``attempt + 1`` (``attempt`` counts from 1)."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))


class _Attempts:
    """One request's calls across coordinators: what it received so far, and what to send next.

    A resend names the session and how much of the stream arrived, so the coordinator continues the
    turn instead of starting it again. Before the first chunk of a new session arrives there is no
    session to name, and the request is simply sent again.
    """

    def __init__(self, request: coordinator_pb2.GenerateRequest, policy: RetryPolicy, timeout: float | None) -> None:
        self.request = request
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        self._policy = policy
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self.calls = 0
        self.tokens = 0
        self.chars = 0
        self.chunks = 0
        self.session_id = request.session_id

    def timeout(self) -> float | None:
        """What is left of the caller's deadline for the next call."""
        return None if self._deadline is None else max(0.001, self._deadline - time.monotonic())

    def received(self, msg: coordinator_pb2.GenerateChunk) -> None:
        """Counts a chunk the caller got."""
        self.session_id = msg.session_id or self.session_id
        self.tokens += len(msg.token_ids)
        self.chars += len(msg.text)
        self.chunks += 1

    def retry_after(self, exc: grpc.RpcError) -> float | None:
        """Seconds to wait before sending again, or None when ``exc`` must reach the caller. A stream of
        several choices that delivered a chunk is not resumed: its sessions cannot all be named."""
        self.calls += 1
        out_of_time = self._deadline is not None and time.monotonic() >= self._deadline
        if exc.code() not in _RETRYABLE or self.calls >= self._policy.attempts or out_of_time:
            return None
        if self.request.n > 1 and self.chunks:
            return None
        if self.session_id:
            self.request.session_id = self.session_id
            self.request.resume.tokens = self.tokens
            self.request.resume.text_chars = self.chars
        return self._policy.wait_s(self.calls)


def _addresses(address: str | Sequence[str]) -> list[str]:
    addresses = [address] if isinstance(address, str) else list(address)
    if not addresses:
        raise ValueError("address: give at least one coordinator address")
    return addresses


def _chunk(msg: coordinator_pb2.GenerateChunk) -> Chunk:
    return Chunk(
        text=msg.text,
        token_ids=list(msg.token_ids),
        session_id=msg.session_id,
        finish_reason=msg.finish_reason or None,
        stats=_stats(msg.stats) if msg.HasField("stats") else None,
        logprobs=logprobs_from_pb(msg.logprobs) or None,
        index=msg.index,
    )


def _completion(msg: coordinator_pb2.CompleteReply) -> Completion:
    return Completion(
        msg.text,
        list(msg.token_ids),
        msg.finish_reason,
        msg.session_id,
        _stats(msg.stats),
        logprobs_from_pb(msg.logprobs) or None,
        [_completion(choice) for choice in msg.choices],
    )


_MAX_BYTES = 8 * 1024 * 1024


def _call_metadata(api_key: str | None, client_id: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata every call carries: the API key as a bearer token, and the client's name."""
    out = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    return out + ((CLIENT_METADATA, client_id),) if client_id else out


class Client:
    """Blocking client.

    ``address`` is one coordinator address or several (tried in turn when one goes away, see
    ``retry``); ``timeout`` (seconds) is the deadline of each request, retries included; ``api_key``
    is sent with every call; ``tls`` opens a TLS channel (its ``ca`` to trust, its ``cert``/``key``
    for mutual TLS); ``client_id`` names this client for the coordinator's fair queueing and
    per-client limits (by default it counts the API key, or else the peer address).
    """

    def __init__(
        self,
        address: str | Sequence[str],
        timeout: float | None = 300.0,
        *,
        api_key: str | None = None,
        tls: TlsClientConfig | None = None,
        client_id: str | None = None,
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        options = channel_options(_MAX_BYTES)
        credentials = channel_credentials(tls)
        self._channels = [
            grpc.insecure_channel(a, options=options)
            if credentials is None
            else grpc.secure_channel(a, credentials, options=options)
            for a in _addresses(address)
        ]
        self._stubs = [coordinator_pb2_grpc.CoordinatorStub(c) for c in self._channels]
        # The coordinator that answered last; a failure moves on to the next.
        self._current = 0
        self._timeout = timeout
        self._metadata = _call_metadata(api_key, client_id)
        self._retry = retry

    def _stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        return self._stubs[self._current % len(self._stubs)]

    def _wait(self, attempts: _Attempts, exc: grpc.RpcError) -> None:
        pause = attempts.retry_after(exc)
        if pause is None:
            raise _error(exc) from None
        self._current += 1
        time.sleep(pause)

    def complete(self, prompt: Prompt, *, timeout: float | None = None, **options) -> Completion:
        """Generates a whole answer; options are those of ``build_request``."""
        attempts = _attempts(prompt, options, self._retry, timeout, self._timeout)
        while True:
            try:
                reply = self._stub().Complete(attempts.request, timeout=attempts.timeout(), metadata=self._metadata)
                return _completion(reply)
            except grpc.RpcError as exc:
                self._wait(attempts, exc)

    def stream(self, prompt: Prompt, *, timeout: float | None = None, **options) -> Iterator[Chunk]:
        """Yields chunks as rounds commit tokens; the last carries the finish reason and stats."""
        attempts = _attempts(prompt, options, self._retry, timeout, self._timeout)
        while True:
            try:
                for msg in self._stub().Generate(attempts.request, timeout=attempts.timeout(), metadata=self._metadata):
                    attempts.received(msg)
                    yield _chunk(msg)
                return
            except grpc.RpcError as exc:
                self._wait(attempts, exc)

    def close(self) -> None:
        """Closes the channels."""
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client with the same calls and options as ``Client``."""

    def __init__(
        self,
        address: str | Sequence[str],
        timeout: float | None = 300.0,
        *,
        api_key: str | None = None,
        tls: TlsClientConfig | None = None,
        client_id: str | None = None,
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        credentials = channel_credentials(tls)
        self._channels = [aio_channel(a, channel_options(_MAX_BYTES), credentials) for a in _addresses(address)]
        self._stubs = [coordinator_pb2_grpc.CoordinatorStub(c) for c in self._channels]
        self._current = 0
        self._timeout = timeout
        self._metadata = _call_metadata(api_key, client_id)
        self._retry = retry

    def _stub(self) -> coordinator_pb2_grpc.CoordinatorStub:
        return self._stubs[self._current % len(self._stubs)]

    async def _wait(self, attempts: _Attempts, exc: grpc.RpcError) -> None:
        pause = attempts.retry_after(exc)
        if pause is None:
            raise _error(exc) from None
        self._current += 1
        await asyncio.sleep(pause)

    async def complete(self, prompt: Prompt, *, timeout: float | None = None, **options) -> Completion:
        """Generates a whole answer; options are those of ``build_request``."""
        attempts = _attempts(prompt, options, self._retry, timeout, self._timeout)
        while True:
            try:
                reply = await self._stub().Complete(
                    attempts.request, timeout=attempts.timeout(), metadata=self._metadata
                )
                return _completion(reply)
            except grpc.RpcError as exc:
                await self._wait(attempts, exc)

    async def stream(self, prompt: Prompt, *, timeout: float | None = None, **options) -> AsyncIterator[Chunk]:
        """Yields chunks as rounds commit tokens; the last carries the finish reason and stats."""
        attempts = _attempts(prompt, options, self._retry, timeout, self._timeout)
        while True:
            try:
                async for msg in self._stub().Generate(
                    attempts.request, timeout=attempts.timeout(), metadata=self._metadata
                ):
                    attempts.received(msg)
                    yield _chunk(msg)
                return
            except grpc.RpcError as exc:
                await self._wait(attempts, exc)

    async def close(self) -> None:
        """Closes the channels."""
        await asyncio.gather(*(c.close() for c in self._channels))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
