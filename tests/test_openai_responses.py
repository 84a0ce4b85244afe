"""OpenAI's Responses API, ``POST /v1/responses`` (issue 41), served as the chat path.

The translation is tested without a network: a Responses body must parse into exactly the chat
request of the same conversation, the refused parameters must be 400s naming them, and the builder
must make the documented events and response objects. Then the real ``openai`` package drives two
served stacks of tiny models: tests/test_openai_api.py's word vocabulary (text, streaming, errors),
and one over single characters whose tokenizer spells text without separators, so that a JSON
schema and the tool grammar can be written and parsed. Greedy output through /v1/responses must equal
the same conversation through /v1/chat/completions, and target-only decoding where it is computed.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from harness import InProcessStack
from opentelemetry import trace
from pydantic import BaseModel, Field
from test_openai_api import (  # noqa: F401 - fixtures, shared with the API's own tests
    CHAT,
    KEY,
    NEW_TOKENS,
    Facts,
    FailingLoop,
    ScriptedLoop,
    chat_tokenizer_dir,
    http,
    model,
    reference_text,
    served,
    stack,
    sync_client,
    tokenizer,
)
from tiny import make_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from coordinator.admission import Admission
from coordinator.openai_api import OpenAiApi
from coordinator.openai_responses import input_messages, parse_responses
from coordinator.openai_responses_output import ResponseBuilder
from coordinator.openai_schema import ApiError, parse_request
from coordinator.replicas import BackendUnavailable
from coordinator.tools import assistant_message
from coordinator.turns import Stats
from draft_service.engine import ModelDrafter
from specdec.config import AdmissionLimits
from specdec.models import load_model
from specdec.stack import free_port
from target_service.engine import TargetEngine

MODELS = ("m",)
CONTEXT, VOCAB = 256, 32
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
TEXT_DONE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def named_events(payload: bytes) -> list[dict]:
    """The events of a Responses stream, each checked to be named by its type (``event:`` lines, as
    OpenAI's Responses streams name them; no ``[DONE]``)."""
    events = []
    for block in payload.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"]
        events.append(event)
    return events


def parse(body: dict):
    return parse_responses(body, MODELS, CONTEXT, VOCAB)


def chat_core(body: dict):
    """The core request of a chat body, without the fingerprint (a digest of the body as sent)."""
    return replace(parse_request(body, True, MODELS, CONTEXT, VOCAB).choices[0], fingerprint="")


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as raised:
        parse(body)
    assert raised.value.status == 400
    return raised.value


# --- parsing: a Responses body is its chat request ---------------------------------------------


def test_a_string_input_with_instructions_is_the_chat_request():
    request = parse(
        {"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3}
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = chat_core({"messages": messages, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3})
    assert replace(request.chat.choices[0], fingerprint="") == expected
    assert request.origins == ("instructions", "input") and not request.stream
    assert request.settings["max_output_tokens"] == 7 and request.settings["text"] == {"format": {"type": "text"}}


def test_input_items_map_to_chat_messages_and_tool_history():
    items = [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "Be "}, {"type": "input_text", "text": "brief."}],
        },
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
            "id": "fc_1",
        },
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "21 C"}]},
        {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": "{}"},
        {"type": "message", "role": "assistant", "content": "And more."},
    ]
    messages, origins = input_messages(None, items)
    call = {"type": "function"}
    assert messages == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "call_1", **call, "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "call_2", **call, "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "21 C"},
        # Text after calls joins their turn, as the chat path's answer holds both.
        {
            "role": "assistant",
            "content": "And more.",
            "tool_calls": [{"id": "call_3", **call, "function": {"name": "get_weather", "arguments": "{}"}}],
        },
    ]
    assert origins == ["input[0]", "input[1]", "input[2]", "input[5]", "input[6]", "input[7]"]
    body = {"input": items, "tools": [WEATHER], "temperature": 0}
    chat = {
        "messages": messages,
        "tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
    }
    assert replace(parse(body).chat.choices[0], fingerprint="") == chat_core({**chat, "temperature": 0})


