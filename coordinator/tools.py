"""OpenAI tool calling on the chat API: reading ``tools`` and ``tool_choice``, rendering tools and tool
history into the prompt, the grammar that enforces a call, and parsing calls out of the output.

The wire format of a call is the Hermes / Qwen one, which many instruction-tuned models are trained
on: a ``<tool_call>`` block holding one JSON object, ``{"name": ..., "arguments": {...}}``.

- **Rendering.** A chat template that mentions ``tools`` renders them itself: the conversation goes
  to ``apply_chat_template`` with ``tools=`` and the messages in the Hugging Face shape (assistant
  ``tool_calls``, ``tool`` role). A template that does not (SmolLM2's) gets the fallback: the tool
  definitions as a ``<tools>`` list in the system prompt with an instruction to answer in
  ``<tool_call>`` blocks, assistant calls written as those blocks and tool results as user-side
  ``<tool_response>`` turns, so any template renders them as ordinary messages.
- **Enforcing.** ``tool_choice: "required"`` and a named function compile to a Lark grammar
  (``tool_grammar``) that admits only well-formed calls of the allowed functions, their arguments
  matching each function's ``parameters`` schema. It travels as a ``response_format`` of kind ``lark``
  (``specdec.grammar``), so it masks the draft's q and the target's p alike and speculation stays
  exact. ``auto`` enforces nothing; ``none`` renders no tools and parses nothing.
- **Parsing.** ``ToolCallSplitter`` splits the output as it streams into content and calls, in the
  order they were written: it holds back text that may still open a block, and releases each call
  once its block closes. A block that is not a call of a known function stays content, so nothing
  the model wrote is lost.

Messages keep the core's ``dict[str, str]`` shape: an assistant's calls ride as canonical JSON text
under ``tool_calls`` and a tool result carries ``tool_call_id``, so sessions and conversation
digests store and compare them as they do any message.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import llguidance

from specdec.grammar import JSON_OPTIONS, ResponseFormat, close_objects

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# OpenAI's rule for function names; it also keeps a name safe inside the grammar's string literals.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The most tools one request may define: each is rendered into the prompt and compiled into a rule.
MAX_TOOLS = 128

Choice = Literal["auto", "none", "required", "function"]


@dataclass(frozen=True)
class ToolSpec:
    """A chat request's tools: the definitions, ``tool_choice`` and ``parallel_tool_calls``.

    ``tools`` are OpenAI's ``{"type": "function", "function": {name, description, parameters}}``
    objects, checked; ``choice`` is ``function`` for a named function (``name``).
    """

    tools: tuple[dict[str, Any], ...]
    choice: Choice = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        """The functions' names, in the order the request defines them."""
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def active(self) -> bool:
        """Whether tools are rendered and calls parsed (anything but ``tool_choice: "none"``)."""
        return self.choice != "none" and bool(self.tools)

    @property
    def enforced(self) -> bool:
        """Whether a grammar forces a call: ``required`` or a named function."""
        return self.choice in ("required", "function")

    @property
    def max_calls(self) -> int | None:
        """The most calls one answer may make: 1 without parallel calls or for a named function (as
        OpenAI and vLLM force exactly one call of it), else no limit."""
        return 1 if not self.parallel or self.choice == "function" else None

    def splitter(self) -> ToolCallSplitter:
        """A fresh splitter of one choice's output into content and these tools' calls."""
        return ToolCallSplitter(self.names, self.max_calls)

    def rendered(self) -> str:
        """The definitions as JSON text for the prompt (``GenerationRequest.tools``); "" when inactive."""
        return json.dumps(list(self.tools)) if self.active else ""


def parse_tools(body: Mapping[str, Any]) -> ToolSpec | None:
    """Reads ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body; None when it has
    no tools (absent or empty) and no ``tool_choice``.

    Raises ValueError ``"<param>: <message>"`` for a definition that is not a function, lacks a
    valid name, repeats one, or has ``parameters`` that are not an object schema; for a
    ``tool_choice`` without tools, of an unknown shape, or naming a function not defined.
    """
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ValueError(f"parallel_tool_calls: must be a boolean, not {json.dumps(parallel)[:40]}")
    if raw is None or raw == []:
        if choice is not None:
            # OpenAI refuses it too; accepting it would promise a tool call that can never come.
            raise ValueError("tool_choice: only allowed when tools are given")
        return None
    if not isinstance(raw, list):
        raise ValueError("tools: must be an array of function definitions")
    if len(raw) > MAX_TOOLS:
        raise ValueError(f"tools: at most {MAX_TOOLS} tools")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw))
    names = [t["function"]["name"] for t in tools]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise ValueError(f"tools: the function {twice!r} is defined twice")
    kind, name = _choice(choice, names)
    return ToolSpec(tools, kind, name, True if parallel is None else parallel)


