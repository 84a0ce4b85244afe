"""The OpenAI-compatible HTTP API (coordinator.openai_api), driven by the real ``openai`` package and
by raw HTTP, over real gRPC services and a real redis-server.

Its output must equal the gRPC SDK's and target-only greedy decoding; bad input must get the
documented status and leave the server serving. Tiny models (with a word-level chat template) for
most tests; the real default model for one exactness test.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx2  # the openai package's HTTP client
import openai
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from harness import InProcessStack
from opentelemetry import trace
from test_auth_tls import certs  # noqa: F401 - the throwaway CA and server certificate

from coordinator.admission import Admission
from coordinator.auth import hash_key
from coordinator.openai_api import OpenAiApi, model_id
from coordinator.openai_sessions import Conversations
from coordinator.prompts import render_chat
from coordinator.replicas import BackendUnavailable
from coordinator.turns import Chunk, Stats
from draft_service.engine import ModelDrafter, NgramDrafter
from specdec import Client
from specdec.client import InvalidArgument
from specdec.config import AdmissionLimits, ServerConfig
from specdec.stack import free_port
from specdec.vocab import load_tokenizer
from target_service.engine import TargetEngine

KEY = "sk-openai-test-key"
# A chat template over the tiny vocabulary: w1 opens a user turn, w2 an assistant's, w3 a system's.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ {'user': 'w1', 'assistant': 'w2', 'system': 'w3'}[m['role']] }} "
    "{{ m['content'] }} <eos> {% endfor %}{% if add_generation_prompt %}w2 {% endif %}"
)
CHAT = [{"role": "user", "content": "w7 w7 w8 w9 w10"}]
PROMPT = "w11 w12 w13 w11 w12"
NEW_TOKENS = 20


def greedy_ids(loaded, ids: list[int], max_new_tokens: int) -> list[int]:
    """Target-only greedy decoding with HF generate, in process: the reference."""
    with torch.inference_mode():
        out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def reference_text(loaded, tokenizer, prompt: str | list[dict], max_new_tokens: int = NEW_TOKENS) -> str:
    """What target-only greedy decoding answers, as text."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
    else:
        ids = render_chat(tokenizer, prompt)
    return tokenizer.decode(greedy_ids(loaded, ids, max_new_tokens), skip_special_tokens=True)


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tiny_dir, tmp_path_factory) -> Path:
    """The tiny target's tokenizer with a chat template (the template leaves the fingerprint alone)."""
    folder = tmp_path_factory.mktemp("chat-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_dir / "target" / name).exists():
            shutil.copy(tiny_dir / "target" / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer_dir):
    return load_tokenizer(chat_tokenizer_dir)


class Served:
    """A coordinator's gRPC address and HTTP base URL."""

    def __init__(self, stack: InProcessStack, http_port: int, **overrides) -> None:
        self.grpc = stack.add_coordinator(http_port=http_port, **overrides)
        self.url = f"http://127.0.0.1:{http_port}"
        self.round_loop = stack.round_loops[-1]


@pytest.fixture(scope="module")
def stack(tiny_target, tiny_draft, chat_tokenizer_dir, redis_url):
    """Tiny target, a different tiny model draft, and coordinators that serve HTTP behind an API key."""
    s = InProcessStack(TargetEngine(tiny_target, 64), ModelDrafter(tiny_draft, 64, 64), chat_tokenizer_dir, redis_url)
    s.target_address = s.add_target(s.target_engine)
    s.draft_address = s.add_draft(s.draft_engine)
    yield s
    s.close()


@pytest.fixture(scope="module")
def served(stack) -> Served:
    return Served(stack, free_port(), api_key_hashes=(hash_key(KEY),))


@pytest.fixture(scope="module")
def model(served) -> str:
    return json.loads(http(served, "GET", "/v1/models")[1])["data"][0]["id"]


@pytest.fixture(scope="module")
def sync_client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def http(
    served: Served,
    method: str,
    path: str,
    body: bytes | dict | None = None,
    key: str | None = KEY,
    headers: dict | None = None,
) -> tuple[int, bytes, dict]:
    """One raw HTTP request (urllib): status, body and headers; error statuses are returned, not raised."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(served.url + path, data=data, method=method, headers=headers or {})
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read(), dict(reply.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), dict(error.headers)


def sse_events(payload: bytes) -> list:
    """The ``data:`` payloads of a server-sent event stream, JSON-decoded except ``[DONE]``."""
    events = []
    for block in payload.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# --- exactness: openai client (sync, async, streaming), raw HTTP, gRPC SDK, target-only ------------


def test_models_lists_the_served_model(served, model, stack):
    status, body, _ = http(served, "GET", "/v1/models")
    assert status == 200
    assert json.loads(body) == {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": 0, "owned_by": "specdec"}],
    }
    assert model == model_id(served.round_loop._facts)
    assert http(served, "GET", f"/v1/models/{model}")[0] == 200
    assert http(served, "GET", "/v1/models/other")[0] == 404


def test_chat_equals_grpc_sdk_and_target_only(served, model, sync_client, tiny_target, tokenizer):
    expected = reference_text(tiny_target, tokenizer, CHAT)
    expected_ids = greedy_ids(tiny_target, render_chat(tokenizer, CHAT), NEW_TOKENS)
    with Client(served.grpc, timeout=60, api_key=KEY) as grpc_client:
        grpc_reply = grpc_client.complete(CHAT, max_new_tokens=NEW_TOKENS)
    reply = sync_client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=NEW_TOKENS, temperature=0, extra_body={"return_token_ids": True}
    )
    assert reply.choices[0].message.content == grpc_reply.text == expected
    assert reply.choices[0].model_extra["token_ids"] == grpc_reply.token_ids == expected_ids
    assert reply.choices[0].message.role == "assistant" and reply.object == "chat.completion"
    assert reply.usage.prompt_tokens == len(render_chat(tokenizer, CHAT))
    assert reply.usage.completion_tokens + reply.usage.prompt_tokens == reply.usage.total_tokens
    assert reply.choices[0].finish_reason in ("stop", "length")
    spec = reply.model_extra["specdec"]
    assert set(spec) == {"acceptance_rate", "mean_accepted_length", "drafted_tokens", "accepted_tokens", "rounds"}
    assert spec["rounds"] >= 1 and spec["drafted_tokens"] > 0


def test_penalties_and_logit_bias_equal_the_grpc_sdk(served, model, sync_client, tokenizer):
    """Penalties and a logit bias reach the round loop as the gRPC API's: the same greedy tokens, and
    not those of the plain request (the bias bans the plain answer's first token)."""
    plain = sync_client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    first = plain.choices[0].model_extra["token_ids"][0]
    penalties = dict(presence_penalty=1.2, frequency_penalty=0.7, logit_bias={first: -100.0})
    with Client(served.grpc, timeout=60, api_key=KEY) as grpc_client:
        grpc_reply = grpc_client.complete(PROMPT, max_new_tokens=12, **penalties)
    reply = sync_client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        presence_penalty=1.2,
        frequency_penalty=0.7,
        logit_bias={str(first): -100},
        extra_body={"return_token_ids": True},
    )
    assert reply.choices[0].model_extra["token_ids"] == grpc_reply.token_ids
    assert first not in grpc_reply.token_ids


def test_chat_stream_with_usage(sync_client, model, tiny_target, tokenizer):
    stream = sync_client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_completion_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference_text(tiny_target, tokenizer, CHAT)
    # As OpenAI's streams open: the role alone, then the text, which never repeats the role.
    assert (chunks[0].choices[0].delta.role, chunks[0].choices[0].delta.content) == ("assistant", "")
    assert chunks[1].choices[0].delta.content and all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and "specdec" in finish[0].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_async_completions_stream_and_not(served, model, tiny_target, tokenizer):
    expected = reference_text(tiny_target, tokenizer, PROMPT)

    async def run():
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0) as client:
            whole = await client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
            stream = await client.completions.create(
                model=model, prompt=[PROMPT], max_tokens=NEW_TOKENS, temperature=0, stream=True
            )
            parts = [c async for c in stream]
            return whole, parts

    whole, parts = asyncio.run(run())
    assert whole.choices[0].text == expected and whole.object == "text_completion"
    assert "".join(p.choices[0].text for p in parts) == expected
    assert parts[-1].choices[0].finish_reason is not None and "specdec" in parts[-1].model_extra


