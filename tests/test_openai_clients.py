"""Real OpenAI client libraries against a served stack: the official ``openai`` package, LangChain's
``ChatOpenAI`` and litellm, each as an application would call it (issue 41's "Must show", the parts
without tools, structured output or logprobs).

Each answer must be the stack's own: equal to target-only greedy decoding, or, for seeded sampling,
to the same seeds sent one at a time. The stack and its fixtures are tests/test_openai_api.py's.
No test may reach past the loopback interface: litellm would fetch its model cost map from the
internet unless told not to, so the ``offline`` fixture both tells it and refuses any other address.
"""

from __future__ import annotations

import ipaddress
import socket

import openai
import pytest
from langchain_openai import ChatOpenAI
from test_openai_api import (  # noqa: F401 - fixtures, shared with the API's own tests
    CHAT,
    KEY,
    NEW_TOKENS,
    PROMPT,
    chat_tokenizer_dir,
    model,
    reference_text,
    served,
    stack,
    sync_client,
    tokenizer,
)

# Chat prompts for LangChain's batch: the tiny vocabulary's words.
OTHER_CHAT = [{"role": "user", "content": "w4 w5 w6 w4 w5"}]


@pytest.fixture
def offline(monkeypatch):
    """Refuses every connection but loopback (and unix sockets), and keeps litellm from fetching its
    model cost map, which it does at import unless ``LITELLM_LOCAL_MODEL_COST_MAP`` is set."""
    connect = socket.socket.connect

    def loopback_only(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not ipaddress.ip_address(address[0]).is_loopback:
            raise OSError(f"test tried to reach {address[0]}: only loopback is allowed")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    monkeypatch.setenv("LITELLM_TELEMETRY", "False")


def test_litellm_maps_a_context_overflow_to_its_context_window_error(offline, served, model):  # noqa: F811
    import litellm  # here, after ``offline``: it reads its environment when imported

    limit = served.round_loop._facts.max_context
    common = dict(model=f"openai/{model}", api_base=served.url + "/v1", api_key=KEY, num_retries=0, max_tokens=4)
    reply = litellm.completion(messages=CHAT, temperature=0, **common)
    assert reply.choices[0].message.content  # litellm speaks to the stack at all
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(messages=[{"role": "user", "content": "w1 " * limit}], **common)


def test_openai_n3_seeded_repeats_and_equals_its_seeds_alone(sync_client, model):  # noqa: F811
    """Choice i of ``n=3, seed=5`` samples as ``seed=5 + i`` alone; two calls answer the same."""
    base = dict(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=1.0, top_p=0.95)
    twice = [[c.text for c in sync_client.completions.create(**base, n=3, seed=5).choices] for _ in range(2)]
    alone = [sync_client.completions.create(**base, seed=5 + i).choices[0].text for i in range(3)]
    assert twice[0] == twice[1] == alone
    assert len(set(alone)) > 1
    streamed = ["", "", ""]
    for chunk in sync_client.completions.create(**base, n=3, seed=5, stream=True):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == alone


def test_openai_list_and_token_id_prompts(sync_client, model, tiny_target, tokenizer):  # noqa: F811
    second = "w4 w5 w6 w4"
    expected = [reference_text(tiny_target, tokenizer, p) for p in (PROMPT, second)]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in (PROMPT, second)]
    base = dict(model=model, max_tokens=NEW_TOKENS, temperature=0)
    for prompt in ([PROMPT, second], ids):
        reply = sync_client.completions.create(prompt=prompt, **base)
        assert [(c.index, c.text) for c in reply.choices] == [(0, expected[0]), (1, expected[1])]
        assert reply.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert sync_client.completions.create(prompt=ids[0], **base).choices[0].text == expected[0]
    with pytest.raises(openai.BadRequestError) as raised:
        sync_client.completions.create(prompt=[ids[0][:2] + [10**6]], **base)
    assert raised.value.param == "prompt"


def test_langchain_invoke_and_batch(offline, served, model, tiny_target, tokenizer):  # noqa: F811
    chat = ChatOpenAI(
        model=model, base_url=served.url + "/v1", api_key=KEY, temperature=0, max_tokens=NEW_TOKENS, max_retries=0
    )
    as_tuples = [[(m["role"], m["content"]) for m in conversation] for conversation in (CHAT, OTHER_CHAT)]
    expected = [reference_text(tiny_target, tokenizer, conversation) for conversation in (CHAT, OTHER_CHAT)]
    answer = chat.invoke(as_tuples[0])
    assert answer.content == expected[0]
    assert answer.usage_metadata["output_tokens"] > 0
    assert [m.content for m in chat.batch(as_tuples)] == expected