def _tool(value: Any, where: str) -> dict[str, Any]:
    """One checked tool definition, in OpenAI's shape with only the fields a template reads."""
    if not isinstance(value, Mapping) or value.get("type") != "function":
        raise ValueError(f'{where}.type: only function tools are supported ({{"type": "function", "function": ...}})')
    function = value.get("function")
    if not isinstance(function, Mapping):
        raise ValueError(f"{where}.function: must be an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}.function.name: must be 1 to 64 letters, digits, '_' or '-'")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description: must be a string")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    _check_parameters(parameters, f"{where}.function.parameters")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"{where}.function.strict: must be a boolean")
    out: dict[str, Any] = {"name": name}
    if description is not None:
        out["description"] = description
    out["parameters"] = parameters
    return {"type": "function", "function": out}


def _check_parameters(schema: Any, where: str) -> None:
    """A function's ``parameters``: a JSON Schema for an object (OpenAI's rule), its ``properties``
    schemas and ``required`` names well formed. Deeper keywords are the grammar engine's to check
    where a call is enforced."""
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where}: must be a JSON Schema object")
    if schema.get("type", "object") != "object":
        raise ValueError(f"{where}: must describe an object (type: object), not {json.dumps(schema['type'])[:40]}")
    properties = schema.get("properties", {})
    if not isinstance(properties, Mapping) or not all(isinstance(s, (Mapping, bool)) for s in properties.values()):
        raise ValueError(f"{where}.properties: must map each argument's name to a schema")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{where}.required: must be an array of argument names")


def _choice(value: Any, names: Sequence[str]) -> tuple[Choice, str | None]:
    """``tool_choice`` as (kind, function name); absent is ``auto``, as OpenAI defaults with tools."""
    if value is None or value == "auto":
        return "auto", None
    if value in ("none", "required"):
        return value, None
    if isinstance(value, Mapping) and value.get("type") == "function" and isinstance(value.get("function"), Mapping):
        name = value["function"].get("name")
        if name not in names:
            known = ", ".join(names)
            raise ValueError(f"tool_choice: names {json.dumps(name)[:70]}, which tools do not define ({known})")
        return "function", name
    raise ValueError(
        'tool_choice: must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}'
    )


# --- messages ----------------------------------------------------------------------------------


def assistant_tool_calls(value: Any, where: str) -> str:
    """An assistant message's ``tool_calls`` as the canonical JSON text kept in its message:
    ``[{"name": ..., "arguments": {...}}]``. Ids are left out (no fallback rendering shows them), and
    arguments are parsed, so a client that re-serialises them continues the same conversation.
    ValueError ``"<param>: <message>"`` for a malformed call."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: must be an array of tool calls")
    calls = []
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"{at}: must be {{type: function, function: {{name, arguments}}}}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise ValueError(f"{at}.function.arguments: not valid JSON") from None
        if not isinstance(arguments, Mapping):
            raise ValueError(f"{at}.function.arguments: must be a JSON object")
        calls.append({"name": function["name"], "arguments": dict(arguments)})
    return json.dumps(calls, ensure_ascii=False)


def assistant_message(content: str, calls: Sequence[ToolCall]) -> dict[str, str]:
    """The assistant's answer as its message in the conversation, as a client sends it back."""
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = json.dumps(
            [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls], ensure_ascii=False
        )
    return message


def template_handles_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders tools itself (its Jinja mentions ``tools``)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