def test_raw_http_stream_ends_with_done(served, model, tiny_target, tokenizer):
    status, body, headers = http(
        served,
        "POST",
        "/v1/completions",
        {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        },
        headers={"Content-Type": "application/json"},
    )
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(body)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == reference_text(
        tiny_target, tokenizer, PROMPT
    )
    # Completions have no role chunk: text from the first chunk on, as OpenAI's.
    assert events[0]["choices"][0]["text"] and all("delta" not in e["choices"][0] for e in events[:-2])
    ids = [t for e in events[:-1] if e["choices"] for t in e["choices"][0]["token_ids"]]
    assert ids == greedy_ids(tiny_target, tokenizer.encode(PROMPT, add_special_tokens=False), NEW_TOKENS)
    assert events[-2]["usage"]["completion_tokens"] > 0


def test_stop_seed_and_sampling_parameters(sync_client, model):
    base = dict(model=model, messages=CHAT, max_tokens=NEW_TOKENS)
    sampled = [
        sync_client.chat.completions.create(**base, temperature=0.8, top_p=0.9, seed=7).choices[0].message.content
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]  # a seed repeats exactly
    greedy = sync_client.chat.completions.create(**base, temperature=0).choices[0].message.content
    words = greedy.split()
    assert len(words) > 2
    stopped = sync_client.chat.completions.create(**base, temperature=0, stop=[words[2]], user="someone")
    assert stopped.choices[0].finish_reason == "stop"
    assert words[2] not in stopped.choices[0].message.content and greedy.startswith(stopped.choices[0].message.content)


# --- several choices: n, a list of prompts, token-id prompts ------------------------------------------


