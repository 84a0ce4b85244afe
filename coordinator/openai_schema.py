"""The OpenAI API's request and response bodies: parsing a request into a ``GenerationRequest``, and
shaping chunks and stats into completions, chat completions and their stream chunks.

Pure functions over JSON values, with no HTTP in them: ``coordinator.openai_api`` serves them. A
request that no exact generation can serve is refused with an ``ApiError`` naming the parameter,
never silently approximated: an unsupported parameter set to anything but its neutral value (for
example ``best_of``, ``functions``) is a 400. Penalties and ``logit_bias`` are served exactly: they
transform the draft's and the target's logits alike (``specdec.sampling.penalize_logits``), and so
does ``response_format``'s grammar mask (``specdec.constrain``). Chat's ``tools`` are read, rendered,
enforced and parsed by ``coordinator.tools``.

A request asks for one choice per prompt times ``n``: chat has one prompt, completions a string, an
array of strings, token ids or an array of token-id arrays. Each choice is a ``GenerationRequest`` of
its own, in OpenAI's order (prompt-major); choice ``i`` of a prompt samples with ``seed + i``.

Completions' ``echo`` prepends each choice's prompt to its text; with ``logprobs`` the prompt's
tokens lead the logprobs too, each scored by the target's prefill pass (the first has none: null),
and ``max_tokens: 0`` asks for the prompt alone (scoring a text, as evaluation harnesses do).

Where OpenAI's conventions and exactness do not clash, the parsing is as lenient as OpenAI's own
clients expect: ``model`` may be omitted or name an alias, ``seed`` is any int64 (-1: none), and a
prompt past the context is a 400 with ``code: "context_length_exceeded"``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from coordinator.choices import MAX_CHOICES
from coordinator.server import MAX_STOP_CHARS, MAX_STOP_STRINGS
from coordinator.tools import ToolCall, ToolSpec, assistant_tool_calls, check_tool_grammar, parse_tools, tool_format_key
from coordinator.turns import GenerationRequest, Stats
from specdec.grammar import response_format_key
from specdec.sampling_params import MAX_TOP_LOGPROBS, TokenLogprob, check_penalties, check_sampling

# OpenAI's default for /v1/completions when max_tokens is absent; chat runs to the context's end.
COMPLETION_DEFAULT_MAX_TOKENS = 16
# One prompt: completions' text or token ids, or chat's messages.
Prompt = str | tuple[int, ...] | list[dict[str, str]]
# Message roles the chat template knows; OpenAI's newer "developer" role is its system prompt. A
# "tool" message (a call's result) is rendered by the template or ``coordinator.tools``' fallback.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# Parameters specdec does not implement, with the value that asks for nothing (absent is fine too);
# chat implements ``tools``, completions ``echo``.
_NEUTRAL = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
}
# The finish reasons of the round loop, as OpenAI names them: the context's end is a length limit too.
# "tool_calls" is the API's own: an answer that made a call (``coordinator.tools``).
FINISH_REASON = {"stop": "stop", "length": "length", "context": "length", "tool_calls": "tool_calls"}


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


def is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` of a parameter specdec does not serve asks for nothing: one of ``neutral``
    (bool and int kept apart), or, where ``{}`` is neutral, an object whose every field is null
    (``reasoning: {"effort": null}``)."""
    if isinstance(value, dict) and {} in neutral and all(v is None for v in value.values()):
        return True
    return any(value == v and type(value) is type(v) for v in neutral)


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
    """A parsed request: the core request of each choice (without its client), and how to answer it.

    ``choices`` are in OpenAI's index order: prompt-major, ``n`` per prompt."""

    choices: tuple[GenerationRequest, ...]
    chat: bool
    stream: bool
    include_usage: bool
    model: str
    # vLLM's extension: each choice (and stream chunk) also carries its ``token_ids``.
    return_token_ids: bool = False
    # Choices per prompt.
    n: int = 1
    # Chat's tools; None: none were given.
    tools: ToolSpec | None = None
    # Completions: each choice's text (and its logprobs, when asked for) starts with its prompt.
    echo: bool = False

    @property
    def parses_tools(self) -> bool:
        """Whether each choice's output is split into content and tool calls."""
        return self.tools is not None and self.tools.active