def test_tools_tool_choice_and_text_format_are_the_chat_fields():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    request = parse(
        {
            "input": "x",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
        }
    )
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    expected = parse_request(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [chat_tool],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False,
        },
        True,
        MODELS,
        CONTEXT,
        VOCAB,
    )
    assert request.chat.tools == expected.tools and request.chat.choices[0].response_format
    assert request.chat.choices[0].response_format == expected.choices[0].response_format
    assert request.settings["tools"] == [WEATHER] and request.settings["parallel_tool_calls"] is False
    fmt = {"type": "json_schema", "name": "t", "schema": schema, "strict": True}
    constrained = parse({"input": "x", "text": {"format": fmt}})
    chat_format = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    assert (
        constrained.chat.choices[0].response_format
        == chat_core({"messages": [{"role": "user", "content": "x"}], "response_format": chat_format}).response_format
    )
    assert constrained.settings["text"] == {"format": fmt}
    assert parse({"input": "x", "text": {"format": {"type": "json_object"}}}).chat.choices[0].response_format
    assert parse({"input": "x", "text": {"format": {"type": "text"}}}).chat.choices[0].response_format == ""


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"n": 2}, "n"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({"max_tokens": 5}, "max_tokens"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_what_is_not_served_is_refused_naming_it(extra, param):
    error = refused({"input": "x", **extra})
    assert (error.param, error.code) == (param, "unsupported_parameter")
    assert error.message.startswith(param + ":")


def test_neutral_values_of_unserved_parameters_are_accepted():
    neutral = {
        "store": False,
        "background": False,
        "reasoning": {"effort": None},
        "include": [],
        "truncation": "disabled",
        "top_logprobs": 0,
        "service_tier": "auto",
        "previous_response_id": None,
        "text": {"verbosity": "medium"},
        "prompt_cache_key": "k",
        "safety_identifier": "u1",
        "user": "u1",
        "metadata": {"run": "1"},
    }
    request = parse({"input": "x", **neutral})
    assert request.settings["metadata"] == {"run": "1"} and request.settings["user"] == "u1"


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({}, "input", None),
        ({"input": []}, "input", None),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", None),
        ({"input": [{"role": "user", "content": 3}]}, "input[0].content", None),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", None),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
            "input[0].arguments",
            None,
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
            "input[0].arguments",
            None,
        ),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output", None),
        ({"input": "x", "instructions": ["x"]}, "instructions", None),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", None),
        ({"input": "x", "max_output_tokens": CONTEXT + 1}, "max_output_tokens", "context_length_exceeded"),
        ({"input": "x", "temperature": 3}, "temperature", None),
        ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name", None),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
            "tools[0].parameters",
            None,
        ),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", None),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", None),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "t"}}}, "text.format.schema", None),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format", None),
        (
            {"input": "x", "tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
            "text.format",
            None,
        ),
        ({"input": "x", "metadata": {"k": 1}}, "metadata", None),
        ({"input": "x", "stream_options": {}}, "stream_options", None),
    ],
)
def test_bad_input_is_a_400_naming_the_responses_parameter(body, param, code):
    error = refused(body)
    assert (error.param, error.code) == (param, code), error.message
    assert "max_completion_tokens" not in error.message and "response_format" not in error.message
    assert ".function." not in error.message


def test_a_model_not_served_is_a_404():
    with pytest.raises(ApiError) as raised:
        parse({"input": "x", "model": "other"})
    assert (raised.value.status, raised.value.code) == (404, "model_not_found")


# --- the builder: events and the response object ------------------------------------------------


def stats(generated: int = 2) -> Stats:
    return Stats(prompt_tokens=5, generated_tokens=generated, rounds=1, drafted_tokens=4, accepted_tokens=1)


