"""OpenAI's Responses API (``POST /v1/responses``) as a translation onto the chat path.

A Responses body is rewritten into the equivalent chat completions body and parsed by
``coordinator.openai_schema.parse_request``, so it runs on the same round loop, with the same
checks, the same tool rendering and grammar, and the same exact speculation: greedy output through
``/v1/responses`` is the chat path's output for the same conversation.

- **Input.** ``instructions`` becomes a leading system message. ``input`` is a string (one user
  message) or a list of items: messages (roles ``user``, ``system``, ``developer``, ``assistant``,
  content a string or ``input_text`` / ``output_text`` parts), ``function_call`` items (an
  assistant's tool calls; an assistant message right before or after them joins the same turn, as
  the chat path writes an answer with calls) and ``function_call_output`` items (``tool`` messages).
- **Settings.** ``max_output_tokens`` is chat's ``max_completion_tokens``, ``text.format`` its
  ``response_format``, Responses-style function tools (``{type, name, description, parameters,
  strict}``) and ``tool_choice`` (``{type: "function", name}``) its ``tools`` and ``tool_choice``.
  Errors the chat parser raises are renamed to the Responses parameters (``responses_error``).
- **Refused.** What specdec does not do is a 400 ``unsupported_parameter`` naming the parameter unless
  it holds its neutral value: stored state (``previous_response_id``, ``conversation``, ``store:
  true``, ``background``), reasoning, built-in tools, logprobs, images and files.
- **Output.** ``ResponseBuilder`` turns the round loop's text into Responses output items (``message``
  items with one ``output_text`` part, ``function_call`` items) and the streaming events around them;
  a whole response is the final state of the same events, so streamed and whole answers agree.

All functions here are pure (JSON in, JSON out); ``coordinator.openai_api`` serves them.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.openai_schema import FINISH_REASON, ApiError, ApiRequest, invalid, parse_request, speculation
from coordinator.tools import ToolCall, ToolCallSplitter
from coordinator.turns import Stats

# Input message roles; "developer" is the system prompt, as on the chat path.
ROLES = ("user", "system", "developer", "assistant")
# Text content parts of an input message (an assistant's earlier output comes back as output_text).
TEXT_PARTS = ("input_text", "output_text")
# Responses parameters specdec does not serve, with the values that ask for nothing (absent is fine too).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (None,),
    "conversation": (None,),
    "prompt": (None,),
    "store": (None, False),
    "background": (None, False),
    "reasoning": (None, {}),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
    "context_management": (None, []),
    "moderation": (None,),
    "image": (None,),
    "access_programs": (None,),
    "service_tier": (None, "auto", "default"),
    # Chat completions' own, not the Responses API's: refused unless neutral rather than dropped.
    "n": (None, 1),
    "logprobs": (None, False),
    "echo": (None, False),
}
# Chat completions' names for what the Responses API names otherwise: a 400 that says which to use.
_CHAT_NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}
# Passed to the chat parser as they are: OpenAI's, and the chat path's extensions (seed, top_k, stop,
# penalties and logit_bias), each checked there.
_PASSED = (
    "model",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "user",
    "stream",
    "seed",
    "top_k",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
)
# Hints that cannot change an answer: their type is checked, their value has no effect.
_HINTS = {
    "safety_identifier": str,
    "prompt_cache_key": str,
    "prompt_cache_retention": str,
    "prompt_cache_options": dict,
}
# OpenAI's limits on ``metadata``.
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


@dataclass(frozen=True)
class ResponsesRequest:
    """A parsed /v1/responses body: the chat request it runs as (one choice), where each chat message
    came from (for errors), and the settings the response object echoes."""

    chat: ApiRequest
    # Per chat message: "instructions", "input" (a string input) or "input[i]".
    origins: tuple[str, ...]
    # instructions, max_output_tokens, metadata, parallel_tool_calls, temperature, text, tool_choice,
    # tools, top_p and user, as the response object reports them.
    settings: dict[str, Any]

    @property
    def stream(self) -> bool:
        """Whether the answer is a stream of server-sent events."""
        return self.chat.stream


def parse_responses(body: Any, model_ids: tuple[str, ...], max_context: int, vocab_size: int) -> ResponsesRequest:
    """Checks a /v1/responses body and builds the chat request it runs as.

    Raises ApiError: 400 for wrong types and values and for parameters specdec does not serve
    (``unsupported_parameter``), each naming its Responses parameter; 404 for another model.
    """
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    for name, neutral in _NEUTRAL.items():
        if name in body and not _is_neutral(body[name], neutral):
            raise invalid(name, "not supported by this server", "unsupported_parameter")
    for name, instead in _CHAT_NAMES.items():
        if name in body:
            raise invalid(name, f"not a Responses API parameter: use {instead}", "unsupported_parameter")
    for name, kind in _HINTS.items():
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise invalid(name, f"must be {'a string' if kind is str else 'an object'}")
    messages, origins = input_messages(body.get("instructions"), body.get("input"))
    chat: dict[str, Any] = {name: body[name] for name in _PASSED if name in body}
    chat["messages"] = messages
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        if isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 1:
            raise invalid("max_output_tokens", f"must be an integer of at least 1, not {json.dumps(max_output)[:40]}")
        chat["max_completion_tokens"] = max_output
    tools = chat_tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    text = _text(body.get("text"))
    if text["format"]["type"] != "text":
        chat["response_format"] = chat_response_format(text["format"])
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("stream_options", "must be an object")
        if body.get("stream") is not True:
            raise invalid("stream_options", "only allowed with stream: true")
        if options.get("include_obfuscation") not in (None, False):
            raise invalid("stream_options.include_obfuscation", "not supported by this server", "unsupported_parameter")
    metadata = _metadata(body.get("metadata"))
    try:
        request = parse_request(chat, True, model_ids, max_context, vocab_size)
    except ApiError as error:
        raise responses_error(error, tuple(origins)) from None
    core = request.choices[0]
    settings = {
        "instructions": body.get("instructions"),
        "max_output_tokens": max_output,
        "metadata": metadata,
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "temperature": core.temperature,
        "text": text,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": [_echoed_tool(t) for t in body.get("tools") or []],
        "top_p": core.top_p,
        "user": body.get("user"),
    }
    return ResponsesRequest(request, tuple(origins), settings)


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``neutral`` (bool and int kept apart); an object whose every field is
    null (``reasoning: {"effort": null}``) asks for nothing too."""
    if isinstance(value, dict) and {} in neutral and all(v is None for v in value.values()):
        return True
    return any(value == v and type(value) is type(v) for v in neutral)