def parse_request(body: Any, chat: bool, model_ids: tuple[str, ...], max_context: int, vocab_size: int) -> ApiRequest:
    """Checks a /v1/completions (``chat`` False) or /v1/chat/completions body and builds the request.

    ``model_ids`` are the names the served model answers to, its own id first; the response names
    that first one whichever the request used (or when it named none). Token-id prompts must lie in
    ``[0, vocab_size)``.

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
        if (name == "tools" and chat) or (name == "echo" and not chat):
            continue
        if name in body and not is_neutral(body[name], neutral):
            raise invalid(name, "not supported by this server", "unsupported_parameter")
    tools = _tools(body) if chat else None
    if not chat and body.get("tool_choice") is not None:
        # OpenAI refuses it too; accepting it would promise a tool call that can never come.
        raise invalid("tool_choice", "only allowed when tools are given")
    n = _typed(body, "n", int)
    n = 1 if n is None else n
    if n < 1:
        raise invalid("n", "must be at least 1")
    _typed(body, "user", str)  # accepted; the client identity comes from the request (see openai_api)
    prompts: Sequence[Prompt] = (
        [parse_messages(body.get("messages"))] if chat else _prompts(body.get("prompt"), vocab_size)
    )
    if n * len(prompts) > MAX_CHOICES:
        param = "n" if len(prompts) == 1 else "prompt"
        raise invalid(param, f"asks for {n * len(prompts)} choices (n times the prompts); at most {MAX_CHOICES}")
    max_tokens = _typed(body, "max_completion_tokens", int) if chat else None
    if max_tokens is None:
        max_tokens = _typed(body, "max_tokens", int)
    if max_tokens is None:
        max_tokens = max_context if chat else COMPLETION_DEFAULT_MAX_TOKENS
    param = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    echo = not chat and bool(_typed(body, "echo", bool))
    if max_tokens < (0 if echo else 1):
        raise invalid(param, "must be at least 1 (0, the prompt alone, only with echo: true)")
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
    presence, frequency = _number(body, "presence_penalty", 0.0), _number(body, "frequency_penalty", 0.0)
    # repetition_penalty is vLLM's extension (over prompt and output); 1 is off.
    repetition = _number(body, "repetition_penalty", 1.0)
    logit_bias = _logit_bias(body.get("logit_bias"))
    top_logprobs = _logprobs(body, chat)
    try:
        # Checked for shape here; compiled against the served tokenizer when the turn opens.
        response_format = response_format_key(body.get("response_format"))
    except ValueError as exc:
        raise ApiError(400, str(exc), param="response_format") from None
    if tools is not None and tools.active and tools.enforced:
        if response_format:
            forced = tools.name or tools.choice
            raise invalid("response_format", f"cannot be combined with a forced tool call (tool_choice {forced!r})")
        response_format = tool_format_key(tools)
    try:
        check_sampling(temperature, top_k, top_p)
        check_penalties(presence, frequency, repetition, logit_bias, vocab_size)
    except ValueError as exc:
        param, _, message = str(exc).partition(": ")
        raise invalid(param, message) from None
    core = GenerationRequest(
        text=None,
        messages=None,
        max_new_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=_stop(body.get("stop")),
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        logit_bias=logit_bias,
        response_format=response_format,
        top_logprobs=top_logprobs,
        prompt_logprobs=top_logprobs if echo else None,
        tools="" if tools is None else tools.rendered(),
        fingerprint=hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:32],
    )
    choices = tuple(
        replace(_prompted(core, prompt), seed=None if seed is None else (seed + i) % 2**64)
        for prompt in prompts
        for i in range(n)
    )
    return_token_ids = bool(_typed(body, "return_token_ids", bool))
    return ApiRequest(choices, chat, stream, include_usage, model_ids[0], return_token_ids, n, tools, echo)


def _tools(body: dict) -> ToolSpec | None:
    """Chat's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked (``coordinator.tools``),
    including that a forced call's schemas are ones the grammar engine enforces."""
    try:
        spec = parse_tools(body)
        if spec is not None:
            check_tool_grammar(spec)
    except ValueError as exc:
        param, _, message = str(exc).partition(": ")
        raise invalid(param, message) from None
    return spec


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's logprob comes with; None: no logprobs. Chat asks with
    ``logprobs: true`` and ``top_logprobs`` (0 to 20, only with logprobs), completions with ``logprobs``
    as that number (OpenAI's legacy field)."""
    if not chat:
        value = _typed(body, "logprobs", int)
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise invalid("logprobs", f"must lie in [0, {MAX_TOP_LOGPROBS}]")
        return value
    top = _typed(body, "top_logprobs", int)
    if not _typed(body, "logprobs", bool):
        if top is not None:
            raise invalid("top_logprobs", "only allowed with logprobs: true")
        return None
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid("top_logprobs", f"must lie in [0, {MAX_TOP_LOGPROBS}]")
    return top or 0


def _prompted(core: GenerationRequest, prompt: Prompt) -> GenerationRequest:
    """``core`` asking for ``prompt``: text, token ids or chat messages."""
    if isinstance(prompt, str):
        return replace(core, text=prompt)
    if isinstance(prompt, tuple):
        return replace(core, prompt_token_ids=prompt)
    return replace(core, messages=prompt)


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
    must be text parts, joined. An assistant's ``tool_calls`` (its content then may be null) and a
    tool result's ``tool_call_id`` are kept as string fields (``coordinator.tools``)."""
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
        calls = m.get("tool_calls") if role == "assistant" else None
        if content is None and calls:
            content = ""
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise invalid(f"{where}.content", "only text parts ({type: text, text: ...}) are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise invalid(f"{where}.content", "must be a string or an array of text parts")
        message = {"role": ROLES[role], "content": content}
        try:
            if calls:
                message["tool_calls"] = assistant_tool_calls(calls, f"{where}.tool_calls")
        except ValueError as exc:
            param, _, detail = str(exc).partition(": ")
            raise invalid(param, detail) from None
        call_id = m.get("tool_call_id") if role == "tool" else None
        if call_id is not None:
            if not isinstance(call_id, str):
                raise invalid(f"{where}.tool_call_id", "must be a string")
            message["tool_call_id"] = call_id
        messages.append(message)
    return messages


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompts(value: Any, vocab_size: int) -> list[str | tuple[int, ...]]:
    """The prompts of a completions body, as OpenAI takes them: a string, an array of strings, an array
    of token ids, or an array of token-id arrays. Token ids go to the core as they are."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(_is_id(t) for t in value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise invalid("prompt", "must be a string, an array of strings, token ids, or an array of token-id arrays")
    prompts: list[str | tuple[int, ...]] = []
    for i, item in enumerate(value):
        where = "" if len(value) == 1 else f"prompt {i} "
        if isinstance(item, list) and item and all(_is_id(t) for t in item):
            bad = next((t for t in item if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise invalid("prompt", f"{where}has {bad}, not a token id of this model: ids lie in [0, {vocab_size})")
            prompts.append(tuple(item))
        elif isinstance(item, str) and item:
            prompts.append(item)
        elif item in ("", []):
            raise invalid("prompt", f"{where}is empty".strip())
        else:
            raise invalid("prompt", f"{where}must be a string or an array of token ids".strip())
    return prompts


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``, an object from token ids (as strings: JSON keys) to numbers, as sorted
    (id, bias) pairs; the ranges are ``check_penalties``'."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("logit_bias", f"must be an object mapping token ids to numbers, not {json.dumps(value)[:40]}")
    pairs = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise invalid("logit_bias", f"{json.dumps(key)[:40]} is not a token id") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise invalid("logit_bias", f"the bias of token {token} must be a number, not {json.dumps(bias)[:40]}")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


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


@dataclass(frozen=True)
class Echo:
    """A choice's echoed prompt: its text and, with logprobs asked for, its tokens and the logprob of
    each from the second on (``logprobs[i]`` is ``token_ids[i + 1]``'s; the first has none)."""

    text: str
    token_ids: Sequence[int] = ()
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Answer:
    """One choice's whole output."""

    text: str
    token_ids: list[int]
    finish: str
    stats: Stats
    # With logprobs asked for: one per token of ``token_ids``.
    logprobs: list[TokenLogprob] | None = None
    # The calls parsed out of the output (``text`` is then the content around them).
    tool_calls: Sequence[ToolCall] = ()
    # Completions with ``echo``: the prompt, which leads the text and the logprobs.
    echo: Echo | None = None


def total(stats: Sequence[Stats], n: int) -> Stats:
    """The counters of a request's choices (prompt-major, ``n`` per prompt) together, as OpenAI's usage
    counts them: each prompt's tokens once, whatever its ``n``; the generated tokens, and the
    speculation counters, summed over every choice."""
    return Stats(
        prompt_tokens=sum(s.prompt_tokens for s in stats[::n]),
        generated_tokens=sum(s.generated_tokens for s in stats),
        rounds=sum(s.rounds for s in stats),
        drafted_tokens=sum(s.drafted_tokens for s in stats),
        accepted_tokens=sum(s.accepted_tokens for s in stats),
        committed_in_rounds=sum(s.committed_in_rounds for s in stats),
    )


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

    def __init__(self, request: ApiRequest, token_text: Callable[[int], str] | None = None) -> None:
        """``token_text`` gives a token id's text, for logprobs (None: none are reported)."""
        self._request = request
        self._token_text = token_text
        self.id = ("chatcmpl-" if request.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self._request.model,
            "choices": choices,
        }

    def response(self, answers: Sequence[Answer]) -> dict:
        """The non-streaming answer: every choice, in index order. ``usage`` and ``specdec`` count
        them all together (``total``)."""
        choices = []
        for index, answer in enumerate(answers):
            if self._request.chat:
                message: dict[str, Any] = {"role": "assistant", "content": answer.text}
                if answer.tool_calls:
                    # OpenAI's content is null beside calls when the model wrote nothing else.
                    message.update(content=answer.text or None, tool_calls=[c.openai() for c in answer.tool_calls])
                choice: dict[str, Any] = {"index": index, "message": message}
            else:
                echoed = "" if answer.echo is None else answer.echo.text
                choice = {"index": index, "text": echoed + answer.text}
            logprobs = self._logprobs(answer.logprobs, answer.echo)
            choice.update(logprobs=logprobs, finish_reason=FINISH_REASON[answer.finish])
            if self._request.return_token_ids:
                choice["token_ids"] = answer.token_ids
            choices.append(choice)
        body = self._envelope("chat.completion" if self._request.chat else "text_completion", choices)
        stats = total([answer.stats for answer in answers], self._request.n)
        body.update(usage=usage(stats), specdec=speculation(stats))
        return body

    def role_chunk(self, index: int = 0) -> dict:
        """A chat stream's first chunk of a choice, as OpenAI's streams open: the role and empty
        content, no text."""
        return self._chunk_of({"index": index, "delta": {"role": "assistant", "content": ""}}, [], None)

    def chunk(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finish: str | None = None,
        stats: Stats | None = None,
        logprobs: list[TokenLogprob] | None = None,
        tool_calls: Sequence[ToolCall] = (),
    ) -> dict:
        """One stream chunk of choice ``index``: new text (with its tokens' logprobs when asked for)
        and tool calls (each whole, with its index), and on its last one the finish reason and that
        choice's ``specdec`` stats."""
        if self._request.chat:
            delta: dict[str, Any] = {}
            if text or (finish is None and not tool_calls):
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [c.openai(delta=True) for c in tool_calls]
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text}
        return self._chunk_of(choice, token_ids, finish, stats, self._logprobs(logprobs))

    def echo_chunk(self, index: int, echo: Echo) -> dict:
        """A completions stream's first chunk of a choice with ``echo``: the prompt's text, and its
        tokens' logprobs when asked for (as vLLM streams it)."""
        logprobs = self._logprobs(None if echo.logprobs is None else [], echo)
        return self._chunk_of({"index": index, "text": echo.text}, [], None, None, logprobs)

    def _logprobs(self, entries: list[TokenLogprob] | None, echo: Echo | None = None) -> dict | None:
        """OpenAI's ``logprobs`` of a choice or chunk: chat's ``content`` list, or the completions'
        parallel lists (``text_offset`` counts from the text this object covers). An ``echo`` with
        logprobs leads the completions' lists with the prompt's tokens, the first of them with null
        for its logprob and its alternatives (it follows nothing)."""
        if entries is None or self._token_text is None:
            return None
        if echo is not None and echo.logprobs is not None and echo.token_ids:
            return _with_prompt(self._completion_logprobs(echo.logprobs + entries), echo.token_ids[0], self._token_text)
        text_of = self._token_text
        if self._request.chat:

            def item(token: int, logprob: float) -> dict:
                text = text_of(token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            content = [item(e.token, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
            return {"content": content, "refusal": None}
        return self._completion_logprobs(entries)

    def _completion_logprobs(self, entries: list[TokenLogprob]) -> dict:
        """The completions' parallel lists of ``entries``; ``text_offset`` counts from the first."""
        assert self._token_text is not None
        text_of = self._token_text
        tokens = [text_of(e.token) for e in entries]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else []
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text_of(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _chunk_of(
        self,
        choice: dict,
        token_ids: list[int],
        finish: str | None,
        stats: Stats | None = None,
        logprobs: dict | None = None,
    ) -> dict:
        choice.update(logprobs=logprobs, finish_reason=None if finish is None else FINISH_REASON[finish])
        if self._request.return_token_ids:
            choice["token_ids"] = token_ids
        body = self._envelope("chat.completion.chunk" if self._request.chat else "text_completion", [choice])
        if self._request.include_usage:
            body["usage"] = None
        if stats is not None:
            body["specdec"] = speculation(stats)
        return body

    def usage_chunk(self, stats: Sequence[Stats]) -> dict:
        """The chunk ``stream_options.include_usage`` adds after the last: no choices, the usage of
        every choice together (``total``)."""
        body = self._envelope("chat.completion.chunk" if self._request.chat else "text_completion", [])
        body["usage"] = usage(total(stats, self._request.n))
        return body


def _with_prompt(lists: dict, first: int, text_of: Callable[[int], str]) -> dict:
    """The completions' parallel ``lists`` led by an echoed prompt's ``first`` token, which has no
    logprob and no alternatives (null in both), its text shifting every offset."""
    text = text_of(first)
    return {
        "tokens": [text, *lists["tokens"]],
        "token_logprobs": [None, *lists["token_logprobs"]],
        "top_logprobs": [None, *lists["top_logprobs"]],
        "text_offset": [0, *(offset + len(text) for offset in lists["text_offset"])],
    }