def template_inputs(
    messages: Sequence[Mapping[str, str]], tools: str, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (and ``tools=`` argument) to hand ``apply_chat_template``.

    ``native``: the template renders tools (``template_handles_tools``), so messages take the Hugging
    Face shape (assistant ``tool_calls`` with arguments as objects, ``tool`` messages) and the
    definitions go as ``tools``. Otherwise the fallback (module docstring) turns everything into plain
    system, user and assistant messages, and ``tools`` is None. ``tools``: JSON text, "" for none.
    """
    definitions = json.loads(tools) if tools else []
    if native:
        return [_native_message(m) for m in messages], definitions or None
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if i and messages[i - 1]["role"] == "tool":
                out[-1]["content"] += "\n" + block  # consecutive results share one user turn
            else:
                out.append({"role": "user", "content": block})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [f"{OPEN}\n{json.dumps(c, ensure_ascii=False)}\n{CLOSE}" for c in json.loads(m["tool_calls"])]
            out.append({"role": "assistant", "content": "\n".join([m["content"], *blocks] if m["content"] else blocks)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if definitions:
        prompt = tools_prompt(definitions)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _native_message(m: Mapping[str, str]) -> dict[str, Any]:
    """A message in the shape Hugging Face chat templates read."""
    out: dict[str, Any] = dict(m)
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in json.loads(m["tool_calls"])
        ]
    return out


def tools_prompt(definitions: Sequence[Mapping[str, Any]]) -> str:
    """The fallback's system-prompt section: the definitions and how to call them."""
    listed = "\n".join(json.dumps(d, ensure_ascii=False) for d in definitions)
    return (
        "# Tools\n\nYou may call one or more of the functions below to help answer the user.\n\n"
        f"The functions are described as JSON within <tools></tools> tags:\n<tools>\n{listed}\n</tools>\n\n"
        "To call a function, answer with a JSON object holding its name and arguments within "
        f'{OPEN}{CLOSE} tags, one block per call:\n{OPEN}\n{{"name": <function-name>, "arguments": '
        f"<args-json-object>}}\n{CLOSE}"
    )


# --- enforcing ---------------------------------------------------------------------------------


def tool_grammar(spec: ToolSpec) -> str:
    """The Lark grammar (llguidance's dialect) of an answer that is only calls: ``required`` allows
    any defined function, a named choice exactly one call of that one; one call without parallel
    calls, else one or more separated by newlines (``max_calls``).

    Each function's arguments are its ``parameters`` schema embedded with ``%json`` (its own root,
    so its ``$ref``s resolve), written in the fixed layout ``specdec.grammar.JSON_OPTIONS`` gives
    every constrained document. Objects the schema leaves open are closed, as OpenAI's strict mode
    closes them: a forced call names only declared arguments, and a small model cannot ramble on
    in invented ones. The name and the JSON around the arguments are literal text.
    """
    names = [spec.name] if spec.choice == "function" else list(spec.names)
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in spec.tools}
    rules = ["start: call" if spec.max_calls == 1 else 'start: call ("\\n" call)*']
    rules.append(f'call: "{OPEN}\\n" ({" | ".join(f"fn_{i}" for i in range(len(names)))}) "\\n{CLOSE}"')
    for i, name in enumerate(names):
        schema = dict(close_objects(parameters[name]))
        # Set last: a schema's own "x-guidance" must not loosen the fixed layout.
        schema["x-guidance"] = JSON_OPTIONS
        opening = json.dumps(f'{{"name": "{name}", "arguments": ')
        rules.append(f"fn_{i}: {opening} args_{i} " + '"}"')
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    return "\n".join(rules) + "\n"


def check_tool_grammar(spec: ToolSpec) -> None:
    """Checks that the engine can enforce each function ``spec`` forces (its schema's keywords and
    ``$ref``s), without a tokenizer; ValueError ``"tools[i].function.parameters: <engine's reason>"``."""
    if not (spec.active and spec.enforced):
        return
    for i, name in enumerate(spec.names):
        if spec.choice == "function" and name != spec.name:
            continue
        alone = replace(spec, choice="function", name=name, parallel=False)
        grammar = llguidance.LLMatcher.grammar_from_lark(tool_grammar(alone))
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if failed:
            reason = re.sub(r"^at \d+\(\d+\): ", "", messages[0].strip().splitlines()[0])
            raise ValueError(f"tools[{i}].function.parameters: the server cannot enforce this schema: {reason}")


