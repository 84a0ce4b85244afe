"""The coordinator's OpenAI-compatible HTTP face: /v1/models, /v1/completions, /v1/chat/completions,
/v1/responses.

An aiohttp app over the same round loop, admission and API keys as the gRPC servicer: a request is
parsed (``coordinator.openai_schema``), admitted under the caller's identity, run by
``RoundLoop.generate`` and answered as one JSON body or as server-sent events ending in
``data: [DONE]``. Failures before the first token get their HTTP status (400, 401, 404, 429 with
Retry-After, 503) in OpenAI's error shape; a failure later in a stream is sent as an ``error`` event.
With allowed origins configured, browsers get CORS: preflights are answered without an API key, and
every response names the allowed origin.
A client that disconnects cancels its handler, which closes the round loop's generator and so frees
its admission slot and its session's lease at once.

A request with several choices (``n`` > 1, or several prompts) runs each choice as a turn of its own,
side by side, each on its own session with its own admission slot; the choices of one prompt share
its prefill (``coordinator.choices``: the first choice's caches are forked for the others). The answer
(or the stream's first byte) waits until every choice has its first chunk, so that a refusal of any
of them is the request's status.

Chat requests are stateless, but a request whose messages extend a conversation this coordinator
served continues that conversation's session (``coordinator.openai_sessions``), so its caches
keep the shared prefix. The whole conversation is rendered afresh, exactly as for a new session:
the session's record holds the answer as generated, which can differ from the message a client
sends back (tool calls). With tools, each choice's output is split into content and tool calls
(``coordinator.tools``), streamed or whole. With completions' ``echo`` each choice's prompt leads its
text (a stream's first chunk), with the prompt logprobs the round loop's first chunk brings from the
target's prefill when logprobs are asked for. /v1/responses runs as the chat request it translates
to (``coordinator.openai_responses``), answered in the Responses API's shapes
(``coordinator.openai_responses_output``). docs/openai.md
documents the endpoints, the statuses and the ``specdec`` field.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import ssl
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, fields, replace

import grpc
from aiohttp import web
from opentelemetry import propagate, trace

from coordinator.admission import Admission, Overloaded
from coordinator.auth import ApiKeyInterceptor, bearer_token
from coordinator.choices import ChoiceRuns, share_prefills
from coordinator.identity import Caller, caller_of
from coordinator.openai_responses import parse_responses, responses_error
from coordinator.openai_responses_output import ResponseBuilder, sse_event
from coordinator.openai_schema import (
    Answer,
    ApiError,
    ApiRequest,
    Echo,
    Shaper,
    context_length_exceeded,
    parse_request,
)
from coordinator.openai_sessions import Conversations
from coordinator.rounds import RoundLoop
from coordinator.server import _BACKEND_RETRY_MS, _status
from coordinator.tools import Segment, ToolCall, assistant_message, split_tool_calls
from coordinator.turns import Chunk, ContextOverflow, GenerationRequest, SessionNotFound
from specdec.config import CoordinatorConfig, ServerConfig
from specdec.rpc import RunningServer
from specdec.sampling_params import TokenLogprob
from specdec.vocab import DEFAULT_MODEL, ModelFacts

log = logging.getLogger(__name__)

# The id /v1/models lists for the embedded default target, as clients know it from Hugging Face.
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# HTTP status, OpenAI error type and code of each gRPC status the core's failures map to.
_HTTP_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "invalid_request_error", "conflict"),
    grpc.StatusCode.ABORTED: (409, "invalid_request_error", "conflict"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "backend_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}
_SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}
# What a CORS preflight is told: the API's methods, and the headers an OpenAI client sends (more
# when the preflight asks for them; the origin is what is checked). Browsers cache the answer.
_CORS_METHODS = "GET, POST, OPTIONS"
_CORS_HEADERS = ("Authorization", "Content-Type")
_CORS_MAX_AGE_S = 600


def model_id(facts: ModelFacts) -> str:
    """The id the served model goes by: the target's model spec, the default one by its HF name."""
    return DEFAULT_MODEL_ID if facts.name == DEFAULT_MODEL else facts.name


