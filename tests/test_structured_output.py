"""Structured output served exactly: speculation under a grammar writes what the constrained target
alone writes.

Tiny models over a vocabulary of single characters (so that every text the grammar forces has
tokens: ``specdec.grammar.compiler_for`` reads a word-level vocabulary's tokens as their strings)
run through a real stack: target and model draft services and a coordinator over gRPC. Greedy output
with speculation (chains and trees) must equal the same stack's target-only output (k = 0), token
for token, and be a document the schema accepts. The default model does the same, marked slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from harness import InProcessStack
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from tiny import make_model

from draft_service.engine import ModelDrafter, NgramDrafter
from specdec import Client
from specdec.client import InvalidArgument
from specdec.models import load_model
from specdec.stack import free_port
from target_service.engine import TargetEngine

# 28 single characters: enough for the schema's keys, digits, booleans and JSON's punctuation.
CHARS = ["{", "}", '"', ":", ",", " ", *"0123456789", *"abceflmnrstu"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "bar": {"type": "integer", "minimum": 0, "maximum": 99},
        "set": {"type": "boolean"},
    },
    "required": ["name", "bar", "set"],
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
PROMPTS = ["a b c", "1 2 3 4", "{ n a m e", "s e t : f"]


@pytest.fixture(scope="module")
def char_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("chars")
    target = load_model(str(make_model(root / "target", seed=3, words=CHARS)), root)
    draft = load_model(str(make_model(root / "draft", seed=4, layers=1, words=CHARS)), root)
    return root, target, draft


@pytest.fixture(scope="module")
def stack(char_models, redis_url):
    root, target, draft = char_models
    s = InProcessStack(TargetEngine(target, 16), ModelDrafter(draft, 16, 0), root / "target", redis_url)
    s.http_port = free_port()
    s.start(default_k=4, http_port=s.http_port)
    yield s
    s.close()


def _document(tokenizer, ids: list[int], eos: int) -> dict:
    """The JSON document the output's tokens spell (each token's string is its text here)."""
    ids = ids[: ids.index(eos)] if eos in ids else ids
    return json.loads("".join(tokenizer.convert_ids_to_tokens(ids)))


@pytest.mark.parametrize("tree_nodes", [0, 8], ids=["chain", "tree"])
def test_constrained_greedy_speculation_equals_constrained_target_only(stack, char_models, tree_nodes):
    _, target, _ = char_models
    eos = target.eos_token_ids[0]
    accepted = 0
    with Client(stack.address, timeout=120) as client:
        for prompt in PROMPTS:
            options = {"max_new_tokens": 60, "response_format": JSON_SCHEMA}
            alone = client.complete(prompt, k=0, **options)
            spec = client.complete(prompt, k=4, tree_nodes=tree_nodes, **options)
            assert spec.token_ids == alone.token_ids, prompt
            accepted += spec.stats.accepted_tokens
            assert spec.finish_reason == "stop", spec.token_ids
            jsonschema.validate(_document(target.tokenizer, spec.token_ids, eos), SCHEMA)
            free = client.complete(prompt, k=0, max_new_tokens=40)
            assert free.token_ids != alone.token_ids  # the grammar changed the output
    assert accepted > 0  # the draft's masked proposals were accepted, not just the target's own tokens


def test_adaptive_rounds_propose_the_grammars_forced_runs_and_stay_exact(stack, char_models, redis_url):
    """With k chosen per round, the runs the grammar forces (the schema's keys and punctuation) are
    proposed by the coordinator alone and pass whole, and the output is still the constrained
    target-only one."""
    root, target, draft = char_models
    adaptive = InProcessStack(TargetEngine(target, 16), ModelDrafter(draft, 16, 0), root / "target", redis_url)
    adaptive.start()
    try:
        with Client(stack.address, timeout=120) as fixed, Client(adaptive.address, timeout=120) as chosen:
            for prompt in PROMPTS:
                options = {"max_new_tokens": 60, "response_format": JSON_SCHEMA}
                assert chosen.complete(prompt, **options).token_ids == fixed.complete(prompt, k=0, **options).token_ids
        rounds = [s.attributes for s in adaptive.exporter.get_finished_spans() if s.name == "specdec.round"]
    finally:
        adaptive.close()
    forced = [a for a in rounds if a.get("specdec.forced")]
    assert len(forced) >= len(PROMPTS)  # at least the opening '{"name": "' of every answer
    assert all(a["specdec.accepted"] == a["specdec.k"] > 0 and not a["specdec.looked_up"] for a in forced)


def test_cli_generate_takes_a_response_format_and_lists_logprobs(stack, char_models, tmp_path, capsys):
    """``specdec generate --response-format @FILE --top-logprobs N`` prints the constrained answer (the
    SDK's, token for token), then one logprob line per generated token; a bad format is a usage error."""
    from specdec.cli import main

    _, target, _ = char_models
    (tmp_path / "format.json").write_text(json.dumps(JSON_SCHEMA))
    argv = ["generate", "--address", stack.address, "--raw", "a b c", "--max-new-tokens", "60", "--k", "4"]
    main([*argv, "--response-format", f"@{tmp_path / 'format.json'}", "--top-logprobs", "2"])
    out = capsys.readouterr().out
    with Client(stack.address, timeout=120) as client:
        sdk = client.complete("a b c", max_new_tokens=60, k=4, response_format=JSON_SCHEMA, top_logprobs=2)
    assert out.startswith(sdk.text) and sdk.text.startswith("{")
    listed = out.split("likeliest alternatives):\n", 1)[1].strip().splitlines()
    assert [int(line.split()[0]) for line in listed] == sdk.token_ids
    assert all(line.count(":") == 2 for line in listed)  # two alternatives, id:logprob each
    with pytest.raises(SystemExit):
        main([*argv, "--response-format", "[1, 2]"])
    assert "give a JSON object" in capsys.readouterr().err


def test_a_regex_extension_and_json_object(stack, char_models):
    _, target, _ = char_models
    tokenizer = target.tokenizer
    with Client(stack.address, timeout=120) as client:
        out = client.complete("a b", max_new_tokens=12, response_format={"type": "regex", "regex": "(ab|ba)+c"})
        text = "".join(tokenizer.convert_ids_to_tokens([t for t in out.token_ids if t != target.eos_token_ids[0]]))
        assert out.finish_reason == "stop" or len(out.token_ids) == 12
        import re

        assert re.fullmatch("(ab|ba)+c", text) if out.finish_reason == "stop" else re.match("(ab|ba)+", text)
        obj = client.complete("a", max_new_tokens=30, k=4, response_format={"type": "json_object"})
        alone = client.complete("a", max_new_tokens=30, k=0, response_format={"type": "json_object"})
        assert obj.token_ids == alone.token_ids
        assert "".join(tokenizer.convert_ids_to_tokens(obj.token_ids)).startswith("{")


def test_a_schema_the_engine_cannot_enforce_is_refused_by_keyword(stack):
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}}
    with Client(stack.address, timeout=60) as client:
        with pytest.raises(InvalidArgument, match="response_format: .*uniqueItems"):
            client.complete("a", max_new_tokens=4, response_format=bad)
        with pytest.raises(InvalidArgument, match="response_format"):
            client.complete("a", max_new_tokens=4, response_format={"type": "yaml"})