def test_text_streams_into_one_message_and_the_response_is_its_final_state():
    built = ResponseBuilder(parse({"input": "x", "temperature": 0}), "resp_1", 123)
    events = built.start() + built.feed("Hel") + built.feed("") + built.feed("lo", "stop", stats())
    assert [e["type"] for e in events] == [
        *TEXT_EVENTS,
        "response.output_text.delta",
        "response.output_text.delta",
        *TEXT_DONE,
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello"
    final = events[-1]["response"]
    assert final == built.response()
    assert final["status"] == "completed" and final["incomplete_details"] is None
    (message,) = final["output"]
    assert message["type"] == "message" and message["status"] == "completed" and message["id"].startswith("msg_")
    assert message["content"] == [{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}]
    assert events[-2]["item"] == message
    assert final["usage"] == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 7,
    }
    assert (final["id"], final["object"], final["created_at"], final["model"]) == ("resp_1", "response", 123, "m")
    assert final["specdec"]["drafted_tokens"] == 4 and final["temperature"] == 0.0 and final["store"] is False
    assert built.content == "Hello" and built.calls == []


@pytest.mark.parametrize("reason", ["length", "context"])
def test_output_cut_by_the_limit_is_incomplete(reason):
    built = ResponseBuilder(parse({"input": "x", "max_output_tokens": 2}))
    events = built.feed("ab", reason, stats())
    assert events[-1]["type"] == "response.incomplete"
    final = built.response()
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"


def test_an_empty_answer_is_an_empty_message():
    built = ResponseBuilder(parse({"input": "x"}))
    events = built.feed("", "stop", stats(0))
    assert [e["type"] for e in events] == TEXT_EVENTS[2:] + TEXT_DONE + ["response.completed"]
    assert built.response()["output"][0]["content"][0]["text"] == ""


def test_tool_calls_become_function_call_items_and_round_trip_as_input():
    request = parse({"input": "Weather?", "tools": [WEATHER]})
    built = ResponseBuilder(request)
    text = f"Let me check.\n{CALL}"
    events = [e for i in range(0, len(text), 5) for e in built.feed(text[i : i + 5])]
    events += built.feed("", "stop", stats())
    assert [e["type"] for e in events] == [
        *TEXT_EVENTS[2:],
        *["response.output_text.delta"] * 3,
        *TEXT_DONE,
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    message, call = built.response()["output"]
    assert message["content"][0]["text"] == "Let me check."
    assert call["type"] == "function_call" and call["id"].startswith("fc_") and call["status"] == "completed"
    assert call["call_id"].startswith("call_") and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    added = next(e for e in events if e["type"] == "response.output_item.added" and e["output_index"] == 1)
    assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    # Sent back with the tool's result, the answer is the conversation the chat path would continue.
    follow_up = [
        {"role": "user", "content": "Weather?"},
        *built.response()["output"],
        {"type": "function_call_output", "call_id": call["call_id"], "output": "18 C"},
    ]
    messages = parse({"input": follow_up, "tools": [WEATHER]}).chat.choices[0].messages
    assert messages is not None and request.chat.choices[0].messages is not None
    assert messages[:2] == [*request.chat.choices[0].messages, assistant_message(built.content, built.calls)]


def output_items(response: dict) -> list:
    """A response's output items without their random ids, as (type, text or (name, arguments))."""
    return [
        ("message", item["content"][0]["text"])
        if item["type"] == "message"
        else ("function_call", (item["name"], item["arguments"]))
        for item in response["output"]
    ]


def test_text_after_a_call_is_a_message_after_it_however_rounds_cut_the_output():
    text = f"a{CALL} b"
    expected = [("message", "a"), ("function_call", ("get_weather", json.dumps({"city": "Paris"}))), ("message", "b")]
    for size in (len(text), 1, 2, 5, len(CALL) + 1):
        built = ResponseBuilder(parse({"input": "Weather?", "tools": [WEATHER]}))
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        events = [e for piece in pieces[:-1] for e in built.feed(piece)] + built.feed(pieces[-1], "stop", stats())
        assert output_items(built.response()) == expected, size
        added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
        assert added == ["message", "function_call", "message"]
        assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
        assert built.content == "ab" and [c.name for c in built.calls] == ["get_weather"]


def test_served_responses_keep_the_written_order_streamed_and_whole():
    text = f"a{CALL} b"

    async def run(size: int, stream: bool) -> list:
        api = OpenAiApi(ScriptedLoop(text, size), Facts(), Admission(AdmissionLimits()), trace.NoOpTracer())
        body = {"model": "tiny", "input": "Weather?", "tools": [WEATHER], "stream": stream}
        async with TestClient(TestServer(api.app(1 << 20))) as client:
            reply = await client.post("/v1/responses", json=body)
            assert reply.status == 200
            if not stream:
                return output_items(await reply.json())
            events = named_events(await reply.read())
            assert events[-1]["type"] == "response.completed"
            return output_items(events[-1]["response"])

    whole = asyncio.run(run(len(text), False))
    assert [kind for kind, _ in whole] == ["message", "function_call", "message"]
    for size in (len(text), 1, 3, len(CALL) + 1):
        assert asyncio.run(run(size, True)) == asyncio.run(run(size, False)) == whole, size


def test_a_failure_after_the_start_ends_the_stream_with_error_and_failed():
    built = ResponseBuilder(parse({"input": "x", "stream": True}))
    built.start()
    built.feed("a")
    error, failed = built.fail(ApiError(503, "no target replica answers", "server_error", code="backend_unavailable"))
    assert (error["type"], error["code"], error["message"]) == (
        "error",
        "backend_unavailable",
        "no target replica answers",
    )
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "backend_unavailable", "message": "no target replica answers"}
    # A failure without a code of its own is a server error, in the event as in the response.
    uncoded = ApiError(500, "internal error: KeyError", "server_error")
    error, failed = ResponseBuilder(parse({"input": "x"})).fail(uncoded)
    assert error["code"] == failed["response"]["error"]["code"] == "server_error"


