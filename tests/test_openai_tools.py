"""Tool calling on the OpenAI API (issue 41): ``tools``, ``tool_choice``, ``parallel_tool_calls``, tool
history, and calls parsed into ``tool_calls`` (whole and streamed).

The parsing, rendering and grammar are tested without a network. The tiny stack of
tests/test_openai_api.py checks refusals, ``tool_choice: "none"`` and that tool history renders
exactly as ``coordinator.tools``' fallback says (its word vocabulary cannot spell a call). The real
default model, which the grammar makes call a tool, serves the client round trips: the official
``openai`` client with ``tool_choice="required"``, streaming, and LangChain's ``bind_tools`` with a
tool result sent back; a target-only coordinator on the same services checks that speculation under
the tool grammar writes exactly what the target alone writes.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from harness import InProcessStack
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from opentelemetry import trace
from test_openai_api import (  # noqa: F401 - fixtures, shared with the API's own tests
    CHAT,
    KEY,
    NEW_TOKENS,
    Facts,
    ScriptedLoop,
    chat_tokenizer_dir,
    greedy_ids,
    http,
    model,
    served,
    sse_events,
    stack,
    sync_client,
    tokenizer,
)

from coordinator.admission import Admission
from coordinator.openai_api import DEFAULT_MODEL_ID, OpenAiApi
from coordinator.openai_schema import parse_messages
from coordinator.prompts import build_turn, render_chat
from coordinator.tools import (
    ToolCallSplitter,
    parse_tools,
    split_tool_calls,
    template_inputs,
    tool_format_key,
)
from draft_service.engine import NgramDrafter
from specdec.config import AdmissionLimits
from specdec.grammar import GrammarCompiler, ResponseFormat
from specdec.stack import free_port
from target_service.engine import TargetEngine

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/$defs/n"}},
            "$defs": {"n": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


# --- reading tools -----------------------------------------------------------------------------


def test_parse_tools_reads_choice_and_parallel():
    assert parse_tools({}) is None and parse_tools({"tools": []}) is None
    auto = parse_tools({"tools": [WEATHER, ADD]})
    assert auto is not None and (auto.choice, auto.names, auto.max_calls) == ("auto", ("get_weather", "add"), None)
    assert auto.active and not auto.enforced and json.loads(auto.rendered()) == [WEATHER, ADD]
    none = parse_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert none is not None and not none.active and none.rendered() == "" and tool_format_key(none) == ""
    one = parse_tools({"tools": [WEATHER, ADD], "tool_choice": "required", "parallel_tool_calls": False})
    assert one is not None and one.enforced and one.max_calls == 1
    named = parse_tools({"tools": [WEATHER, ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert named is not None and (named.choice, named.name, named.max_calls) == ("function", "add", 1)
    bare = parse_tools({"tools": [{"type": "function", "function": {"name": "ping"}}]})
    assert bare is not None and bare.tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [WEATHER, {"type": "function"}]}, "tools[1].function"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": [1]}}}]},
            "tools[0].function.parameters.properties",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": {"get_weather": WEATHER}}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tool_definitions_and_choices_name_their_param(body, param):
    with pytest.raises(ValueError) as raised:
        parse_tools(body)
    assert str(raised.value).partition(": ")[0] == param


# --- splitting output into content and calls ---------------------------------------------------


@pytest.mark.parametrize(
    "text, content, names",
    [
        ("Just prose, no call.  ", "Just prose, no call.  ", []),
        (CALL, "", ["get_weather"]),
        (f"Let me check.\n{CALL}\n", "Let me check.", ["get_weather"]),
        (f"{CALL}\n{CALL.replace('Paris', 'Rome')}", "", ["get_weather", "get_weather"]),
        # Not calls of a known function: kept as content, verbatim.
        ('a <tool_call>{"name": "nope"}</tool_call> b', 'a <tool_call>{"name": "nope"}</tool_call> b', []),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        # A block left open at the end (max_tokens), and a lone opening's prefix.
        (f'{CALL}\n<tool_call>\n{{"name": "get_', '<tool_call>\n{"name": "get_', ["get_weather"]),
        ("x <tool_ca", "x <tool_ca", []),
    ],
)
def test_splitting_streamed_piecewise_equals_splitting_whole(text, content, names):
    spec = parse_tools({"tools": [WEATHER, ADD]})
    assert spec is not None
    whole_content, whole_calls = split_tool_calls(text, spec)
    assert whole_content == content and [c.name for c in whole_calls] == names
    assert [c.index for c in whole_calls] == list(range(len(names)))
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in whole_calls)
    if names:
        assert json.loads(whole_calls[0].arguments) == {"city": "Paris"}
    whole = written(ToolCallSplitter(spec.names), [text], content)
    for size in (1, 3, 7):
        splitter = ToolCallSplitter(spec.names)
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert written(splitter, pieces, content) == whole
        assert splitter.content == content and [c.name for c in splitter.calls] == names
        assert [c.arguments for c in splitter.calls] == [c.arguments for c in whole_calls]


def written(splitter: ToolCallSplitter, pieces: list[str], content: str = "") -> list[str | tuple[str, str]]:
    """What ``splitter`` releases fed ``pieces`` (the last ends the output), in order, adjacent texts
    joined and each call as (name, arguments). Checks that no segment is empty, and that nothing
    that could still open a call is released early (unless ``content``, all the text, holds it)."""
    out: list[str | tuple[str, str]] = []
    for i, piece in enumerate(pieces):
        for segment in splitter.feed(piece, end=i == len(pieces) - 1):
            assert segment != ""
            if not isinstance(segment, str):
                out.append((segment.name, segment.arguments))
            elif out and isinstance(out[-1], str):
                out[-1] += segment
            else:
                out.append(segment)
        released = "".join(s for s in out if isinstance(s, str))
        assert "<tool_call" not in released or "<tool_call" in content
    return out


def test_text_after_a_call_is_released_after_it_however_the_output_is_cut():
    spec = parse_tools({"tools": [WEATHER]})
    assert spec is not None
    text = f"a{CALL} b"
    call = ("get_weather", json.dumps({"city": "Paris"}))
    for size in (len(text), 1, 2, 5, len(CALL) + 1):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert written(spec.splitter(), pieces) == ["a", call, "b"], size


def test_a_chat_stream_sends_text_and_calls_in_written_order_however_rounds_cut_it():
    text = f"a{CALL} b"

    async def deltas(size: int) -> list:
        api = OpenAiApi(ScriptedLoop(text, size), Facts(), Admission(AdmissionLimits()), trace.NoOpTracer())
        body = {"model": "tiny", "messages": ASK, "tools": [WEATHER], "stream": True}
        async with TestClient(TestServer(api.app(1 << 20))) as client:
            events = sse_events(await (await client.post("/v1/chat/completions", json=body)).read())
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "tool_calls"
        out: list = []
        for event in events[1:-1]:  # after the role chunk
            delta = event["choices"][0]["delta"]
            assert not (delta.get("content") and delta.get("tool_calls"))  # one or the other: an order
            out += [(c["function"]["name"], c["function"]["arguments"]) for c in delta.get("tool_calls", [])]
            if delta.get("content"):
                out += [out.pop() + delta["content"]] if out and isinstance(out[-1], str) else [delta["content"]]
        return out

    call = ("get_weather", json.dumps({"city": "Paris"}))
    for size in (len(text), 1, 2, 5, len(CALL) + 1):
        assert asyncio.run(deltas(size)) == ["a", call, "b"], size


def test_without_parallel_calls_only_the_first_is_parsed():
    spec = parse_tools({"tools": [WEATHER], "parallel_tool_calls": False})
    assert spec is not None
    second = CALL.replace("Paris", "Rome")
    content, calls = split_tool_calls(f"{CALL}\n{second}", spec)
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris"]
    assert content == second  # kept, not lost


# --- rendering ---------------------------------------------------------------------------------


HISTORY = [
    {"role": "system", "content": "Be brief."},
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "3"},
]


def test_fallback_renders_tools_calls_and_results_as_plain_messages():
    messages = parse_messages(HISTORY)
    # Arguments are parsed, so a client that re-serialises them continues the same conversation.
    assert json.loads(messages[2]["tool_calls"]) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "add", "arguments": {"a": 1, "b": 2}},
    ]
    spec = parse_tools({"tools": [WEATHER, ADD]})
    assert spec is not None
    out, definitions = template_inputs(messages, spec.rendered(), native=False)
    assert definitions is None
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER) in out[0]["content"] and "<tools>" in out[0]["content"]
    assert out[2]["content"] == f'{CALL}\n<tool_call>\n{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}\n</tool_call>'
    assert (
        out[3]["content"]
        == "<tool_response>\n18 degrees, sunny\n</tool_response>\n<tool_response>\n3\n</tool_response>"
    )
    # Without tools (tool_choice "none"), history still renders; no system prompt is added.
    plain, _ = template_inputs(messages[1:], "", native=False)
    assert [m["role"] for m in plain] == ["user", "assistant", "user"]


def test_a_template_that_knows_tools_renders_them_itself(tokenizer):  # noqa: F811
    template = (
        "{% if tools %}w3 {% for t in tools %}{{ t['function']['name'] }} {% endfor %}<eos> {% endif %}"
        "{% for m in messages %}{% if m['role'] == 'tool' %}w4 {{ m['tool_call_id'] }} {{ m['content'] }} <eos> "
        "{% else %}{{ {'user': 'w1', 'assistant': 'w2', 'system': 'w3'}[m['role']] }} {{ m['content'] }} "
        "{% for c in m.get('tool_calls', []) %}{{ c['function']['name'] }} {{ c['function']['arguments']['x'] }} "
        "{% endfor %}<eos> {% endif %}{% endfor %}{% if add_generation_prompt %}w2 {% endif %}"
    )
    tools = [{"type": "function", "function": {"name": name}} for name in ("w8", "w9")]
    spec = parse_tools({"tools": tools})
    assert spec is not None
    history = [
        {"role": "user", "content": "w5"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w8", "arguments": '{"x": "w6"}'}}]},
        {"role": "tool", "tool_call_id": "w7", "content": "w10"},
    ]
    original = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        ids = render_chat(tokenizer, parse_messages(history), spec.rendered())
    finally:
        tokenizer.chat_template = original
    assert tokenizer.decode(ids) == "w3 w8 w9 <eos> w1 w5 <eos> w2 w8 w6 <eos> w4 w7 w10 <eos> w2"


# --- the grammar that enforces a call ----------------------------------------------------------


@pytest.fixture(scope="module")
def chars_compiler() -> GrammarCompiler:
    """A compiler over a vocabulary of printable ASCII characters, newline and an end token."""
    tokens = [b"<end>", b"\n", *(bytes([c]) for c in range(32, 127))]
    return GrammarCompiler.from_token_bytes(tokens, [0])


def _walk(compiler: GrammarCompiler, body: dict, text: str) -> tuple[int, bool, bool]:
    """How many characters of ``text`` the tool grammar of ``body`` takes, whether it is then complete,
    and whether another call (a newline) may follow."""
    spec = parse_tools(body)
    assert spec is not None
    matcher = compiler.matcher(ResponseFormat.from_key(tool_format_key(spec)))
    ids = [1 if ch == "\n" else ord(ch) - 30 for ch in text]
    for n, token in enumerate(ids):
        if not matcher.is_allowed(token):
            return n, False, False
        matcher.advance(token)
    return len(text), matcher.is_complete(), matcher.is_allowed(1)


def test_the_grammar_admits_only_calls_of_the_allowed_functions(chars_compiler):
    required = {"tools": [WEATHER, ADD], "tool_choice": "required"}
    add = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 22}}\n</tool_call>'
    assert _walk(chars_compiler, required, CALL) == (len(CALL), True, True)  # parallel: more may follow
    assert _walk(chars_compiler, required, add)[:2] == (len(add), True)  # a $ref resolves in its own schema
    assert _walk(chars_compiler, {**required, "parallel_tool_calls": False}, CALL) == (len(CALL), True, False)
    # No prose before a call, no unknown function, no undeclared argument, no wrong type.
    assert _walk(chars_compiler, required, "Sure" + CALL)[0] == 0
    assert _walk(chars_compiler, required, CALL.replace("get_weather", "get_time"))[0] == len(
        '<tool_call>\n{"name": "get_'
    )
    extra = CALL.replace('"Paris"}', '"Paris", "unit": "C"}')
    assert _walk(chars_compiler, required, extra)[0] == len(CALL.split('"Paris"')[0] + '"Paris"')
    assert _walk(chars_compiler, required, add.replace("22", '"x"'))[0] == add.index("22")
    named = {"tools": [WEATHER, ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}}
    assert _walk(chars_compiler, named, CALL)[0] == len('<tool_call>\n{"name": "')
    assert _walk(chars_compiler, named, add) == (len(add), True, False)  # exactly one call


# --- served: the tiny stack --------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"uniqueItems": True}}}],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {
                "messages": [
                    *CHAT,
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_requests_are_400_naming_the_param(served, model, extra, param):  # noqa: F811
    code, reply, _ = http(served, "POST", "/v1/chat/completions", {"model": model, "messages": CHAT, **extra})
    assert code == 400, reply
    assert json.loads(reply)["error"]["param"] == param


def test_tool_choice_none_answers_as_without_tools(sync_client, model):  # noqa: F811
    base = dict(model=model, messages=CHAT, max_tokens=NEW_TOKENS, temperature=0)
    plain = sync_client.chat.completions.create(**base)
    none = sync_client.chat.completions.create(**base, tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert (
        none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == plain.choices[0].finish_reason
    )
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # no tools rendered


def test_tool_history_renders_by_the_fallback_exactly(sync_client, model, tiny_target, tokenizer):  # noqa: F811
    history = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w5", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "w6 w7"},
    ]
    tools = [{"type": "function", "function": {"name": "w5"}}]
    spec = parse_tools({"tools": tools})
    assert spec is not None
    ids = render_chat(tokenizer, parse_messages(history), spec.rendered())
    expected = tokenizer.decode(greedy_ids(tiny_target, ids, NEW_TOKENS), skip_special_tokens=True)
    reply = sync_client.chat.completions.create(
        model=model, messages=history, tools=tools, max_tokens=NEW_TOKENS, temperature=0
    )
    assert reply.usage.prompt_tokens == len(ids)
    # The word vocabulary cannot spell a call: the whole answer is content.
    assert reply.choices[0].message.content == expected and reply.choices[0].message.tool_calls is None
    streamed = sync_client.chat.completions.create(
        model=model, messages=history, tools=tools, max_tokens=NEW_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


# --- served: the real default model ------------------------------------------------------------


class DefaultStack:
    """The default model behind two coordinators: speculating (prompt lookup, k = 4) and target-only
    (k = 0); ``url`` and ``alone_url`` are their OpenAI base URLs."""

    def __init__(self, loaded, redis_url: str) -> None:
        facts = loaded.facts("ngram")
        self.stack = InProcessStack(TargetEngine(loaded, 8), NgramDrafter(facts, 8, 3, 1), Path("default"), redis_url)
        port, alone_port = free_port(), free_port()
        self.stack.start(default_k=4, http_port=port)
        self.stack.add_coordinator(default_k=0, http_port=alone_port)
        self.url, self.alone_url = f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{alone_port}/v1"


@pytest.fixture(scope="module")
def default_stack(default_model, redis_url):
    two = DefaultStack(default_model, redis_url)
    yield two
    two.stack.close()


@pytest.fixture(scope="module")
def default_client(default_stack):
    with openai.OpenAI(base_url=default_stack.url, api_key="none", max_retries=0, timeout=300) as client:
        yield client


def _sessions(running: InProcessStack) -> list[str]:
    """The session of each request served so far, in order."""
    spans = running.exporter.get_finished_spans()
    return [s.attributes["specdec.session"] for s in spans if s.name == "specdec.generate"]


@pytest.mark.slow
def test_openai_required_call_validates_and_equals_target_only(default_stack, default_client):
    base = dict(messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0)
    name = default_client.models.list().data[0].id
    reply = default_client.chat.completions.create(model=name, max_tokens=60, **base)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert reply.model_extra["specdec"]["drafted_tokens"] > 0
    with openai.OpenAI(base_url=default_stack.alone_url, api_key="none", max_retries=0, timeout=300) as alone:
        target_only = alone.chat.completions.create(model=name, max_tokens=60, **base)
    assert target_only.model_extra["specdec"]["drafted_tokens"] == 0
    assert target_only.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    assert target_only.usage.completion_tokens == reply.usage.completion_tokens

    # Streamed: the call arrives whole in one delta, in OpenAI's streaming shape, equal to the answer.
    deltas, finish = [], None
    for chunk in default_client.chat.completions.create(model=name, max_tokens=60, stream=True, **base):
        delta = chunk.choices[0].delta
        assert not delta.content
        deltas += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    (streamed,) = deltas
    assert (streamed.index, streamed.type, streamed.id[:5]) == (0, "function", "call_")
    assert (streamed.function.name, streamed.function.arguments) == ("get_weather", call.function.arguments)


@pytest.mark.slow
def test_langchain_bind_tools_round_trip_with_a_tool_result(default_stack):
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"18 degrees and sunny in {city}"

    chat = ChatOpenAI(model=DEFAULT_MODEL_ID, base_url=default_stack.url, api_key="none", temperature=0, max_tokens=60)
    before = len(_sessions(default_stack.stack))
    question = HumanMessage("What is the weather like in Paris today?")
    called = chat.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    (call,) = called.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["id"].startswith("call_")
    result = ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])
    answer = chat.bind_tools([get_weather]).invoke([question, called, result], max_tokens=24)
    assert answer.content or answer.tool_calls
    first, second = _sessions(default_stack.stack)[before:]
    # LangChain sent the call back as the server answered it: the conversation continued its session.
    assert first == second


def test_a_continued_conversation_renders_as_the_client_sent_it(tokenizer):  # noqa: F811
    # The session holds the answer as generated; the client sends back its parsed form.
    generated = [*CHAT, {"role": "assistant", "content": "w9 w9"}]
    sent = [*CHAT, {"role": "assistant", "content": "w8"}, {"role": "user", "content": "w4"}]
    turn = build_turn(tokenizer, render_chat(tokenizer, generated), generated, None, sent, "", whole=True)
    assert turn.tokens == render_chat(tokenizer, sent) and turn.messages == sent