def test_the_openai_api_refuses_what_it_cannot_enforce_with_a_400_naming_response_format(stack):
    bad = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "array", "uniqueItems": True}}}
    with openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="none", max_retries=0) as client:
        name = client.models.list().data[0].id
        # Completions take it too (not in the openai package's signature: an extra body field).
        ok = client.completions.create(
            model=name, prompt="a b", max_tokens=60, temperature=0, extra_body={"response_format": JSON_SCHEMA}
        )
        assert ok.choices[0].finish_reason == "stop"
        for fmt, says in [(bad, "uniqueItems"), ({"type": "json_schema"}, "json_schema.schema")]:
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "a"}], max_tokens=4, response_format=fmt
                )
            assert refused.value.status_code == 400
            assert refused.value.body["param"] == "response_format"
            assert says in refused.value.body["message"]


@pytest.mark.slow
def test_default_model_constrained_greedy_equals_constrained_target_only(default_model, redis_url):
    """The real default model under a small JSON schema: speculation (prompt lookup) writes exactly
    what the constrained target alone writes, and the text validates."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
        "required": ["city", "population"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Give the largest city of France and its population as JSON."}]
    s = InProcessStack(
        TargetEngine(default_model, 8), NgramDrafter(default_model.facts("ngram"), 8, 3, 1), Path("default"), redis_url
    )
    port = free_port()
    s.start(default_k=4, http_port=port)
    try:
        with Client(s.address, timeout=600) as client:
            alone = client.complete(messages, max_new_tokens=40, k=0, response_format=fmt)
            spec = client.complete(messages, max_new_tokens=40, k=4, response_format=fmt)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600) as api:
            name = api.models.list().data[0].id
            reply = api.chat.completions.create(
                model=name, messages=messages, max_tokens=40, temperature=0, response_format=fmt
            )
        # LangChain's with_structured_output sends a Pydantic model's schema the same way.
        chat = ChatOpenAI(
            model=name, base_url=f"http://127.0.0.1:{port}/v1", api_key="none", temperature=0, max_tokens=40
        )
        parsed = chat.with_structured_output(City, method="json_schema", strict=True).invoke(
            [(m["role"], m["content"]) for m in messages]
        )
    finally:
        s.close()
    assert spec.token_ids == alone.token_ids
    assert spec.finish_reason == "stop"
    jsonschema.validate(json.loads(spec.text), schema)
    # The OpenAI API: the same document, which validates against the schema.
    assert reply.choices[0].message.content == spec.text
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    assert isinstance(parsed, City) and parsed == City.model_validate_json(spec.text)


class City(BaseModel):
    """The schema above as a Pydantic model, as LangChain users write it."""

    city: str = Field(max_length=20)
    population: int