# --- input ---------------------------------------------------------------------------------------


def input_messages(instructions: Any, value: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """``instructions`` and ``input`` as chat messages (OpenAI's chat shape), with where each came from.

    An assistant's ``function_call`` items join the assistant message right before them, and an
    assistant message right after them joins their turn: one chat message with ``content`` and
    ``tool_calls``, as the chat path writes an answer that made calls. A ``function_call_output``
    item is a ``tool`` message.
    """
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions", f"must be a string, not {json.dumps(instructions)[:40]}")
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    if value is None:
        raise invalid("input", "is required: a string or an array of input items")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        origins.append("input")
        return messages, origins
    if not isinstance(value, list) or not value:
        raise invalid("input", "must be a string or a non-empty array of input items")
    previous = None  # the kind of the item before: "assistant", "function_call" or None
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, "must be an object: a message, function_call or function_call_output item")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise invalid(f"{where}.role", f"{json.dumps(role)[:40]} is not one of {', '.join(ROLES)}")
            text = content_text(item.get("content"), f"{where}.content")
            if role == "assistant" and previous == "function_call":
                messages[-1]["content"] = (messages[-1]["content"] or "") + text
            else:
                messages.append({"role": role, "content": text})
                origins.append(where)
            previous = "assistant" if role == "assistant" else None
        elif kind == "function_call":
            call = function_call(item, where)
            if previous in ("assistant", "function_call"):
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(where)
            previous = "function_call"
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            output = content_text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            origins.append(where)
            previous = None
        else:
            raise invalid(
                f"{where}.type",
                f"{json.dumps(kind)[:40]} items are not supported: only message, function_call and "
                "function_call_output",
                "unsupported_parameter",
            )
    return messages, origins