# --- served: the tiny word stack ----------------------------------------------------------------


def test_responses_equal_chat_and_target_only(sync_client, model, tiny_target, tokenizer):  # noqa: F811
    common = dict(model=model, temperature=0)
    reply = sync_client.responses.create(input=CHAT[0]["content"], max_output_tokens=NEW_TOKENS, **common)
    chat = sync_client.chat.completions.create(messages=CHAT, max_tokens=NEW_TOKENS, **common)
    expected = reference_text(tiny_target, tokenizer, CHAT)
    assert reply.output_text == chat.choices[0].message.content == expected
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.model == model
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert reply.usage.total_tokens == chat.usage.total_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert reply.status == ("incomplete" if cut else "completed")
    assert reply.model_extra["specdec"]["drafted_tokens"] > 0


def test_a_streamed_response_equals_the_whole_one(sync_client, model, tiny_target, tokenizer):  # noqa: F811
    conversation = [
        {"role": "system", "content": "w3 w4"},
        {"role": "user", "content": "w7 w7 w8"},
        {"role": "assistant", "content": "w9 w10"},
        {"role": "user", "content": "w11 w12"},
    ]
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "w3 w4"}]},
        {"role": "user", "content": "w7 w7 w8"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "w9 w10"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "w11 w12"}]},
    ]
    expected = reference_text(tiny_target, tokenizer, conversation)
    common = dict(model=model, input=items, max_output_tokens=NEW_TOKENS, temperature=0)
    whole = sync_client.responses.create(**common)
    events = list(sync_client.responses.create(stream=True, **common))
    assert whole.output_text == expected
    types = [e.type for e in events]
    assert types[:4] == TEXT_EVENTS and types[-4:-1] == TEXT_DONE
    assert types[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    final = events[-1].response
    assert final.output_text == expected and final.usage == whole.usage and final.status == whole.status
    chat = sync_client.chat.completions.create(model=model, messages=conversation, max_tokens=NEW_TOKENS, temperature=0)
    assert chat.choices[0].message.content == expected


def test_a_response_cut_by_max_output_tokens_is_incomplete(served, model):  # noqa: F811
    body = {"model": model, "input": CHAT[0]["content"], "max_output_tokens": 3, "temperature": 0}
    status, raw, _ = http(served, "POST", "/v1/responses", body)
    reply = json.loads(raw)
    assert status == 200 and reply["status"] == "incomplete"
    assert reply["incomplete_details"] == {"reason": "max_output_tokens"} and reply["usage"]["output_tokens"] == 3
    status, raw, headers = http(served, "POST", "/v1/responses", {**body, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = named_events(raw)
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"
    assert events[-1]["response"]["output"][0]["content"] == reply["output"][0]["content"]


@pytest.mark.parametrize(
    "extra, param, code",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "unsupported_parameter"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
        ({"store": True}, "store", "unsupported_parameter"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input[0].arguments",
            None,
        ),
        ({"input": "w1 " * 400}, "input", "context_length_exceeded"),
    ],
)
def test_bad_requests_are_400s_from_the_openai_client(sync_client, model, extra, param, code):  # noqa: F811
    body = {"model": model, "input": "w1 w2", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as raised:
        sync_client.responses.create(**body)
    assert raised.value.status_code == 400
    assert (raised.value.body["param"], raised.value.body["code"]) == (param, code)
    assert raised.value.body["message"]


def test_a_body_that_is_not_json_is_a_400(served):  # noqa: F811
    status, raw, _ = http(served, "POST", "/v1/responses", b"{nope")
    assert status == 400 and json.loads(raw)["error"]["code"] == "invalid_json"


def test_a_failure_is_an_error_status_before_the_stream_and_error_events_after():
    async def run(before: int) -> tuple[int, str]:
        error = BackendUnavailable("target", "127.0.0.1:1", "connection refused")
        api = OpenAiApi(FailingLoop(error, before), Facts(), Admission(AdmissionLimits()), trace.NoOpTracer())
        async with TestClient(TestServer(api.app(1 << 20))) as client:
            reply = await client.post("/v1/responses", json={"model": "tiny", "input": "w1", "stream": True})
            return reply.status, await reply.text()

    status, body = asyncio.run(run(0))
    assert status == 503 and json.loads(body)["error"]["code"] == "backend_unavailable"
    status, body = asyncio.run(run(2))
    events = named_events(body.encode())
    assert status == 200 and [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "backend_unavailable" and events[-1]["response"]["status"] == "failed"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "w1 w1 "


def test_a_failure_mid_answer_names_the_responses_parameter_whole_or_streamed():
    async def run(stream: bool) -> tuple[int, str]:
        error = ApiError(400, "max_completion_tokens: too many for this turn", param="max_completion_tokens")
        api = OpenAiApi(FailingLoop(error, 2), Facts(), Admission(AdmissionLimits()), trace.NoOpTracer())
        async with TestClient(TestServer(api.app(1 << 20))) as client:
            reply = await client.post("/v1/responses", json={"model": "tiny", "input": "w1", "stream": stream})
            return reply.status, await reply.text()

    status, body = asyncio.run(run(False))
    error = json.loads(body)["error"]
    assert (status, error["param"]) == (400, "max_output_tokens")
    assert error["message"] == "max_output_tokens: too many for this turn"
    status, body = asyncio.run(run(True))
    event = named_events(body.encode())[-2]
    assert (status, event["type"], event["param"]) == (200, "error", "max_output_tokens")
    assert event["message"] == "max_output_tokens: too many for this turn"


# --- served: tiny models over single characters (JSON and tool calls) ---------------------------

# Enough characters for a tool call block, a small JSON document and its keys (the tiny models'
# vocabulary has room for 30).
CHARS = ["{", "}", '"', ":", ",", " ", "\n", "<", ">", "/", "_", *"01234", *"abcefglmnorstu"]
# A chat template in those characters: the role's initial, the content, an end of turn.
CHARS_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }} {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}a {% endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "bar": {"type": "integer", "minimum": 0, "maximum": 99},
        "set": {"type": "boolean"},
    },
    "required": ["name", "bar", "set"],
}
ADD = {
    "type": "function",
    "name": "a",
    "description": "a number",
    "parameters": {
        "type": "object",
        "properties": {"b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["b"],
    },
    "strict": True,
}


class Thing(BaseModel):
    """SCHEMA as a Pydantic model, as the ``openai`` package's ``responses.parse`` takes it."""

    name: str = Field(max_length=4)
    bar: int = Field(ge=0, le=99)
    set: bool


def _chars_tokenizer(folder: Path) -> None:
    """The character vocabulary's tokenizer (as tiny.make_tokenizer's) with a decoder that joins
    tokens without spaces, so the served text is the characters the grammar wrote."""
    vocab = ["<unk>", "<eos>", *CHARS]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.Fuse()
    chars = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", eos_token="<eos>", clean_up_tokenization_spaces=False
    )
    chars.chat_template = CHARS_TEMPLATE
    chars.save_pretrained(folder)


@pytest.fixture(scope="module")
def chars_url(tmp_path_factory, redis_url):
    root = tmp_path_factory.mktemp("response-chars")
    target = load_model(str(make_model(root / "target", seed=3, words=CHARS)), root)
    draft = load_model(str(make_model(root / "draft", seed=4, layers=1, words=CHARS)), root)
    _chars_tokenizer(root / "served")
    s = InProcessStack(TargetEngine(target, 16), ModelDrafter(draft, 16, 0), root / "served", redis_url)
    port = free_port()
    s.start(default_k=4, http_port=port)
    yield f"http://127.0.0.1:{port}/v1"
    s.close()


@pytest.fixture(scope="module")
def chars_client(chars_url):
    with openai.OpenAI(base_url=chars_url, api_key="none", max_retries=0, timeout=120) as client:
        yield client


def test_a_json_schema_format_equals_chat_and_validates(chars_client):
    name = chars_client.models.list().data[0].id
    fmt = {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}
    common = dict(model=name, input="a b c", max_output_tokens=60, temperature=0)
    reply = chars_client.responses.create(text={"format": fmt}, **common)
    chat = chars_client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "a b c"}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}},
    )
    assert reply.status == "completed" and reply.output_text == chat.choices[0].message.content
    jsonschema.validate(json.loads(reply.output_text), SCHEMA)
    assert reply.text.format.type == "json_schema"
    # The openai package's structured-output helpers, whole and streamed, parse it into the model.
    parsed = chars_client.responses.parse(text_format=Thing, **common)
    assert parsed.output_parsed == Thing.model_validate_json(reply.output_text)
    with chars_client.responses.stream(text_format=Thing, **common) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed


def test_a_function_tool_round_trip_equals_chat(chars_client):
    name = chars_client.models.list().data[0].id
    ask = {"role": "user", "content": "a b c"}
    forced = dict(tools=[ADD], tool_choice="required", parallel_tool_calls=False, temperature=0, max_output_tokens=90)
    reply = chars_client.responses.create(model=name, input=[ask], **forced)
    (call,) = reply.output
    assert reply.status == "completed" and call.type == "function_call" and call.name == "a"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    chat_tool = {"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}
    chat = chars_client.chat.completions.create(
        model=name,
        messages=[ask],
        tools=[chat_tool],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=90,
    )
    (chat_call,) = chat.choices[0].message.tool_calls
    assert (chat_call.function.name, chat_call.function.arguments) == (call.name, call.arguments)

    # Streamed: the call comes as one item with its arguments, equal to the whole answer's.
    events = list(chars_client.responses.create(model=name, input=[ask], stream=True, **forced))
    types = [e.type for e in events]
    assert "response.output_text.delta" not in types and types[-1] == "response.completed"
    assert types[2:6] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert events[3].delta == call.arguments and events[5].item.name == "a"

    # The call and its result sent back: the answer is the chat path's for the same history.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "1 2"}
    follow = [ask, *[item.model_dump(exclude_none=True) for item in reply.output], result]
    answer = chars_client.responses.create(model=name, input=follow, tools=[ADD], temperature=0, max_output_tokens=12)
    history = [
        ask,
        {"role": "assistant", "content": None, "tool_calls": [chat_call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": chat_call.id, "content": "1 2"},
    ]
    chat_answer = chars_client.chat.completions.create(
        model=name, messages=history, tools=[chat_tool], temperature=0, max_tokens=12
    )
    text = chat_answer.choices[0].message.content or ""
    assert answer.output_text == text and answer.usage.input_tokens == chat_answer.usage.prompt_tokens
    calls = [item for item in answer.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in chat_answer.choices[0].message.tool_calls or []
    ]