def api_error(exc: Exception) -> ApiError:
    """The OpenAI error a failure of a request maps to (statuses as the gRPC servicer's)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, Overloaded):
        return ApiError(429, str(exc), "rate_limit_error", code="rate_limit_exceeded", retry_after_s=exc.retry_after_s)
    code, detail = _status(exc)  # logs what it does not know
    status, kind, name = _HTTP_OF.get(code, (500, "server_error", "internal_error"))
    retry = _BACKEND_RETRY_MS / 1000 if status == 429 else None
    # A format the grammar engine refused when the turn opened (``Turns.check_format``) names its parameter.
    param = next((p for p in ("response_format", "tools") if status == 400 and detail.startswith(p + ":")), None)
    return ApiError(status, detail, kind, param=param, code=name, retry_after_s=retry)


def error_response(error: ApiError) -> web.Response:
    """An error as OpenAI answers it, with Retry-After (whole seconds) on a 429."""
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return web.json_response(error.body(), status=error.status, headers=headers)


def _no_deadline() -> None:
    return None


def _overflows_context(exc: BaseException | None) -> bool:
    """Whether the core refused the prompt for not fitting the context (it knows only once the turn is
    tokenized on top of its session's history)."""
    return isinstance(exc, ContextOverflow)


def _sse(data: dict | str) -> bytes:
    return b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"


class OpenAiApi:
    """The handlers, over one coordinator's round loop and admission."""

    def __init__(
        self,
        loop: RoundLoop,
        facts: ModelFacts,
        admission: Admission,
        tracer: trace.Tracer,
        api_key_hashes: tuple[str, ...] = (),
        session_ttl_s: float = 3600.0,
        served_model_names: tuple[str, ...] = (),
        allowed_origins: tuple[str, ...] = (),
    ) -> None:
        self._loop = loop
        self.model_id = model_id(facts)
        # The served model's own id first, then its aliases: each is accepted and listed.
        self.model_ids = tuple(dict.fromkeys((self.model_id, *served_model_names)))
        self._origins = frozenset(allowed_origins)
        self._max_context = facts.max_context
        self._vocab_size = facts.vocab_size
        self._admission = admission
        self._tracer = tracer
        self._keys = ApiKeyInterceptor(api_key_hashes) if api_key_hashes else None
        self.conversations = Conversations(session_ttl_s)
        # Set when the server drains: health answers 503 and new requests are refused.
        self.draining = False

    def app(self, max_body_bytes: int) -> web.Application:
        """The aiohttp application."""
        # CORS comes before auth, so a preflight (which never carries the key) is answered; with no
        # allowed origins it lets everything through untouched.
        middlewares = [self._traced, self._cors, _errors, self._auth]
        app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
        # Streams send their headers from the handler, before a middleware sees the response.
        app.on_response_prepare.append(self._allow_origin)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/responses", self.responses)
        return app

    # --- middlewares -------------------------------------------------------------------------

    @web.middleware
    async def _traced(self, request: web.Request, handler) -> web.StreamResponse:
        """A SERVER span per request, parented on the caller's traceparent; the round loop's
        ``specdec.generate`` span is its child."""
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else ""  # "": no route matched
        attributes = {
            "http.request.method": request.method,
            "http.route": route,
            "url.path": request.path,
            "url.scheme": request.scheme,
            "client.address": request.remote or "",
            "user_agent.original": request.headers.get("User-Agent", ""),
        }
        caller_context = propagate.extract(request.headers)
        with self._tracer.start_as_current_span(
            f"{request.method} {route}".strip(),
            context=caller_context,
            kind=trace.SpanKind.SERVER,
            attributes=attributes,
        ) as span:
            response = await handler(request)
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:
                span.set_status(trace.StatusCode.ERROR)
            return response

    def _allowed(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin value for a request from ``origin``, or None."""
        if origin is None:
            return None
        if "*" in self._origins:
            return "*"
        return origin if origin in self._origins else None

    @web.middleware
    async def _cors(self, request: web.Request, handler) -> web.StreamResponse:
        """Answers a CORS preflight from an allowed origin with 204, before (and without) the API key."""
        allowed = self._allowed(request.headers.get("Origin"))
        if request.method != "OPTIONS" or allowed is None or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        asked = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",") if h.strip()]
        headers = dict.fromkeys([*_CORS_HEADERS, *asked], None)
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Methods": _CORS_METHODS,
                "Access-Control-Allow-Headers": ", ".join(headers),
                "Access-Control-Max-Age": str(_CORS_MAX_AGE_S),
            },
        )

    async def _allow_origin(self, request: web.Request, response: web.StreamResponse) -> None:
        """Names an allowed origin on every response (streams and errors included), so its page may read it."""
        allowed = self._allowed(request.headers.get("Origin"))
        if allowed is None:
            return
        response.headers["Access-Control-Allow-Origin"] = allowed
        # A browser hides every other header from the page unless named; Retry-After paces its retries.
        response.headers["Access-Control-Expose-Headers"] = "Retry-After"
        if allowed != "*":
            response.headers.add("Vary", "Origin")

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        """The API's endpoints take ``Authorization: Bearer <key>`` when keys are configured; health is open."""
        if self._keys is not None and request.path.startswith("/v1/"):
            token = bearer_token(request.headers.get("Authorization", ""))
            if token is None:
                raise ApiError(
                    401, "missing API key: send the header 'Authorization: Bearer <key>'", code="missing_api_key"
                )
            if not self._keys.allows(token):
                raise ApiError(401, "invalid API key", code="invalid_api_key")
        if self.draining and request.path != "/health":
            raise ApiError(503, "the coordinator is shutting down", "server_error", code="unavailable")
        return await handler(request)

    # --- endpoints ---------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 while serving, 503 while draining (readiness probes)."""
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ok"})

    @staticmethod
    def _model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "specdec"}

    async def models(self, request: web.Request) -> web.Response:
        """The model this coordinator serves, once under each name it answers to (its own id first)."""
        return web.json_response({"object": "list", "data": [self._model_card(name) for name in self.model_ids]})

    async def model(self, request: web.Request) -> web.Response:
        """One model by id or alias, or 404."""
        name = request.match_info["model"]
        if name not in self.model_ids:
            raise ApiError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return web.json_response(self._model_card(name))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions: plain text, no chat template."""
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions: messages rendered with the tokenizer's chat template."""
        return await self._generate(request, chat=True)

    # --- generation --------------------------------------------------------------------------

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/responses: OpenAI's Responses API, run as the chat request it translates to
        (``coordinator.openai_responses``), answered as a response object or its events."""
        parsed = parse_responses(await _json_body(request), self.model_ids, self._max_context, self._vocab_size)
        caller = _caller(request)
        core = replace(parsed.chat.choices[0], client=caller.client, owner=caller.owner)
        runs = ChoiceRuns([self._chunks(core, caller)])
        stream = web.StreamResponse(headers=_SSE_HEADERS) if parsed.stream else None
        try:
            try:
                chunk = (await _next(runs))[1]
            except ApiError as error:
                raise responses_error(self._refusal(error, chat=True), parsed.origins) from error.__cause__
            built = ResponseBuilder(parsed)
            events = built.start()
            if stream is not None:
                await stream.prepare(request)
            try:
                while True:
                    events += built.feed(chunk.text, chunk.finish_reason, chunk.stats)
                    if stream is not None and events:
                        await stream.write(b"".join(sse_event(event) for event in events))
                    events = []
                    if chunk.finish_reason is not None:
                        break
                    chunk = (await _next(runs))[1]
            except ApiError as error:
                # Named as the Responses API names its parameters, whole or streamed.
                renamed = responses_error(error, parsed.origins)
                if stream is None:
                    raise renamed from error.__cause__
                trace.get_current_span().set_status(trace.StatusCode.ERROR, renamed.message)
                await stream.write(b"".join(sse_event(event) for event in built.fail(renamed)))
            else:
                self._remember(core, caller, built.content, built.calls, chunk)
        finally:
            await runs.close()
        if stream is None:
            return web.json_response(built.response())
        await stream.write_eof()
        return stream

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await _json_body(request)
        api = parse_request(body, chat, self.model_ids, self._max_context, self._vocab_size)
        caller = _caller(request)
        # The choices of each prompt share its prefill (``coordinator.choices``).
        cores = share_prefills([replace(core, client=caller.client, owner=caller.owner) for core in api.choices], api.n)
        runs = ChoiceRuns([self._chunks(core, caller) for core in cores])
        try:
            # Every choice's first chunk (or refusal) before answering: a refusal is the request's status.
            firsts: list[tuple[int, Chunk]] = []
            while len(firsts) < len(cores):
                try:
                    firsts.append(await _next(runs))
                except ApiError as error:
                    raise self._refusal(error, chat) from error.__cause__
            if api.stream:
                return await self._stream(request, api, cores, caller, firsts, runs)
            texts: list[list[str]] = [[] for _ in cores]
            ids: list[list[int]] = [[] for _ in cores]
            logprobs: list[list[TokenLogprob] | None] = [[] for _ in cores]
            lasts: list[Chunk | None] = [None] * len(cores)
            echoes = [self._echo(core) if api.echo else None for core in cores]
            queued = iter(firsts)
            while any(last is None for last in lasts):
                index, chunk = next(queued, None) or await _next(runs)
                if chunk.prompt_token_ids is not None:
                    echoes[index] = scored_echo(echoes[index], chunk)
                    continue
                texts[index].append(chunk.text)
                ids[index] += chunk.token_ids
                held = logprobs[index]
                logprobs[index] = None if held is None or chunk.logprobs is None else held + chunk.logprobs
                if chunk.finish_reason is not None:
                    lasts[index] = chunk
        finally:
            await runs.close()
        answers = []
        for core, pieces, token_ids, last, entries, echo in zip(
            cores, texts, ids, lasts, logprobs, echoes, strict=True
        ):
            assert last is not None and last.stats is not None and last.finish_reason is not None
            text, calls = "".join(pieces), list[ToolCall]()
            if api.tools is not None and api.parses_tools:
                text, calls = split_tool_calls(text, api.tools)
            self._remember(core, caller, text, calls, last)
            finish = "tool_calls" if calls else last.finish_reason
            answers.append(Answer(text, token_ids, finish, last.stats, entries, calls, echo))
        return web.json_response(self._shaper(api).response(answers))

    def _shaper(self, api: ApiRequest) -> Shaper:
        """The request's response builder; it names tokens by their text when logprobs are asked for."""
        wants_logprobs = any(core.top_logprobs is not None for core in api.choices)
        return Shaper(api, self._loop.token_text if wants_logprobs else None)

    def _echo(self, core: GenerationRequest) -> Echo:
        """A completions choice's echoed prompt, as given: its text, or its token ids decoded."""
        if core.text is not None:
            return Echo(core.text)
        return Echo(self._loop.decode(core.prompt_token_ids or ()))

    def _refusal(self, error: ApiError, chat: bool) -> ApiError:
        """A choice's failure before its first chunk, as the request's error. The core measures the
        prompt only once it is tokenized: this is where a context overflow shows."""
        if not _overflows_context(error.__cause__):
            return error
        param = "messages" if chat else "prompt"
        detail = str(error.__cause__).removeprefix("prompt: ")
        subject = "your messages do" if chat else "your prompt does"
        return context_length_exceeded(self._max_context, param, f"{subject} not fit ({detail})")

    async def _stream(
        self,
        request: web.Request,
        api: ApiRequest,
        cores: list[GenerationRequest],
        caller: Caller,
        firsts: list[tuple[int, Chunk]],
        runs: ChoiceRuns,
    ) -> web.StreamResponse:
        """Server-sent events: a choice's released text and tool calls in the order written
        (``_stream_chunks``), each choice's finish chunk with its ``specdec`` stats, the usage chunk
        when asked for, then ``[DONE]``."""
        shaper = self._shaper(api)
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        if api.chat:
            for index in range(len(cores)):
                await response.write(_sse(shaper.role_chunk(index)))
        texts: list[list[str]] = [[] for _ in cores]
        lasts: list[Chunk | None] = [None] * len(cores)
        # With echo: each choice's prompt goes out first, alone (with its logprobs when asked for).
        echoes = [self._echo(core) if api.echo else None for core in cores]
        # With tools: text that may open a call is held back; calls go out whole as they close.
        splits = [api.tools.splitter() if api.tools is not None and api.parses_tools else None for _ in cores]
        queued = iter(firsts)
        try:
            while any(last is None for last in lasts):
                index, chunk = next(queued, None) or await _next(runs)
                echo = echoes[index]
                if echo is not None:
                    echoes[index] = None
                    if chunk.prompt_token_ids is not None:
                        await response.write(_sse(shaper.echo_chunk(index, scored_echo(echo, chunk))))
                        continue
                    await response.write(_sse(shaper.echo_chunk(index, echo)))
                if chunk.prompt_token_ids is not None:
                    continue  # prompt logprobs nobody echoes
                split, finish = splits[index], chunk.finish_reason
                if split is None:
                    segments: list[Segment] = [chunk.text] if chunk.text else []
                else:
                    segments = split.feed(chunk.text, end=finish is not None)
                    finish = "tool_calls" if finish is not None and split.calls else finish
                texts[index] += [segment for segment in segments if isinstance(segment, str)]
                if finish is not None:
                    lasts[index] = chunk
                for piece in _stream_chunks(shaper, api, index, chunk, segments, finish):
                    await response.write(_sse(piece))
            if api.include_usage:
                await response.write(_sse(shaper.usage_chunk([last.stats for last in lasts if last and last.stats])))
        except ApiError as error:
            # Headers went out with 200: the failure travels as an event, as OpenAI's servers send it.
            trace.get_current_span().set_status(trace.StatusCode.ERROR, error.message)
            await response.write(_sse(error.body()))
        else:
            for core, text, last, split in zip(cores, texts, lasts, splits, strict=True):
                assert last is not None
                self._remember(core, caller, "".join(text), [] if split is None else split.calls, last)
        await response.write(_sse("[DONE]"))
        await response.write_eof()
        return response

    def _run(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        # Closed, the round loop's generator ends its turn at once.
        return self._loop.generate(request, _no_deadline)

    async def _chunks(self, core: GenerationRequest, caller: Caller) -> AsyncGenerator[Chunk, None]:
        """The request's chunks under an admission slot, continuing the session of the conversation
        it extends when there is one; a session gone from the store is started afresh."""
        async with self._admission.slot(caller.client):
            request = core
            if core.messages is not None:
                found = self.conversations.take(caller.client, core.messages)
                if found is not None:
                    request = replace(core, session_id=found[0], whole_conversation=True)
            streamed = False
            try:
                async with aclosing(self._run(request)) as chunks:
                    async for chunk in chunks:
                        streamed = True
                        yield chunk
                return
            except SessionNotFound:
                if request is core or streamed:
                    raise
                log.info("session of a continued conversation is gone; starting a new one")
            async with aclosing(self._run(core)) as chunks:
                async for chunk in chunks:
                    yield chunk

    def _remember(self, core: GenerationRequest, caller: Caller, text: str, calls: list[ToolCall], last: Chunk) -> None:
        """Notes which session now holds a served chat conversation, answer included, as the client
        sends it back: its content and its tool calls."""
        if core.messages is not None:
            conversation = [*core.messages, assistant_message(text, calls)]
            self.conversations.put(caller.client, conversation, last.session_id)


def scored_echo(echo: Echo | None, chunk: Chunk) -> Echo | None:
    """``echo`` with the prompt tokens and logprobs a prompt chunk (``Chunk.prompt_token_ids``) carries."""
    if echo is None:
        return None
    return replace(echo, token_ids=chunk.prompt_token_ids or (), logprobs=chunk.prompt_logprobs)


def _stream_chunks(
    shaper: Shaper, api: ApiRequest, index: int, chunk: Chunk, segments: list[Segment], finish: str | None
) -> list[dict]:
    """Choice ``index``'s stream chunks for one round-loop ``chunk`` that released ``segments``: in
    written order, each text and each run of calls a chunk of its own, so a client sees text after a
    call after it however the round loop cut the output. The last carries the chunk's token ids and
    logprobs, and ``finish`` with the stats; a chunk that releases nothing is sent only when it
    finishes or has tokens to report."""
    deltas: list[tuple[str, list[ToolCall]]] = []
    for segment in segments:
        if isinstance(segment, str):
            deltas.append((segment, []))
        elif deltas and not deltas[-1][0]:  # texts are never empty: this one holds calls
            deltas[-1][1].append(segment)
        else:
            deltas.append(("", [segment]))
    *before, (text, calls) = deltas or [("", [])]
    no_logprobs = None if chunk.logprobs is None else []
    out = [shaper.chunk(index, t, [], logprobs=no_logprobs, tool_calls=c) for t, c in before]
    if finish is not None:
        assert chunk.stats is not None
        out.append(shaper.chunk(index, text, chunk.token_ids, finish, chunk.stats, chunk.logprobs, calls))
    elif text or calls or chunk.logprobs or (api.return_token_ids and chunk.token_ids):
        out.append(shaper.chunk(index, text, chunk.token_ids, logprobs=chunk.logprobs, tool_calls=calls))
    return out


async def _next(runs: ChoiceRuns) -> tuple[int, Chunk]:
    """The next chunk of any choice, with its index; a failure becomes the ApiError it maps to."""
    try:
        return await runs.next()
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure reaches the client in OpenAI's shape
        raise api_error(exc) from exc


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure as an OpenAI error body with its status, never a traceback."""
    try:
        return await handler(request)
    except ApiError as error:
        return error_response(error)
    except web.HTTPException as exc:  # no such route (404), method (405), a body over the limit (413)
        if exc.status < 400:
            raise
        return error_response(ApiError(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_")))
    except Exception as exc:  # noqa: BLE001
        return error_response(api_error(exc))


async def _json_body(request: web.Request) -> object:
    """The request's body, parsed as JSON; a 400 when it is not."""
    try:
        return json.loads(await request.read())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None


def _caller(request: web.Request) -> Caller:
    """The proven identity of a request (as ``coordinator.server.caller_from`` for gRPC): its API key,
    else its client certificate's names, else its peer host."""
    bearer = bearer_token(request.headers.get("Authorization", ""))
    certificate = None
    peer_cert = request.transport.get_extra_info("peercert") if request.transport is not None else None
    if peer_cert:
        names = [value for _, value in peer_cert.get("subjectAltName", ())]
        if not names:
            names = [value for rdn in peer_cert.get("subject", ()) for key, value in rdn if key == "commonName"]
        certificate = ",".join(names) or None
    return caller_of(bearer, certificate, request.remote or "")


def server_ssl_context(config: ServerConfig) -> ssl.SSLContext | None:
    """TLS as the gRPC port serves it (demanding a client certificate when a client CA is set), or None."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_client_ca is not None:
        context.load_verify_locations(cafile=str(config.tls_client_ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


@dataclass
class HttpServer:
    """A started HTTP server: its API, runner and bound port."""

    api: OpenAiApi
    runner: web.AppRunner
    port: int
    tls: bool

    async def stop(self) -> None:
        """Refuses new requests and gives running ones the grace period (the runner's shutdown timeout)."""
        self.api.draining = True
        await self.runner.cleanup()


async def start_http(
    loop: RoundLoop, config: CoordinatorConfig, facts: ModelFacts, admission: Admission, tracer: trace.Tracer
) -> HttpServer:
    """Serves the OpenAI API on ``config.server.host``:``config.http_port`` (0: a free port), over TLS
    when the gRPC port has it, with the same admission and API keys."""
    if config.http_port is None:
        raise ValueError("start_http needs config.http_port")
    api = OpenAiApi(
        loop,
        facts,
        admission,
        tracer,
        config.api_key_hashes,
        config.session_ttl_s,
        config.served_model_names,
        config.allowed_origins,
    )
    # handler_cancellation: a client that disconnects cancels its handler, which frees its slot at once.
    runner = web.AppRunner(
        api.app(config.server.max_message_bytes),
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=config.server.grace_s,
    )
    await runner.setup()
    context = server_ssl_context(config.server)
    site = web.TCPSite(runner, config.server.host, config.http_port, ssl_context=context)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    port = runner.addresses[0][1]
    log.info("OpenAI API on %s://%s:%d", "https" if context else "http", config.server.host, port)
    return HttpServer(api, runner, port, context is not None)


@dataclass
class CoordinatorServers(RunningServer):
    """The gRPC server with the HTTP one beside it: both drain on stop."""

    http: HttpServer | None = None

    @classmethod
    def beside(cls, running: RunningServer, http: HttpServer) -> CoordinatorServers:
        """``running`` with ``http`` beside it."""
        return cls(**{f.name: getattr(running, f.name) for f in fields(RunningServer)}, http=http)

    async def stop(self, grace_s: float) -> None:
        """Both servers go unready together; in-flight calls and streams get the grace period."""
        if self.http is None:
            await super().stop(grace_s)
        else:
            await asyncio.gather(super().stop(grace_s), self.http.stop())
