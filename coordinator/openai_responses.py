"""OpenAI's Responses API (``POST /v1/responses``) as a translation onto the chat path: its requests.

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

The answer's output items and events are ``coordinator.openai_responses_output``'s. All functions
here are pure (JSON in, JSON out); ``coordinator.openai_api`` serves them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.openai_schema import ApiError, ApiRequest, invalid, is_neutral, parse_request

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
        if name in body and not is_neutral(body[name], neutral):
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