def content_text(content: Any, where: str) -> str:
    """A message's (or a function call output's) text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, "must be a string or an array of input_text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise invalid(
                f"{where}[{j}].type",
                f"{json.dumps(kind)[:40]} content is not supported: only text parts "
                '({"type": "input_text", "text": ...} or output_text)',
                "unsupported_parameter",
            )
        texts.append(_string(part, "text", f"{where}[{j}]", empty=True))
    return "".join(texts)


def function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call`` input item as chat's ``tool_calls`` entry; ``arguments`` must be a JSON
    object as text, as the model writes them."""
    call_id, name = _string(item, "call_id", where), _string(item, "name", where)
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise invalid(f"{where}.arguments", "must be a string: the arguments as JSON text")
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        raise invalid(f"{where}.arguments", "is not valid JSON") from None
    if not isinstance(parsed, dict):
        raise invalid(f"{where}.arguments", "must be a JSON object")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _string(item: dict[str, Any], name: str, where: str, empty: bool = False) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (not value and not empty):
        raise invalid(f"{where}.{name}", "must be a non-empty string" if not empty else "must be a string")
    return value


# --- tools and formats ---------------------------------------------------------------------------


def chat_tools(value: Any) -> list[dict[str, Any]] | None:
    """Responses-style function tools (``{type: "function", name, description, parameters, strict}``)
    as chat's ``{type: "function", function: {...}}``; the chat parser checks the rest. Built-in tools
    (web search, file search, ...) are refused by type."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid("tools", "must be an array of function tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise invalid(f"tools[{i}]", 'must be a tool object with a type ({"type": "function", "name": ...})')
        if tool["type"] != "function":
            kind = json.dumps(tool["type"])[:40]
            raise invalid(
                f"tools[{i}].type", f"{kind} tools are not supported: only function tools", "unsupported_parameter"
            )
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as the response object lists it."""
    fields = ("name", "description", "parameters", "strict")
    return {"type": "function", **{k: tool.get(k) for k in fields}}


def chat_tool_choice(value: Any) -> Any:
    """``tool_choice``: ``"auto"``, ``"none"``, ``"required"`` or ``{type: "function", name}`` (chat's
    ``{type: "function", function: {name}}``). Hosted-tool and ``allowed_tools`` choices are refused."""
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if not isinstance(name, str):
            raise invalid("tool_choice.name", "must be the name of a function tool")
        return {"type": "function", "function": {"name": name}}
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        kind = json.dumps(value["type"])[:40]
        raise invalid("tool_choice", f"{kind} is not supported: only function tools", "unsupported_parameter")
    raise invalid("tool_choice", 'must be "auto", "none", "required" or {"type": "function", "name": ...}')


def _text(value: Any) -> dict[str, Any]:
    """The ``text`` setting, as the response echoes it: its format (default plain text)."""
    if value is None:
        return {"format": {"type": "text"}}
    if not isinstance(value, dict):
        raise invalid("text", "must be an object")
    if value.get("verbosity") not in (None, "medium"):
        raise invalid("text.verbosity", "not supported by this server", "unsupported_parameter")
    fmt = value.get("format")
    if fmt is None:
        return {"format": {"type": "text"}}
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise invalid("text.format", 'must be an object with a type ("text", "json_object" or "json_schema")')
    return {"format": fmt}


