"""The OpenAI API's request and response bodies: parsing a request into a ``GenerationRequest``, and
shaping chunks and stats into completions, chat completions and their stream chunks.

Pure functions over JSON values, with no HTTP in them: ``coordinator.openai_api`` serves them. A
request that no exact generation can serve is refused with an ``ApiError`` naming the parameter,
never silently approximated: an unsupported parameter set to anything but its neutral value (for
example ``logprobs``, ``presence_penalty``, ``n`` above 1) is a 400.

Where OpenAI's conventions and exactness do not clash, the parsing is as lenient as OpenAI's own
clients expect: ``model`` may be omitted or name an alias, ``seed`` is any int64 (-1: none), and a
prompt past the context is a 400 with ``code: "context_length_exceeded"``.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from coordinator.server import MAX_STOP_CHARS, MAX_STOP_STRINGS
from coordinator.turns import GenerationRequest, Stats
from specdec.sampling_params import check_sampling

# OpenAI's default for /v1/completions when max_tokens is absent; chat runs to the context's end.
COMPLETION_DEFAULT_MAX_TOKENS = 16
# Message roles the chat template knows; OpenAI's newer "developer" role is its system prompt.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Parameters specdec does not implement, with the value that asks for nothing (absent is fine too).
_NEUTRAL = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}
# The finish reasons of the round loop, as OpenAI names them: the context's end is a length limit too.
FINISH_REASON = {"stop": "stop", "length": "length", "context": "length"}


class ApiError(Exception):
    """A request refused in OpenAI's error shape: HTTP ``status``, ``type``, ``param`` and ``code``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        """``{"error": {message, type, param, code}}``, as OpenAI answers."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str | None = None) -> ApiError:
    """A 400 naming ``param``."""
    return ApiError(400, f"{param}: {message}" if param else message, param=param, code=code)


def context_length_exceeded(max_context: int, param: str, detail: str) -> ApiError:
    """The 400 OpenAI answers for a request past the model's context. litellm and LangChain know a
    context overflow by its code, and litellm also by the message's opening words, so both are OpenAI's."""
    return ApiError(
        400,
        f"This model's maximum context length is {max_context} tokens. However, {detail}.",
        param=param,
        code="context_length_exceeded",
    )


@dataclass(frozen=True)
class ApiRequest:
    """A parsed request: the core request (without its client), and how to answer it."""

    core: GenerationRequest
    chat: bool
    stream: bool
    include_usage: bool
    model: str
    # vLLM's extension: each choice (and stream chunk) also carries its ``token_ids``.
    return_token_ids: bool = False


def parse_request(body: Any, chat: bool, model_ids: tuple[str, ...], max_context: int) -> ApiRequest:
    """Checks a /v1/completions (``chat`` False) or /v1/chat/completions body and builds the request.

    ``model_ids`` are the names the served model answers to, its own id first; the response names
    that first one whichever the request used (or when it named none).

    Raises ApiError: 400 for wrong types and values, 404 (``model_not_found``) for another model.
    """
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    model = _typed(body, "model", str)
    if model is not None and model not in model_ids:
        raise ApiError(
            404,
            f"The model '{model}' does not exist; this server serves '{model_ids[0]}' (GET /v1/models)",
            param="model",
            code="model_not_found",
        )
    for name, neutral in _NEUTRAL.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) for v in neutral):
            raise invalid(name, "not supported by this server", "unsupported_parameter")
    if body.get("tool_choice") is not None and not body.get("tools"):
        # OpenAI refuses it too; accepting it would promise a tool call that can never come.
        raise invalid("tool_choice", "only allowed when tools are given")
    n = _typed(body, "n", int)
    if n is not None and n != 1:
        raise invalid("n", f"only n = 1 is supported, not {n}", "unsupported_parameter")
    _typed(body, "user", str)  # accepted; the client identity comes from the request (see openai_api)
    text = messages = None
    if chat:
        messages = parse_messages(body.get("messages"))
    else:
        text = _prompt(body.get("prompt"))
    max_tokens = _typed(body, "max_completion_tokens", int) if chat else None
    if max_tokens is None:
        max_tokens = _typed(body, "max_tokens", int)
    if max_tokens is None:
        max_tokens = max_context if chat else COMPLETION_DEFAULT_MAX_TOKENS
    param = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    if max_tokens < 1:
        raise invalid(param, "must be at least 1")
    if max_tokens > max_context:
        raise context_length_exceeded(max_context, param, f"{param} asks for {max_tokens} tokens")
    temperature = _number(body, "temperature", 1.0)
    if not 0 <= temperature <= 2:
        raise invalid("temperature", "must lie in [0, 2]")
    stream = bool(_typed(body, "stream", bool))
    options = _typed(body, "stream_options", dict)
    if options is not None and not stream:
        raise invalid("stream_options", "only allowed with stream: true")
    include_usage = bool(_typed(options or {}, "include_usage", bool, "stream_options."))
    seed = _seed(_typed(body, "seed", int))
    # top_k is not OpenAI's, but vLLM and llama.cpp take it; 0 keeps every token.
    top_k, top_p = _typed(body, "top_k", int) or 0, _number(body, "top_p", 1.0)
    try:
        check_sampling(temperature, top_k, top_p)
    except ValueError as exc:
        param, _, message = str(exc).partition(": ")
        raise invalid(param, message) from None
    core = GenerationRequest(
        text=text,
        messages=messages,
        max_new_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=_stop(body.get("stop")),
        fingerprint=hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:32],
    )
    return ApiRequest(core, chat, stream, include_usage, model_ids[0], bool(_typed(body, "return_token_ids", bool)))