def tool_format_key(spec: ToolSpec) -> str:
    """The ``response_format`` key that enforces ``spec``'s calls; "" when nothing is enforced."""
    if not (spec.active and spec.enforced):
        return ""
    return ResponseFormat("lark", pattern=tool_grammar(spec)).key()


# --- parsing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: its place among the answer's calls, its id, the function's name and the
    arguments as JSON text."""

    index: int
    id: str
    name: str
    arguments: str

    def openai(self, delta: bool = False) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry; ``delta``: a stream's, which also carries the index (each call
        comes whole in one delta)."""
        out: dict[str, Any] = {"index": self.index} if delta else {}
        out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        return out


def parse_call(body: str, names: Sequence[str], index: int = 0) -> ToolCall | None:
    """The call a block's text holds (the answer's ``index``-th), or None when it is no call of a known
    function (not JSON, not an object, an unknown name, or arguments that are not an object)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    arguments_text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(index, "call_" + secrets.token_hex(12), value["name"], arguments_text)


# What a splitter releases, in the order it was written: content text, and calls.
Segment = str | ToolCall


@dataclass
class ToolCallSplitter:
    """Splits one choice's output, as it streams, into content and tool calls.

    ``feed`` takes new text and returns what may be released now, in the order it was written:
    content text and calls whose block has closed. Text that may still open a block (a prefix of
    ``<tool_call>``, or whitespace that would sit between content and a block) is held back until it
    is decided. Whitespace next to a block is dropped, so content is only the prose around calls.
    Once ``max_calls`` calls are made, later text is content. A block that is no valid call, or one
    left open at the end, is released as content verbatim. Feeding the whole output at once gives
    the same segments (adjacent texts joined) as feeding it piecewise.
    """

    names: tuple[str, ...]
    max_calls: int | None = None
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    _pending: str = ""
    # Whitespace between content and an open block: dropped if the block is a call, else content.
    _gap: str = ""
    _in_block: bool = False
    _after_block: bool = False

    def feed(self, text: str, end: bool = False) -> list[Segment]:
        """What ``text`` releases, in written order: content (no empty texts, no two texts in a row)
        and new calls; ``end``: the output is complete."""
        self._pending += text
        out: list[Segment] = []
        while True:
            if self._in_block:
                close = self._pending.find(CLOSE)
                if close < 0:
                    break
                body, self._pending = self._pending[:close], self._pending[close + len(CLOSE) :]
                self._in_block = False
                call = parse_call(body.strip(), self.names, len(self.calls))
                if call is None:
                    self._release(out, self._gap + OPEN + body + CLOSE)
                else:
                    self.calls.append(call)
                    out.append(call)
                    self._after_block = True
                continue
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                self._release(out, self._pending)
                self._pending = ""
                break
            start = self._pending.find(OPEN)
            if start >= 0:
                before = self._pending[:start].rstrip()
                self._release(out, before)
                self._gap = self._pending[len(before) : start]
                self._pending = self._pending[start + len(OPEN) :]
                self._in_block = True
                continue
            keep = _undecided_tail(self._pending)
            self._release(out, self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            break
        if end:
            rest = (self._gap + OPEN if self._in_block else "") + self._pending
            self._pending, self._in_block = "", False
            self._release(out, rest.rstrip() if self.calls else rest)
        return out

    def _release(self, out: list[Segment], text: str) -> None:
        """Appends ``text`` to ``out`` as content; leading whitespace right after a block is dropped."""
        if self._after_block:
            text = text.lstrip()
            self._after_block = not text
        if not text:
            return
        self.content += text
        if out and isinstance(out[-1], str):
            out[-1] += text
        else:
            out.append(text)


def _undecided_tail(text: str) -> int:
    """How many trailing characters of ``text`` may still turn into a block's opening: a proper
    prefix of ``<tool_call>``, and the whitespace before it."""
    keep = next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-n:])), 0)
    return len(text) - len(text[: len(text) - keep].rstrip())


def split_tool_calls(text: str, spec: ToolSpec) -> tuple[str, list[ToolCall]]:
    """A whole output's content and calls (``ToolCallSplitter`` over it at once)."""
    splitter = spec.splitter()
    splitter.feed(text, end=True)
    return splitter.content, splitter.calls