def chat_response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    """``text.format`` as chat's ``response_format``: ``json_schema``'s fields move under ``json_schema``;
    ``json_object`` and the ``regex`` extension are the same object."""
    if fmt["type"] != "json_schema":
        return fmt
    if not isinstance(fmt.get("schema"), dict):
        raise invalid("text.format.schema", "must be a JSON Schema object")
    if fmt.get("name") is not None and not isinstance(fmt["name"], str):
        raise invalid("text.format.name", "must be a string")
    inner = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": inner}


def _metadata(value: Any) -> dict[str, str]:
    """``metadata``: up to 16 string values under short keys, echoed back as given."""
    if value is None:
        return {}
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA_KEYS
        or not all(isinstance(k, str) and len(k) <= MAX_METADATA_KEY_CHARS for k in value)
        or not all(isinstance(v, str) and len(v) <= MAX_METADATA_VALUE_CHARS for v in value.values())
    ):
        raise invalid(
            "metadata",
            f"must be an object of at most {MAX_METADATA_KEYS} strings (keys up to "
            f"{MAX_METADATA_KEY_CHARS} characters, values up to {MAX_METADATA_VALUE_CHARS})",
        )
    return dict(value)


# --- errors --------------------------------------------------------------------------------------


_TOOL_FUNCTION = re.compile(r"(tools\[\d+\])\.function\b")
_MESSAGE = re.compile(r"messages\[(\d+)\][\w.\[\]]*")


def responses_error(error: ApiError, origins: Sequence[str] = ()) -> ApiError:
    """A chat path's ``error`` with its parameter named as the Responses API names it:
    ``max_completion_tokens`` is ``max_output_tokens``, ``response_format`` ``text.format``,
    ``tools[i].function.x`` ``tools[i].x``, ``messages`` ``input`` and ``messages[j]`` the input item
    (or ``instructions``) it came from (``origins``)."""

    def rename(text: str) -> str:
        text = text.replace("max_completion_tokens", "max_output_tokens")
        text = text.replace("response_format.json_schema.", "text.format.").replace("response_format", "text.format")
        text = _TOOL_FUNCTION.sub(r"\1", text)
        text = _MESSAGE.sub(lambda m: origins[int(m[1])] if int(m[1]) < len(origins) else "input", text)
        return text.replace("your messages do not fit", "your input does not fit")

    param = None if error.param is None else ("input" if error.param == "messages" else rename(error.param))
    renamed = ApiError(error.status, rename(error.message), error.type, param, error.code, error.retry_after_s)
    renamed.__cause__ = error.__cause__
    return renamed


# --- output --------------------------------------------------------------------------------------


def usage(stats: Stats) -> dict[str, Any]:
    """The Responses API's ``usage``: the whole rendered conversation's tokens and the output's."""
    return {
        "input_tokens": stats.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": stats.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
    }