def test_n_choices_are_turns_seeded_seed_plus_index(served, model, sync_client, tokenizer):
    """Choice i of a seeded request samples as the same request with seed + i alone; streamed, each
    choice's chunks carry its index and add up to the same text; usage counts the prompt once."""
    base = dict(model=model, messages=CHAT, max_tokens=NEW_TOKENS, temperature=1.0)
    whole = sync_client.chat.completions.create(**base, n=3, seed=11, extra_body={"return_token_ids": True})
    alone = [sync_client.chat.completions.create(**base, seed=11 + i) for i in range(3)]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.message.content for c in whole.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in whole.choices}) > 1  # sampled apart, not one answer thrice
    assert whole.usage.prompt_tokens == len(render_chat(tokenizer, CHAT)) == alone[0].usage.prompt_tokens
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert whole.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in whole.choices)
    # Rounds are the policy's choice (adaptive k), not part of the answer: only their sum's bounds are fixed.
    assert 3 <= whole.model_extra["specdec"]["rounds"] <= whole.usage.completion_tokens
    chunks = list(
        sync_client.chat.completions.create(**base, n=3, seed=11, stream=True, stream_options={"include_usage": True})
    )
    texts, finishes = ["", "", ""], [0, 0, 0]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices  # one choice per chunk, as OpenAI streams them
        texts[choice.index] += choice.delta.content or ""
        finishes[choice.index] += choice.finish_reason is not None
    assert texts == [c.message.content for c in whole.choices] and finishes == [1, 1, 1]
    # Each choice opens with its role chunk before any of its text.
    assert [c.choices[0].index for c in chunks[:3]] == [0, 1, 2] and all(c.choices[0].delta.role for c in chunks[:3])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    # Greedy choices are all the one greedy answer, as OpenAI's are.
    greedy = sync_client.chat.completions.create(**{**base, "temperature": 0}, n=2)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_list_and_token_id_prompts_answer_prompt_major(served, model, tiny_target, tokenizer):
    """Completions of several prompts, text or token ids, each equal to target-only greedy decoding of
    its prompt; choices index prompt-major (prompt p's n choices at p * n ... p * n + n - 1)."""
    second = "w4 w5 w6 w4"
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in (PROMPT, second)]
    expected = [reference_text(tiny_target, tokenizer, p) for p in (PROMPT, second)]
    for prompt in ([PROMPT, second], ids):
        for stream in (False, True):
            body = {"model": model, "prompt": prompt, "n": 2, "max_tokens": NEW_TOKENS, "temperature": 0}
            status, reply, _ = http(served, "POST", "/v1/completions", {**body, "stream": stream})
            assert status == 200, reply
            texts = ["", "", "", ""]
            if stream:
                for event in sse_events(reply)[:-1]:
                    texts[event["choices"][0]["index"]] += event["choices"][0]["text"]
            else:
                answer = json.loads(reply)
                assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
                texts = [c["text"] for c in answer["choices"]]
                assert answer["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
            assert texts == [expected[0], expected[0], expected[1], expected[1]]
    # One prompt of token ids is taken as is, the same as its text.
    body = {"model": model, "prompt": ids[0], "max_tokens": NEW_TOKENS, "temperature": 0}
    status, reply, _ = http(served, "POST", "/v1/completions", body)
    assert status == 200 and json.loads(reply)["choices"][0]["text"] == expected[0]


def test_a_refused_choice_refuses_the_request(served, model):
    """One prompt of several past the context: the request's 400 is context_length_exceeded, stream or not."""
    limit = served.round_loop._facts.max_context
    for stream in (False, True):
        body = {"model": model, "prompt": [PROMPT, [2] * limit], "max_tokens": 4, "stream": stream}
        status, reply, _ = http(served, "POST", "/v1/completions", body)
        assert status == 400 and json.loads(reply)["error"]["code"] == "context_length_exceeded"


def test_grpc_sdk_takes_prompt_token_ids(served, tiny_target, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    with Client(served.grpc, timeout=60, api_key=KEY) as grpc_client:
        reply = grpc_client.complete(None, prompt_token_ids=ids, max_new_tokens=NEW_TOKENS)
        assert reply.token_ids == greedy_ids(tiny_target, ids, NEW_TOKENS)
        assert reply.stats.prompt_tokens == len(ids)
        vocab = served.round_loop._facts.vocab_size
        with pytest.raises(InvalidArgument, match="prompt_token_ids"):
            grpc_client.complete(None, prompt_token_ids=[1, vocab], max_new_tokens=2)
        with pytest.raises(InvalidArgument, match="prompt_token_ids"):
            grpc_client.complete(PROMPT, prompt_token_ids=ids, max_new_tokens=2)


# --- multi-turn: a conversation that extends one served continues its session ------------------------


def _generate_spans(stack) -> list:
    return [s for s in stack.exporter.get_finished_spans() if s.name == "specdec.generate"]


def test_extending_a_conversation_continues_its_session_exactly(stack, served, model, sync_client, tokenizer):
    first = sync_client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
    history = [
        *CHAT,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "w4 w5 w6"},
    ]
    before = len(_generate_spans(stack))
    second = sync_client.chat.completions.create(model=model, messages=history, max_tokens=8, temperature=0)
    with Client(served.grpc, timeout=60, api_key=KEY) as grpc_client:  # a fresh session renders the same tokens
        fresh = grpc_client.complete(history, max_new_tokens=8)
    assert second.choices[0].message.content == fresh.text
    assert second.usage.prompt_tokens == len(render_chat(tokenizer, history)) == fresh.stats.prompt_tokens
    spans = _generate_spans(stack)
    first_span = next(
        s for s in spans[:before][::-1] if s.attributes["gen_ai.usage.input_tokens"] == first.usage.prompt_tokens
    )
    second_span = next(
        s for s in spans[before:] if s.attributes["gen_ai.usage.input_tokens"] == second.usage.prompt_tokens
    )
    assert second_span.attributes["specdec.session"] == first_span.attributes["specdec.session"]
    # An edited history is not the served one: a session of its own.
    edited = [*history[:1], {"role": "assistant", "content": "w9"}, history[2]]
    sync_client.chat.completions.create(model=model, messages=edited, max_tokens=4, temperature=0)
    last = _generate_spans(stack)[-1]
    assert last.attributes["specdec.session"] not in {s.attributes.get("specdec.session") for s in spans}


def test_conversations_map_is_bounded_and_exact():
    now = [0.0]
    conversations = Conversations(ttl_s=10, max_entries=2, clock=lambda: now[0])
    a = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    conversations.put("key:1", a, "s1")
    assert conversations.take("key:2", [*a, {"role": "user", "content": "x"}]) is None  # another client
    assert conversations.take("key:1", [*a[:1], {"role": "assistant", "content": "yo!"}, a[0]]) is None
    assert conversations.take("key:1", [*a, {"role": "user", "content": "x"}]) == ("s1", 2)
    assert conversations.take("key:1", [*a, {"role": "user", "content": "x"}]) is None  # taken: owned by one
    conversations.put("key:1", a, "s1")
    now[0] = 11
    assert conversations.take("key:1", [*a, {"role": "user", "content": "x"}]) is None  # expired
    for i in range(3):
        conversations.put("key:1", [{"role": "user", "content": str(i)}], f"s{i}")
    assert len(conversations) == 2


# --- bad input: the documented status, and the server keeps serving ----------------------------------


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", b"[1, 2]", 400, None),
        ("/v1/chat/completions", {"model": "gpt-4o", "messages": CHAT}, 404, "model"),
        ("/v1/chat/completions", {"model": "M", "messages": "w1"}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"model": "M", "messages": [{"role": "robot", "content": "w1"}]},
            400,
            "messages[0].role",
        ),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "max_tokens": True}, 400, "max_tokens"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "temperature": "hot"}, 400, "temperature"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "stop": [1]}, 400, "stop"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "stop": ["w1" * 200]}, 400, "stop"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "top_p": 5}, 400, "top_p"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "top_k": -1}, 400, "top_k"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "temperature": 1e-9}, 400, "temperature"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "temperature": float("nan")}, 400, "temperature"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "n": 0}, 400, "n"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "n": 65}, 400, "n"),
        ("/v1/completions", {"model": "M", "prompt": [PROMPT] * 33, "n": 2}, 400, "prompt"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "max_tokens": 100_000}, 400, "max_tokens"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"model": "M", "messages": CHAT, "logprobs": True, "top_logprobs": 21},
            400,
            "top_logprobs",
        ),
        ("/v1/completions", {"model": "M", "prompt": PROMPT, "logprobs": -1}, 400, "logprobs"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "echo": True}, 400, "echo"),
        ("/v1/completions", {"model": "M", "prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "presence_penalty": 2.5}, 400, "presence_penalty"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "frequency_penalty": "x"}, 400, "frequency_penalty"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "repetition_penalty": 0}, 400, "repetition_penalty"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "logit_bias": {"32": 1}}, 400, "logit_bias"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "logit_bias": {"3": 150}}, 400, "logit_bias"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "logit_bias": {"w3": 1}}, 400, "logit_bias"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "logit_bias": [3]}, 400, "logit_bias"),
        (
            "/v1/chat/completions",
            {"model": "M", "messages": CHAT, "stream_options": {"include_usage": True}},
            400,
            "stream_options",
        ),
        ("/v1/completions", {"model": "M", "prompt": []}, 400, "prompt"),
        ("/v1/completions", {"model": "M", "prompt": [PROMPT, ""]}, 400, "prompt"),
        ("/v1/completions", {"model": "M", "prompt": [1, 2, 10**6]}, 400, "prompt"),
        ("/v1/completions", {"model": "M", "prompt": [[1, 2], [-1]]}, 400, "prompt"),
        ("/v1/completions", {"model": "M", "prompt": [[1, 2], [True]]}, 400, "prompt"),
        ("/v1/completions", {"model": "M", "prompt": [1.5]}, 400, "prompt"),
        ("/v1/completions", {"model": "M", "prompt": PROMPT, "seed": 2**63}, 400, "seed"),
        ("/v1/completions", {"model": "M", "prompt": PROMPT, "seed": -(2**63) - 1}, 400, "seed"),
        ("/v1/completions", {"model": "M", "prompt": PROMPT, "seed": 1.5}, 400, "seed"),
        ("/v1/completions", {"model": "M", "prompt": "w1 " * 300, "max_tokens": 4}, 400, "prompt"),
        ("/v1/chat/completions", {"model": "M", "messages": CHAT, "tool_choice": "auto"}, 400, "tool_choice"),
        (
            "/v1/chat/completions",
            {"model": "M", "messages": CHAT, "tool_choice": "none", "tools": []},
            400,
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"model": "M", "messages": CHAT, "tools": [{"type": "retrieval"}]},
            400,
            "tools[0].type",
        ),
    ],
)
def test_bad_requests_get_their_status(served, model, path, body, status, param):
    if isinstance(body, dict) and body.get("model") == "M":
        body = {**body, "model": model}
    code, reply, _ = http(served, "POST", path, body)
    assert code == status, reply
    error = json.loads(reply)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert b"Traceback" not in reply
    code, _, _ = http(served, "POST", "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2})
    assert code == 200  # still serving


def test_missing_or_wrong_key_is_401(served, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2}
    for key in (None, "sk-wrong"):
        status, reply, headers = http(served, "POST", "/v1/completions", body, key=key)
        assert status == 401 and json.loads(reply)["error"]["code"] in ("missing_api_key", "invalid_api_key")
        assert headers.get("WWW-Authenticate") == "Bearer"
    assert http(served, "GET", "/v1/models", key=None)[0] == 401
    assert http(served, "GET", "/health", key=None)[0] == 200  # probes need no key
    with openai.OpenAI(base_url=served.url + "/v1", api_key="sk-wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


def test_unknown_route_and_method_in_openai_shape(served):
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        code, reply, _ = http(served, method, path)
        assert code == status and "error" in json.loads(reply)


# --- OpenAI's conventions: context overflow, lenient model names, seeds, CORS --------------------------


def test_a_prompt_past_the_context_is_context_length_exceeded(served, model, sync_client):
    """Both of the core's refusals (too many characters to tokenize, too many tokens) and a max_tokens
    past the context carry OpenAI's code, with the param and message words that litellm and LangChain
    recognise; streaming or not, since the core refuses before the first token."""
    limit = served.round_loop._facts.max_context
    many_tokens, many_chars = "w1 " * limit, "w1 " * (limit * 11)  # ~3 characters a token
    chat, text = sync_client.chat.completions.create, sync_client.completions.create
    cases = [  # (param, the core's check that refuses it, the call)
        ("messages", "leave no room", lambda **kw: chat(messages=[{"role": "user", "content": many_tokens}], **kw)),
        ("messages", "cannot fit", lambda **kw: chat(messages=[{"role": "user", "content": many_chars}], **kw)),
        ("prompt", "leave no room", lambda **kw: text(prompt=many_tokens, **kw)),
        ("prompt", "cannot fit", lambda **kw: text(prompt=many_chars, **kw)),
        ("max_tokens", "max_tokens asks", lambda **kw: text(prompt=PROMPT, **{**kw, "max_tokens": limit + 1})),
    ]
    for param, check, call in cases:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as raised:
                call(model=model, max_tokens=4, stream=stream)
            error = raised.value
            assert (error.status_code, error.code, error.param, error.type) == (
                400,
                "context_length_exceeded",
                param,
                "invalid_request_error",
            )
            message = error.body["message"]
            assert message.startswith(f"This model's maximum context length is {limit} tokens.") and check in message


@pytest.fixture(scope="module")
def aliased(stack) -> Served:
    """A coordinator that answers to two more model names and to browsers from one origin, behind the API key."""
    return Served(
        stack,
        free_port(),
        api_key_hashes=(hash_key(KEY),),
        served_model_names=("gpt-4o-mini", "my-alias"),
        allowed_origins=("https://app.example.com",),
    )


@pytest.fixture(scope="module")
def any_origin(stack) -> Served:
    """A coordinator that answers CORS for every origin (open: no API key)."""
    return Served(stack, free_port(), allowed_origins=("*",))


def test_model_may_be_omitted_or_an_alias_and_answers_name_the_served_id(aliased, model, sync_client):
    status, body, _ = http(aliased, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [model, "gpt-4o-mini", "my-alias"]
    assert json.loads(http(aliased, "GET", "/v1/models/my-alias")[1])["id"] == "my-alias"
    expected = sync_client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0)
    with openai.OpenAI(base_url=aliased.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        for name in ("gpt-4o-mini", "my-alias", model):
            reply = client.chat.completions.create(model=name, messages=CHAT, max_tokens=6, temperature=0)
            assert reply.model == model and reply.choices[0].message.content == expected.choices[0].message.content
        with pytest.raises(openai.NotFoundError) as raised:
            client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
        assert (raised.value.code, raised.value.param) == ("model_not_found", "model")
    status, body, _ = http(
        aliased, "POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "temperature": 0}
    )
    assert status == 200
    reply = json.loads(body)
    assert reply["model"] == model and reply["choices"][0]["message"]["content"] == expected.choices[0].message.content
    status, body, _ = http(aliased, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True})
    assert status == 200 and sse_events(body)[0]["model"] == model
    assert http(aliased, "GET", "/v1/models/gpt-4o")[0] == 404


def test_any_int64_seed_is_taken_and_minus_one_is_none(served, model, sync_client):
    """A negative seed is the uint64 with the same bits (as the gRPC SDK would send it): equal output,
    repeatable; -1 (many clients' "random") is no seed at all."""
    base = dict(model=model, messages=CHAT, max_tokens=NEW_TOKENS, temperature=1.0)
    negative = [sync_client.chat.completions.create(**base, seed=-7).choices[0].message.content for _ in range(2)]
    with Client(served.grpc, timeout=60, api_key=KEY) as grpc_client:
        same_bits = grpc_client.complete(CHAT, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=2**64 - 7).text
        other = grpc_client.complete(CHAT, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=7).text
    assert negative[0] == negative[1] == same_bits
    assert other != same_bits  # the mapping keeps -7 and 7 apart
    for seed in (-1, -(2**63), 2**63 - 1):
        assert sync_client.chat.completions.create(**base, seed=seed).choices[0].message.content
    # Unseeded: a fresh random stream each time, so some of a few sampled answers differ.
    unseeded = {sync_client.chat.completions.create(**base, seed=-1).choices[0].message.content for _ in range(4)}
    assert len(unseeded) > 1


def test_cors_for_allowed_origins_only(aliased, any_origin, served, model):
    origin = "https://app.example.com"
    preflight = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
    }
    # A preflight carries no key, and is answered without one.
    status, _, headers = http(aliased, "OPTIONS", "/v1/chat/completions", key=None, headers=preflight)
    assert status == 204 and headers["Access-Control-Allow-Origin"] == origin
    assert set(headers["Access-Control-Allow-Methods"].split(", ")) >= {"GET", "POST"}
    allowed = {h.lower() for h in headers["Access-Control-Allow-Headers"].split(", ")}
    assert allowed >= {"authorization", "content-type", "x-stainless-os"}
    # Another origin's preflight gets nothing of it: the request goes on to auth, which refuses it.
    status, _, headers = http(
        aliased, "OPTIONS", "/v1/chat/completions", key=None, headers={**preflight, "Origin": "https://evil.example"}
    )
    assert status == 401 and "Access-Control-Allow-Origin" not in headers
    # Answers to the allowed origin name it: whole, streamed, and errors (so the page can read them).
    body = {"model": model, "messages": CHAT, "max_tokens": 4}
    for extra, key, want in (({}, KEY, 200), ({"stream": True}, KEY, 200), ({}, None, 401)):
        status, reply, headers = http(
            aliased, "POST", "/v1/chat/completions", {**body, **extra}, key=key, headers={"Origin": origin}
        )
        assert status == want and headers["Access-Control-Allow-Origin"] == origin and "Origin" in headers["Vary"]
        assert headers["Access-Control-Expose-Headers"] == "Retry-After"
        if extra:
            assert sse_events(reply)[-1] == "[DONE]"
    status, _, headers = http(aliased, "POST", "/v1/chat/completions", body, headers={"Origin": "https://evil.example"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    # "*" allows any origin.
    status, _, headers = http(
        any_origin, "OPTIONS", "/v1/completions", key=None, headers={**preflight, "Origin": "http://x:3000"}
    )
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "*"
    status, _, headers = http(any_origin, "GET", "/v1/models", key=None, headers={"Origin": "http://x:3000"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    # Without allowed origins (the default), no CORS at all, as before.
    status, _, headers = http(served, "OPTIONS", "/v1/chat/completions", key=None, headers=preflight)
    assert status in (401, 405) and not any(h.startswith("Access-Control-") for h in headers)
    status, _, headers = http(served, "POST", "/v1/chat/completions", body, headers={"Origin": origin})
    assert status == 200 and not any(h.startswith("Access-Control-") for h in headers)


def test_coordinator_flags_for_model_names_and_origins(monkeypatch):
    from coordinator.cli import coordinator_config
    from specdec.cli import _parser

    monkeypatch.delenv("SPECDEC_API_KEYS", raising=False)
    base = ["serve-coordinator", "--draft", "127.0.0.1:1", "--target", "127.0.0.1:2"]
    args = _parser().parse_args(
        [
            *base,
            "--served-model-name",
            "a, b",
            "--served-model-name",
            "c,a",
            "--allowed-origins",
            "https://x.io,http://y:3000",
        ]
    )
    config = coordinator_config(args)
    assert config.served_model_names == ("a", "b", "c")
    assert config.allowed_origins == ("https://x.io", "http://y:3000")
    assert coordinator_config(_parser().parse_args(base)).allowed_origins == ()
    for bad in (["--served-model-name", "a,,b"], ["--allowed-origins", "https://x.io/"], ["--allowed-origins", "x.io"]):
        with pytest.raises(SystemExit):
            coordinator_config(_parser().parse_args([*base, *bad]))


# --- admission: 429 with Retry-After, and a disconnect frees the slot ---------------------------------


@pytest.fixture(scope="module")
def narrow(stack) -> Served:
    """A coordinator that runs one request and queues none (open: no API key)."""
    return Served(stack, free_port(), admission=AdmissionLimits(max_active=1, max_queued=0))


def _stream_in_thread(served: Served, model: str, started: threading.Event, stop: threading.Event):
    """Streams a long completion and drops the connection once ``stop`` is set."""

    def run():
        with openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
            stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=200, temperature=0, stream=True)
            for _ in stream:
                started.set()
                if stop.is_set():
                    break
            stream.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_overload_is_429_with_retry_after_and_a_disconnect_frees_the_slot(stack, narrow, model):
    started, stop = threading.Event(), threading.Event()
    thread = _stream_in_thread(narrow, model, started, stop)
    try:
        assert started.wait(30)
        status, reply, headers = http(
            narrow, "POST", "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2}, key=None
        )
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert json.loads(reply)["error"]["code"] == "rate_limit_exceeded"
    finally:
        stop.set()
        thread.join(30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the disconnect closed the round loop's generator: the slot is free
        status, _, _ = http(
            narrow, "POST", "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2}, key=None
        )
        if status == 200:
            break
        time.sleep(0.1)
    assert status == 200
    # The dropped stream's turn was cut short (its generator closed), not run to its 200 tokens.
    (dropped,) = [s for s in _generate_spans(stack) if s.attributes.get("gen_ai.request.max_tokens") == 200]
    assert "gen_ai.response.finish_reasons" not in dropped.attributes


def test_a_choice_refused_admission_refuses_the_request_and_frees_the_others(narrow, model):
    """n=2 with room for one request: the second choice's 429 is the request's, and the first choice,
    cancelled with it, gives its slot back at once."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "n": 2}
    for stream in (False, True):
        status, reply, headers = http(narrow, "POST", "/v1/completions", {**body, "stream": stream}, key=None)
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert json.loads(reply)["error"]["code"] == "rate_limit_exceeded"
        status, _, _ = http(narrow, "POST", "/v1/completions", {**body, "n": 1, "max_tokens": 2}, key=None)
        assert status == 200


# --- traces: an HTTP server span over the round loop's --------------------------------------------------


def test_http_span_is_the_parent_of_the_request_span(stack, served, model):
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    http(
        served,
        "POST",
        "/v1/chat/completions",
        {"model": model, "messages": CHAT, "max_tokens": 3},
        headers={"traceparent": traceparent},
    )
    spans = stack.exporter.get_finished_spans()
    server = [
        s
        for s in spans
        if s.name == "POST /v1/chat/completions" and s.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    ]
    assert len(server) == 1 and server[0].kind == trace.SpanKind.SERVER
    assert server[0].parent.span_id == 0xB7AD6B7169203331
    assert server[0].attributes["http.response.status_code"] == 200
    assert server[0].attributes["http.route"] == "/v1/chat/completions"
    generate = [
        s
        for s in spans
        if s.name == "specdec.generate" and s.parent is not None and s.parent.span_id == server[0].context.span_id
    ]
    assert len(generate) == 1 and generate[0].attributes["gen_ai.operation.name"] == "chat"


# --- TLS, as the gRPC port has it -----------------------------------------------------------------------


def test_https_when_the_coordinator_serves_tls(stack, certs, model):  # noqa: F811
    port = free_port()
    stack.add_coordinator(server=ServerConfig(tls_cert=certs.server_cert, tls_key=certs.server_key), http_port=port)
    trust = ssl.create_default_context(cafile=str(certs.ca_cert))
    with openai.OpenAI(
        base_url=f"https://127.0.0.1:{port}/v1", api_key="none", max_retries=0, http_client=httpx2.Client(verify=trust)
    ) as client:
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0)
    assert reply.choices[0].text
    with pytest.raises(urllib.error.URLError):  # plaintext to the TLS port, or an untrusted CA
        urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=10)


# --- failures past the core: 503 and 500, never a traceback, also mid-stream -------------------------


class FailingLoop:
    """A round loop stand-in that yields ``before`` chunks, then raises ``error``."""

    def __init__(self, error: Exception, before: int = 0) -> None:
        self.error, self.before = error, before

    async def generate(self, request, remaining_s):
        for _ in range(self.before):
            yield Chunk("s", "w1 ", [3])
        raise self.error


class ScriptedLoop:
    """A round loop stand-in that writes ``text`` in chunks of ``size`` characters, one token each,
    as speculative rounds commit varying runs of tokens."""

    def __init__(self, text: str, size: int) -> None:
        self.pieces = [text[i : i + size] for i in range(0, len(text), size)]

    async def generate(self, request, remaining_s):
        for i, piece in enumerate(self.pieces[:-1]):
            yield Chunk("s", piece, [i])
        stats = Stats(prompt_tokens=3, generated_tokens=len(self.pieces), rounds=1)
        yield Chunk("s", self.pieces[-1], [len(self.pieces) - 1], "stop", stats)


class Facts:
    name, max_context, vocab_size = "tiny", 64, 32


@pytest.mark.parametrize(
    "error, status",
    [
        (BackendUnavailable("target", "127.0.0.1:1", "connection refused"), 503),
        (RuntimeError("a bug"), 500),
    ],
)
def test_core_failures_map_to_statuses_and_streams_end_with_an_error_event(error, status):
    async def run():
        results = []
        for before in (0, 2):
            api = OpenAiApi(FailingLoop(error, before), Facts(), Admission(AdmissionLimits()), trace.NoOpTracer())
            async with TestClient(TestServer(api.app(1 << 20))) as client:
                reply = await client.post("/v1/completions", json={"model": "tiny", "prompt": "w1", "stream": True})
                results.append((reply.status, await reply.text()))
        return results

    (first_status, first_body), (stream_status, stream_body) = asyncio.run(run())
    assert first_status == status and "Traceback" not in first_body
    assert json.loads(first_body)["error"]["type"] == "server_error"
    events = sse_events(stream_body.encode())
    assert stream_status == 200 and events[-1] == "[DONE]" and "error" in events[-2]
    assert "Traceback" not in stream_body and "a bug" not in first_body


def test_stats_shapes():
    from coordinator.openai_schema import speculation, total, usage

    stats = Stats(
        prompt_tokens=5, generated_tokens=7, rounds=3, drafted_tokens=6, accepted_tokens=3, committed_in_rounds=7
    )
    assert usage(stats) == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    assert speculation(stats) == {
        "acceptance_rate": 0.5,
        "mean_accepted_length": 7 / 3,
        "drafted_tokens": 6,
        "accepted_tokens": 3,
        "rounds": 3,
    }
    # Two prompts, two choices each: each prompt counted once, everything generated summed.
    other = Stats(prompt_tokens=4, generated_tokens=2, rounds=1, drafted_tokens=2, committed_in_rounds=2)
    both = total([stats, stats, other, other], n=2)
    assert usage(both) == {"prompt_tokens": 9, "completion_tokens": 18, "total_tokens": 27}
    assert speculation(both)["acceptance_rate"] == 6 / 16 and speculation(both)["rounds"] == 8


# --- the real default model ---------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_chat_equals_grpc_sdk_and_target_only(default_model, redis_url):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    new_tokens = 20
    torch.set_num_threads(2)
    try:
        ids = render_chat(default_model.tokenizer, messages)
        expected = default_model.tokenizer.decode(greedy_ids(default_model, ids, new_tokens), skip_special_tokens=True)
    finally:
        torch.set_num_threads(1)
    # "default" names the embedded model, so the coordinator loads its tokenizer from the same cache.
    s = InProcessStack(
        TargetEngine(default_model, 8), NgramDrafter(default_model.facts("ngram"), 8, 3, 1), Path("default"), redis_url
    )
    port = free_port()
    s.start(default_k=4, http_port=port)
    try:
        with Client(s.address, timeout=120) as grpc_client:
            grpc_text = grpc_client.complete(messages, max_new_tokens=new_tokens).text
        with openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120
        ) as client:
            name = client.models.list().data[0].id
            reply = client.chat.completions.create(model=name, messages=messages, max_tokens=new_tokens, temperature=0)
            stream = client.chat.completions.create(
                model=name, messages=messages, max_tokens=new_tokens, temperature=0, stream=True
            )
            streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        s.close()
    assert name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert reply.choices[0].message.content == streamed == grpc_text == expected
    assert reply.model_extra["specdec"]["drafted_tokens"] > 0


# --- the benchmark's HTTP mode ------------------------------------------------------------------------


def test_bench_http_mode_matches_the_grpc_mode(narrow, tiny_target, tokenizer):
    from bench.single import BenchPrompt, http_runner, run_interleaved, specdec_runner, summarize

    prompts = [BenchPrompt("text", PROMPT), BenchPrompt("chat", CHAT)]
    with Client(narrow.grpc, timeout=60) as grpc_client:
        results = run_interleaved(
            {
                "specdec": specdec_runner("specdec", grpc_client, 12, 0.0, None),
                "specdec-http": http_runner(narrow.url.removeprefix("http://"), 12, 0.0),
            },
            prompts,
            progress=False,
        )
    assert results["specdec-http"].outputs == results["specdec"].outputs
    assert results["specdec"].outputs["chat"] == greedy_ids(tiny_target, render_chat(tokenizer, CHAT), 12)
    report = summarize(results, greedy=False)
    assert isinstance(report["specdec-http"]["overhead_ms_per_token_vs_specdec"], float)


def test_logprobs_are_the_targets_in_openai_shapes(sync_client, model, tokenizer):
    # Chat: logprobs.content, one item per generated token (named by its text alone), the top
    # alternative the greedy token; a stream carries the same items.
    ids = {"return_token_ids": True}
    chat = sync_client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, extra_body=ids
    )
    content, token_ids = chat.choices[0].logprobs.content, chat.choices[0].model_extra["token_ids"]
    assert [item.token for item in content] == [tokenizer.decode([t]) for t in token_ids]
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].token == item.token
        assert item.logprob == item.top_logprobs[0].logprob <= 0 and bytes(item.bytes).decode() == item.token
    streamed = sync_client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, stream=True
    )
    pieces = [i for c in streamed if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert [(i.token, i.logprob) for i in pieces] == [(i.token, i.logprob) for i in content]
    # Completions: OpenAI's legacy parallel lists.
    done = sync_client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, extra_body=ids
    )
    lp, token_ids = done.choices[0].logprobs, done.choices[0].model_extra["token_ids"]
    assert lp.tokens == [tokenizer.decode([t]) for t in token_ids] and len(lp.token_logprobs) == len(lp.tokens)
    assert all(max(top, key=top.get) == token and len(top) == 3 for top, token in zip(lp.top_logprobs, lp.tokens))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    plain = sync_client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
