"""Completions' ``echo`` and prompt logprobs: the prompt leads each choice's text and logprobs, its
tokens scored by the target's own prefill pass (the first has none), ``max_tokens: 0`` scores a text,
and the figures do not depend on speculation.

Unit tests of the engine's scored prefill and of the response assembly need no network; the rest run
a served stack of tiny models (real gRPC, real redis-server) through raw HTTP and the ``openai`` client.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import torch
from harness import InProcessStack
from test_openai_api import Served, http, sse_events

from coordinator.openai_schema import Answer, ApiError, Echo, Shaper, parse_request
from coordinator.turns import Stats
from draft_service.engine import ModelDrafter
from specdec.models import load_model
from specdec.sampling import Sampling, TokenLogprob
from specdec.stack import free_port
from specdec.vocab import load_tokenizer
from target_service import engine as engine_module
from target_service.engine import TargetEngine, VerifyCall
from target_service.inprocess import InProcessTarget

IDS = [3, 7, 7, 8, 9, 12, 4]
PROMPT = "w11 w12 w13 w11 w12 w9"
TOP = 5
NEW = 8


def log_softmax_reference(loaded, ids: list[int]) -> torch.Tensor:
    """``[n - 1, V]``: a plain transformers forward over ``ids``, log-softmaxed, row i scoring token i + 1."""
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1)


# --- the engine: a scored prefill ----------------------------------------------------------------


@pytest.fixture(scope="module")
def packed(tiny_dir):
    """The tiny target on the row-invariant kernels the served one runs here (``pack``)."""
    return load_model(str(tiny_dir / "target"), tiny_dir, pack=True)


def _rounds(engine: TargetEngine, cache_id: str, committed: int, n: int) -> tuple[list[int], list[TokenLogprob]]:
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    while len(tokens) < n:
        call = VerifyCall(cache_id, committed, [], [], [], Sampling(), 0, top_logprobs=TOP)
        outcome = engine.verify_batch([call])[0]
        assert not isinstance(outcome, Exception), outcome
        tokens, logprobs, committed = tokens + outcome.tokens, logprobs + (outcome.logprobs or []), outcome.committed
    return tokens, logprobs


def test_scored_prefill_equals_a_plain_forward_and_leaves_the_cache_as_prefill(packed, tiny_target, monkeypatch):
    engine = TargetEngine(packed, 8)
    monkeypatch.setattr(engine_module, "PROMPT_LOGPROB_ROWS", 4)  # blocks of the LM head meet mid-prompt
    cache_id, committed, hidden, scored = engine.prefill_scored(IDS, TOP)
    assert committed == len(IDS) and hidden is None
    assert [e.token for e in scored] == IDS[1:]
    want = log_softmax_reference(tiny_target, IDS)
    got = torch.tensor([e.logprob for e in scored])
    torch.testing.assert_close(got, want.gather(-1, torch.tensor(IDS[1:])[:, None])[:, 0], atol=1e-4, rtol=0)
    for entry, row in zip(scored, want):
        assert len(entry.top) == TOP and [t for t, _ in entry.top] == row.topk(TOP).indices.tolist()
    # The session goes on exactly as after a plain prefill: same tokens, same bits.
    after_scored = _rounds(engine, cache_id, committed, NEW)
    plain_id, plain_committed, _ = engine.prefill(IDS)
    assert _rounds(engine, plain_id, plain_committed, NEW) == after_scored
    # A one-token prompt has nothing to score; hidden rows still come when asked.
    _, _, rows, none = engine.prefill_scored(IDS[:1], 0, with_hidden=True)
    assert none == [] and rows is not None and len(rows.rows) == 0
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.prefill_scored(IDS, 21)


def test_an_in_process_target_scores_a_prompt_as_its_engine_does(packed):
    engine = TargetEngine(packed, 8)
    ref, hidden, scored = asyncio.run(InProcessTarget(engine).prefill_scored(IDS, None, TOP, False))
    assert ref.committed == len(IDS) and hidden is None and ref.cache_id in engine.caches.ids()
    assert scored == engine.prefill_scored(IDS, TOP)[3]


# --- the response assembly --------------------------------------------------------------------------


def _parse(body: dict, chat: bool = False):
    return parse_request({"model": "m", **body}, chat, ("m",), 256, 32)


def test_echo_and_max_tokens_zero_are_parsed_as_asked():
    api = _parse({"prompt": "w3 w4", "echo": True, "logprobs": 2, "max_tokens": 0})
    assert api.echo and api.choices[0].max_new_tokens == 0 and api.choices[0].prompt_logprobs == 2
    assert _parse({"prompt": "w3", "echo": True}).choices[0].prompt_logprobs is None  # no logprobs, no scoring
    assert not _parse({"prompt": "w3", "echo": False}).echo
    for body, chat, param in (
        ({"prompt": "w3", "max_tokens": 0}, False, "max_tokens"),
        ({"prompt": "w3", "echo": True, "max_tokens": -1}, False, "max_tokens"),
        ({"prompt": "w3", "echo": 1}, False, "echo"),
        ({"messages": [{"role": "user", "content": "w3"}], "echo": True}, True, "echo"),
    ):
        with pytest.raises(ApiError) as caught:
            _parse(body, chat)
        assert caught.value.param == param and caught.value.status == 400


def test_an_echoed_answer_leads_text_and_logprobs_with_the_prompt():
    api = _parse({"prompt": "w3 w4 w5", "echo": True, "logprobs": 1})
    shaper = Shaper(api, lambda t: f"w{t}")
    prompt = [TokenLogprob(4, -0.5, ((4, -0.5),)), TokenLogprob(5, -2.0, ((9, -0.25),))]
    output = [TokenLogprob(6, -0.1, ((6, -0.1),))]
    echo = Echo("w3 w4 w5", (3, 4, 5), prompt)
    body = shaper.response([Answer(" w6", [6], "length", Stats(prompt_tokens=3, generated_tokens=1), output, (), echo)])
    choice = body["choices"][0]
    assert choice["text"] == "w3 w4 w5 w6"
    assert choice["logprobs"] == {
        "tokens": ["w3", "w4", "w5", "w6"],
        "token_logprobs": [None, -0.5, -2.0, -0.1],
        "top_logprobs": [None, {"w4": -0.5}, {"w9": -0.25}, {"w6": -0.1}],
        "text_offset": [0, 2, 4, 6],
    }
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    # A stream's first chunk: the prompt and its logprobs alone.
    first = shaper.echo_chunk(0, echo)["choices"][0]
    assert first["text"] == "w3 w4 w5" and first["finish_reason"] is None
    assert first["logprobs"]["token_logprobs"] == [None, -0.5, -2.0]
    # Echo without logprobs: the text alone.
    plain = Shaper(_parse({"prompt": "w3", "echo": True}))
    assert plain.echo_chunk(0, Echo("w3"))["choices"][0] == {
        "index": 0,
        "text": "w3",
        "logprobs": None,
        "finish_reason": None,
    }


# --- a served stack -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(packed, tiny_dir, redis_url):
    """The packed tiny target, drafted for by a second copy of itself (every draft token accepted),
    behind two coordinators: one speculating (k = 3) and one target-only."""
    draft = ModelDrafter(load_model(str(tiny_dir / "target"), tiny_dir, pack=True), 16, 16)
    s = InProcessStack(TargetEngine(packed, 32), draft, tiny_dir / "target", redis_url)
    s.target_address = s.add_target(s.target_engine)
    s.draft_address = s.add_draft(s.draft_engine)
    yield s
    s.close()


@pytest.fixture(scope="module")
def speculating(stack) -> Served:
    return Served(stack, free_port(), default_k=3)


@pytest.fixture(scope="module")
def target_only(stack) -> Served:
    return Served(stack, free_port(), default_k=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return load_tokenizer(tiny_dir / "target")


def _complete(served: Served, **body) -> dict:
    status, payload, _ = http(served, "POST", "/v1/completions", {"temperature": 0, **body}, key=None)
    assert status == 200, payload
    return json.loads(payload)


def test_echo_prepends_the_prompt_to_the_completion(speculating):
    plain = _complete(speculating, prompt=PROMPT, max_tokens=NEW)["choices"][0]
    echoed = _complete(speculating, prompt=PROMPT, max_tokens=NEW, echo=True)["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"] and echoed["logprobs"] is None
    # A token-id prompt is echoed decoded.
    by_ids = _complete(speculating, prompt=IDS, max_tokens=2, echo=True)["choices"][0]
    assert by_ids["text"].startswith(" ".join(f"w{i - 2}" for i in IDS))


def test_echoed_logprobs_are_the_targets_and_do_not_depend_on_speculation(
    speculating, target_only, tiny_target, tokenizer
):
    body = dict(prompt=PROMPT, max_tokens=NEW, echo=True, logprobs=TOP, return_token_ids=True)
    spec = _complete(speculating, **body)
    alone = _complete(target_only, **body)
    assert spec["specdec"]["accepted_tokens"] > 0 and alone["specdec"]["drafted_tokens"] == 0
    assert spec["choices"][0]["logprobs"] == alone["choices"][0]["logprobs"]  # bit for bit
    lp = spec["choices"][0]["logprobs"]
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    output = spec["choices"][0]["token_ids"]
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids + output]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = log_softmax_reference(tiny_target, ids + output)
    expected = want.gather(-1, torch.tensor(ids[1:] + output)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), expected, atol=1e-4, rtol=0)
    for top, row in zip(lp["top_logprobs"][1:], want):
        assert len(top) == TOP and set(top) == {tokenizer.decode([t]) for t in row.topk(TOP).indices.tolist()}
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    # The output and its logprobs are those of the request without echo.
    plain = _complete(speculating, prompt=PROMPT, max_tokens=NEW, logprobs=TOP, return_token_ids=True)
    assert plain["choices"][0]["token_ids"] == output
    assert plain["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][len(ids) :]


def test_max_tokens_zero_with_echo_scores_the_prompt(speculating, tiny_target, tokenizer):
    scored = _complete(speculating, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice, ids = scored["choices"][0], tokenizer.encode(PROMPT, add_special_tokens=False)
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert scored["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    want = log_softmax_reference(tiny_target, ids).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert choice["logprobs"]["token_logprobs"][0] is None and len(choice["logprobs"]["tokens"]) == len(ids)
    torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"][1:]), want, atol=1e-4, rtol=0)
    assert _complete(speculating, prompt=PROMPT, max_tokens=0, echo=True)["choices"][0]["text"] == PROMPT
    status, payload, _ = http(speculating, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, key=None)
    assert status == 400 and json.loads(payload)["error"]["param"] == "max_tokens"


def test_a_stream_with_echo_opens_with_the_prompt(speculating):
    body = dict(prompt=PROMPT, max_tokens=NEW, echo=True, logprobs=2)
    whole = _complete(speculating, **body)["choices"][0]
    status, payload, _ = http(
        speculating, "POST", "/v1/completions", {"temperature": 0, "stream": True, **body}, key=None
    )
    assert status == 200
    chunks = [e["choices"][0] for e in sse_events(payload) if e != "[DONE]"]
    assert chunks[0]["text"] == PROMPT and chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == whole["text"]
    streamed = [lp for c in chunks if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]
    # Without logprobs the first chunk carries the prompt's text alone.
    status, payload, _ = http(
        speculating,
        "POST",
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 0, "echo": True, "stream": True},
        key=None,
    )
    events = [e for e in sse_events(payload) if e != "[DONE]"]
    assert status == 200 and events[0]["choices"][0]["text"] == PROMPT
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, "length"]


def test_the_openai_client_scores_a_text(speculating, tokenizer):
    model = json.loads(http(speculating, "GET", "/v1/models", key=None)[1])["data"][0]["id"]
    with openai.OpenAI(base_url=speculating.url + "/v1", api_key="none", max_retries=0, timeout=60) as client:
        reply = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=5, max_tokens=0)
    choice = reply.choices[0]
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert choice.text == PROMPT and choice.logprobs is not None
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    assert choice.logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    assert choice.logprobs.top_logprobs[0] is None and all(len(t) == 5 for t in choice.logprobs.top_logprobs[1:])