def sse_event(event: dict[str, Any]) -> bytes:
    """One server-sent event, named by its type as OpenAI's Responses streams name them."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


class ResponseBuilder:
    """One response, built as its output arrives: the streaming events, and the response object.

    ``feed`` takes the round loop's text as it comes and returns the events it makes: content text
    streams into a ``message`` item's ``output_text`` part; with tools, each call (split out by
    ``coordinator.tools.ToolCallSplitter``) closes the open message and becomes a ``function_call``
    item of its own, sent whole (one arguments delta). On the last chunk the open item closes and the
    response ends ``completed``, or ``incomplete`` (reason ``max_output_tokens``) when the output was
    cut by the limit or the context. A whole (non-streaming) answer is ``response()`` after the last
    chunk: the state the events built.
    """

    def __init__(
        self, request: ResponsesRequest, response_id: str | None = None, created_at: int | None = None
    ) -> None:
        self._request = request
        self.id = response_id or "resp_" + secrets.token_hex(24)
        self.created_at = int(time.time()) if created_at is None else created_at
        tools = request.chat.tools
        self._split: ToolCallSplitter | None = (
            tools.splitter() if tools is not None and request.chat.parses_tools else None
        )
        self._items: list[dict[str, Any]] = []
        self._open: int | None = None  # the index of the message item text goes to
        self._sequence = 0
        self._status = "in_progress"
        self._stats: Stats | None = None
        self._error: dict[str, str] | None = None
        # The answer as the chat path remembers it: content and calls.
        self.content = ""
        self.calls: list[ToolCall] = []

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        """A stream's opening events: ``response.created`` and ``response.in_progress``."""
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def feed(self, text: str, finish: str | None = None, stats: Stats | None = None) -> list[dict[str, Any]]:
        """The events for ``text``, the next piece of output; on the last (``finish``, with ``stats``)
        also the events that close the response."""
        events: list[dict[str, Any]] = []
        if self._split is None:
            released, calls = text, list[ToolCall]()
        else:
            released, calls = self._split.feed(text, end=finish is not None)
        if released:
            events += self._text(released)
        for call in calls:
            events += self._close_message("completed")
            events += self._call(call)
        if finish is None:
            return events
        if not self._items:  # nothing was written: an empty message, as an answer of no text
            events += self._text("")
        cut = FINISH_REASON[finish] == "length"
        events += self._close_message("incomplete" if cut else "completed")
        self._status, self._stats = ("incomplete" if cut else "completed"), stats
        events.append(self._event(f"response.{self._status}", response=self.response()))
        return events

    def fail(self, error: ApiError) -> list[dict[str, Any]]:
        """The events that end a stream that failed after it began: ``error``, then ``response.failed``."""
        self._status = "failed"
        self._error = {"code": error.code or "server_error", "message": error.message}
        return [
            self._event("error", code=error.code, message=error.message, param=error.param),
            self._event("response.failed", response=self.response()),
        ]

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None:
            self._open = len(self._items)
            item_id = "msg_" + secrets.token_hex(24)
            self._items.append(
                {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            )
            events.append(
                self._event("response.output_item.added", output_index=self._open, item=self._item(self._open))
            )
            self._items[self._open]["content"].append(
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            )
            events.append(self._event("response.content_part.added", **self._where(), part=_part("")))
        self.content += text
        self._items[self._open]["content"][0]["text"] += text
        if text:
            events.append(self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[]))
        return events

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._items[self._open]["id"], "output_index": self._open, "content_index": 0}

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, where = self._open, self._where()
        text = self._items[index]["content"][0]["text"]
        self._items[index]["status"] = status
        self._open = None
        return [
            self._event("response.output_text.done", **where, text=text, logprobs=[]),
            self._event("response.content_part.done", **where, part=_part(text)),
            self._event("response.output_item.done", output_index=index, item=self._item(index)),
        ]

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        self.calls.append(call)
        index, item_id = len(self._items), "fc_" + secrets.token_hex(24)
        item = {
            "id": item_id,
            "type": "function_call",
            "status": "in_progress",
            "arguments": "",
            "call_id": call.id,
            "name": call.name,
        }
        self._items.append(item)
        added = self._event("response.output_item.added", output_index=index, item=self._item(index))
        item.update(arguments=call.arguments, status="completed")
        where = {"item_id": item_id, "output_index": index}
        return [
            added,
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event("response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments),
            self._event("response.output_item.done", output_index=index, item=self._item(index)),
        ]

    def _item(self, index: int) -> dict[str, Any]:
        return copy.deepcopy(self._items[index])

    def response(self) -> dict[str, Any]:
        """The response object as it stands: ``in_progress`` until the last chunk, then
        ``completed``, ``incomplete`` or ``failed``, with ``usage`` and the ``specdec`` field once done."""
        done = self._stats is not None
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self._status,
            "background": False,
            "error": self._error,
            "incomplete_details": {"reason": "max_output_tokens"} if self._status == "incomplete" else None,
            "model": self._request.chat.model,
            "output": [copy.deepcopy(item) for item in self._items],
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": False,
            "truncation": "disabled",
            **copy.deepcopy(self._request.settings),
            "usage": usage(self._stats) if self._stats is not None else None,
        }
        if done:
            assert self._stats is not None
            body["specdec"] = speculation(self._stats)
        return body


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