def _seed(seed: int | None) -> int | None:
    """OpenAI's int64 ``seed`` as the core's unsigned 64-bit one. -1 is what llama.cpp and many
    clients send for "random", so it asks for no seed; any other negative keeps its two's-complement
    bits (as a C client would send it over gRPC), so each int64 names one seed and [0, 2**63) is unchanged."""
    if seed is None or seed == -1:
        return None
    if not -(2**63) <= seed < 2**63:
        raise invalid("seed", "must be a 64-bit signed integer, in [-2**63, 2**63)")
    return seed % 2**64


def parse_messages(value: Any) -> list[dict[str, str]]:
    """Chat messages as the template takes them: role and text content. A content given as parts
    must be text parts, joined."""
    if not isinstance(value, list) or not value:
        raise invalid("messages", "must be a non-empty array of messages")
    messages = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, "must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise invalid(f"{where}.content", "only text parts ({type: text, text: ...}) are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise invalid(f"{where}.content", "must be a string or an array of text parts")
        messages.append({"role": ROLES[role], "content": content})
    return messages


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise invalid("prompt", "must be a string or an array of one string (token ids and batches are not supported)")
    if not value:
        raise invalid("prompt", "is empty")
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "must be a string or an array of strings")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        # Every round searches the new text for each of them, on the loop that serves every request.
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each")
    return tuple(stops)


_TYPE_NAMES = {str: "a string", int: "an integer", bool: "a boolean", dict: "an object"}


def _typed(body: dict, name: str, kind: type, prefix: str = "") -> Any:
    """``body[name]`` when it is of ``kind`` (bool is no integer here), None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise invalid(prefix + name, f"must be {_TYPE_NAMES[kind]}, not {json.dumps(value)[:40]}")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(name, f"must be a number, not {json.dumps(value)[:40]}")
    return float(value)


# --- responses ---------------------------------------------------------------------------------


def usage(stats: Stats) -> dict[str, int]:
    """OpenAI's ``usage``: the prompt's tokens (the whole rendered conversation) and the completion's."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }


def speculation(stats: Stats) -> dict[str, float | int]:
    """The extra ``specdec`` field: how speculation went (see docs/openai.md)."""
    return {
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "rounds": stats.rounds,
    }


class Shaper:
    """Builds one request's response objects: the whole response, or its stream chunks."""

    def __init__(self, request: ApiRequest) -> None:
        self._request = request
        self.id = ("chatcmpl-" if request.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _envelope(self, obj: str, choice: dict) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self._request.model,
            "choices": [choice],
        }

    def response(self, text: str, token_ids: list[int], finish: str, stats: Stats) -> dict:
        """The non-streaming answer."""
        if self._request.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=FINISH_REASON[finish])
        if self._request.return_token_ids:
            choice["token_ids"] = token_ids
        body = self._envelope("chat.completion" if self._request.chat else "text_completion", choice)
        body.update(usage=usage(stats), specdec=speculation(stats))
        return body

    def role_chunk(self) -> dict:
        """A chat stream's first chunk, as OpenAI's streams open: the role and empty content, no text."""
        return self._chunk_of({"index": 0, "delta": {"role": "assistant", "content": ""}}, [], None)

    def chunk(self, text: str, token_ids: list[int], finish: str | None = None, stats: Stats | None = None) -> dict:
        """One stream chunk: new text, and on the last one the finish reason and the ``specdec`` stats."""
        if self._request.chat:
            delta: dict[str, str] = {} if finish is not None and not text else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text}
        return self._chunk_of(choice, token_ids, finish, stats)

    def _chunk_of(self, choice: dict, token_ids: list[int], finish: str | None, stats: Stats | None = None) -> dict:
        choice.update(logprobs=None, finish_reason=None if finish is None else FINISH_REASON[finish])
        if self._request.return_token_ids:
            choice["token_ids"] = token_ids
        body = self._envelope("chat.completion.chunk" if self._request.chat else "text_completion", choice)
        if self._request.include_usage:
            body["usage"] = None
        if stats is not None:
            body["specdec"] = speculation(stats)
        return body

    def usage_chunk(self, stats: Stats) -> dict:
        """The chunk ``stream_options.include_usage`` adds after the last: no choices, the usage."""
        body = self._envelope("chat.completion.chunk" if self._request.chat else "text_completion", {})
        body.update(choices=[], usage=usage(stats))
        return body
