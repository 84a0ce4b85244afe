"""The grammar core (``specdec.grammar``): masks are sound, exact under rollback and fork, and give
what a verify pass needs for chains and trees; unsupported schemas are refused by name."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from conftest import CACHE_DIR

from specdec.grammar import GrammarCompiler, GrammarMatcher, ResponseFormat, close_objects, parse_response_format
from specdec.vocab import load_tokenizer, resolve_model_path

# A tiny byte vocabulary: single characters plus a few merged tokens, so one text has several
# tokenizations, as with a real BPE. Id 0 ends a document; ids past the list are padding rows.
TOKENS = [b"<eos>", b"{", b"}", b'"', b"a", b"b", b":", b" ", b",", b"1", b"2", b'{"', b'":', b"12", b"true", b"false"]
TOKENS += [b"t", b"r", b"u", b"e", b"f", b"l", b"s", b", "]
EOS = 0
PADDING = 5
TINY_SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 12]}, "b": {"type": "boolean"}}, "required": ["a"]}


def tiny_valid_documents() -> set[bytes]:
    """Every document TINY_SCHEMA (closed) accepts in the fixed layout, in either key order."""
    docs = set()
    for a, b in itertools.product([1, 12], [None, True, False]):
        pairs = [("a", a)] + ([("b", b)] if b is not None else [])
        for order in itertools.permutations(pairs):
            docs.add(json.dumps(dict(order)).encode())
    return docs


@pytest.fixture(scope="module")
def tiny() -> GrammarCompiler:
    return GrammarCompiler.from_token_bytes(TOKENS, [EOS], vocab_size=len(TOKENS) + PADDING)


@pytest.fixture(scope="module")
def smol_tokenizer():
    return load_tokenizer(resolve_model_path("default", CACHE_DIR))


@pytest.fixture(scope="module")
def smol(smol_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(smol_tokenizer)


NESTED = {
    "type": "object",
    "properties": {
        "status": {"enum": ["pending", "shipped"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                "required": ["sku", "qty"],
            },
        },
        "note": {"type": ["string", "null"]},
    },
    "required": ["status", "items", "note"],
}
NESTED_DOC = json.dumps(
    {"status": "shipped", "items": [{"sku": "KB-01", "qty": 2}, {"sku": "MS-77", "qty": 10}], "note": None}
)


def json_schema(schema: dict, strict: bool = True) -> ResponseFormat:
    return parse_response_format(
        {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": strict}}
    )


def walk(matcher: GrammarMatcher, ids: list[int]) -> list[np.ndarray]:
    """Advances through ``ids`` one at a time, returning the mask before each and after the last."""
    masks = [matcher.allowed()]
    for token in ids:
        matcher.advance(token)
        masks.append(matcher.allowed())
    return masks


def test_every_allowed_token_keeps_a_valid_prefix_and_eos_only_when_complete(tiny):
    """Brute force over every path the masks allow: sound, end only when whole, padding never."""
    valid = tiny_valid_documents()
    prefixes = {doc[:i] for doc in valid for i in range(len(doc) + 1)}
    reached: set[bytes] = set()
    paths = 0

    def explore(matcher: GrammarMatcher, text: bytes) -> None:
        nonlocal paths
        mask = matcher.allowed()
        assert mask.shape == (len(TOKENS) + PADDING,)
        assert not mask[len(TOKENS) :].any(), "a padding id was allowed"
        assert mask[EOS] == (text in valid), text
        if text in valid:
            reached.add(text)
            # A closed object can take nothing more: the end token is all that is left.
            assert np.flatnonzero(mask).tolist() == [EOS]
            matcher.advance(EOS)
            assert not matcher.allowed().any() and matcher.ended
            paths += 1
            return
        assert mask.any(), f"dead end after {text!r}"
        for token in np.flatnonzero(mask):
            piece = TOKENS[token]
            assert text + piece in prefixes, f"{piece!r} after {text!r} leaves every valid document"
            child = matcher.fork()
            child.advance(int(token))
            explore(child, text + piece)

    explore(tiny.matcher(json_schema(TINY_SCHEMA)), b"")
    assert reached <= valid
    # Every value combination is reachable (in the schema's key order, at least).
    assert {(json.loads(d)["a"], json.loads(d).get("b")) for d in reached} == set(
        itertools.product([1, 12], [None, True, False])
    )
    assert paths >= len(reached)


def test_strict_closes_objects_and_plain_schema_does_not(tiny):
    extra = b'{"a": 1, "c'
    open_schema = dict(TINY_SCHEMA, properties={**TINY_SCHEMA["properties"]})
    tokens = {t: i for i, t in enumerate(TOKENS)}
    assert close_objects(open_schema)["additionalProperties"] is False
    for strict, allows_extra in [(True, False), (False, True)]:
        compiler = GrammarCompiler.from_token_bytes(TOKENS + [b"c"], [EOS])
        matcher = compiler.matcher(json_schema(open_schema, strict=strict))
        ids = [tokens[b'{"'], tokens[b"a"], tokens[b'":'], tokens[b" "], tokens[b"1"], tokens[b", "], tokens[b'"']]
        matcher.advance_many(ids)
        assert matcher.is_allowed(len(TOKENS)) is allows_extra, (strict, extra)


def test_masks_along_equals_stepping_and_leaves_the_state(smol, smol_tokenizer):
    ids = smol_tokenizer.encode(NESTED_DOC, add_special_tokens=False)
    matcher = smol.matcher(json_schema(NESTED))
    matcher.advance_many(ids[:5])
    before = matcher.allowed()
    chain = ids[5:14]
    along = matcher.masks_along(chain)
    assert along.shape == (len(chain) + 1, len(smol_tokenizer))
    assert matcher.consumed == 5 and np.array_equal(matcher.allowed(), before)
    stepped = walk(matcher.fork(), chain)
    assert all(np.array_equal(a, s) for a, s in zip(along, stepped))


def test_forced_tokens_are_the_runs_the_mask_leaves_one_token_in(smol, smol_tokenizer):
    """``forced`` lists, without moving the state, exactly the next tokens whose mask allows one token,
    up to its limit: none where a value is open (several allowed), the whole run between values."""
    ids = smol_tokenizer.encode(NESTED_DOC, add_special_tokens=False)
    matcher = smol.matcher(json_schema(NESTED))
    stepped = walk(matcher.fork(), ids)
    alone = [int(np.flatnonzero(m)[0]) if m.sum() == 1 else None for m in stepped]
    for at in range(len(ids)):
        run = matcher.forced(64)
        assert matcher.consumed == at and np.array_equal(matcher.allowed(), stepped[at])
        expected = []
        for token in alone[at:]:
            if token is None:
                break
            expected.append(token)
        assert run == expected and matcher.forced(1) == run[:1]
        matcher.advance(ids[at])
    assert sum(token is not None for token in alone) >= 10  # keys and punctuation between the values
    assert smol.matcher(json_schema(NESTED)).forced(0) == []


def test_masks_along_stops_at_an_illegal_token(smol, smol_tokenizer):
    ids = smol_tokenizer.encode(NESTED_DOC, add_special_tokens=False)
    matcher = smol.matcher(json_schema(NESTED))
    illegal = int(np.flatnonzero(~matcher.fork().masks_along(ids[:3])[3])[0])
    along = matcher.masks_along(ids[:3] + [illegal] + ids[4:6])
    assert np.array_equal(along[:4], matcher.masks_along(ids[:3]))
    assert not along[4:].any()
    with pytest.raises(ValueError, match="not allowed"):
        matcher.advance(illegal)
    assert matcher.consumed == 0


def test_rollback_restores_the_exact_mask(smol, smol_tokenizer):
    ids = smol_tokenizer.encode(NESTED_DOC, add_special_tokens=False)
    matcher = smol.matcher(json_schema(NESTED))
    masks = walk(matcher, ids)
    assert matcher.is_complete() and np.flatnonzero(masks[-1]).tolist() == [smol_tokenizer.eos_token_id]
    matcher.advance(smol_tokenizer.eos_token_id)
    assert not matcher.allowed().any()
    # Over the end token, then k = 8 draft tokens, then back to the start.
    matcher.rollback(1)
    assert np.array_equal(matcher.allowed(), masks[-1]) and not matcher.ended
    matcher.rollback(8)
    assert np.array_equal(matcher.allowed(), masks[len(ids) - 8])
    matcher.advance_many(ids[len(ids) - 8 : len(ids) - 3])
    assert np.array_equal(matcher.allowed(), masks[len(ids) - 3])
    matcher.rollback(matcher.consumed)
    assert np.array_equal(matcher.allowed(), masks[0])
    with pytest.raises(ValueError, match="cannot roll back"):
        matcher.rollback(1)


def test_fork_is_independent(smol, smol_tokenizer):
    ids = smol_tokenizer.encode(NESTED_DOC, add_special_tokens=False)
    matcher = smol.matcher(json_schema(NESTED))
    matcher.advance_many(ids[:10])
    before = matcher.allowed()
    child = matcher.fork()
    child.advance_many(ids[10:20])
    assert np.array_equal(matcher.allowed(), before) and matcher.consumed == 10 and child.consumed == 20


def test_tree_masks_equal_each_paths_masks(smol, smol_tokenizer):
    ids = smol_tokenizer.encode(NESTED_DOC, add_special_tokens=False)
    # Start where the next two positions have choices (inside a string): room for siblings.
    choices = [int(m.sum()) for m in walk(smol.matcher(json_schema(NESTED)), ids)]
    start = next(i for i in range(len(ids)) if min(choices[i + 1 : i + 3]) > 1)
    matcher = smol.matcher(json_schema(NESTED))
    matcher.advance_many(ids[:start])
    rest = ids[start:]
    # A main chain, a legal sibling at depth 2 with a child, and an illegal node with a child.
    along = matcher.masks_along(rest[:4])
    sibling = int(next(t for t in np.flatnonzero(along[2]) if t != rest[2]))
    sibling_child = int(np.flatnonzero(matcher.masks_along([rest[0], rest[1], sibling])[3])[0])
    illegal = int(np.flatnonzero(~along[1])[0])
    tokens = [rest[0], rest[1], rest[2], rest[3], sibling, sibling_child, illegal, rest[1]]
    parents = [-1, 0, 1, 2, 1, 4, 0, 6]
    masks = matcher.masks_for_tree(tokens, parents)
    assert masks.shape == (len(tokens) + 1, len(smol_tokenizer))
    assert np.array_equal(masks[0], matcher.allowed())
    for node in range(len(tokens)):
        path, at = [], node
        while at >= 0:
            path.insert(0, tokens[at])
            at = parents[at]
        if node in (6, 7):  # the illegal node and the node under it
            assert not masks[node + 1].any()
        else:
            assert np.array_equal(masks[node + 1], matcher.masks_along(path)[-1]), node
    assert matcher.consumed == start
    with pytest.raises(ValueError, match="does not come before"):
        matcher.masks_for_tree([rest[0]], [0])


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
        ({"not": {"type": "string"}}, "not"),
        # A schema's own "x-guidance" must not switch on leniency, which would ignore the keyword.
        ({"type": "array", "contains": {"const": 1}, "x-guidance": {"lenient": True}}, "contains"),
        ({"type": "object", "properties": {"p": {"$ref": "#/$defs/missing"}}}, "missing"),
    ],
)
def test_unsupported_schema_features_are_refused_by_name(tiny, schema, named):
    with pytest.raises(ValueError, match=f"unsupported JSON schema.*{named}"):
        tiny.compile(json_schema(schema))


def test_bad_formats_are_refused_clearly(tiny):
    with pytest.raises(ValueError, match="(?s)unsupported regex.*unclosed group"):
        tiny.compile(ResponseFormat("regex", pattern="(ab"))
    with pytest.raises(ValueError, match="json_schema.schema must be a JSON object"):
        parse_response_format({"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(ValueError, match="strict must be a boolean"):
        parse_response_format({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}})
    with pytest.raises(ValueError, match="'grammar' is not one of"):
        parse_response_format({"type": "grammar"})
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        GrammarCompiler.from_token_bytes(TOKENS, [EOS], vocab_size=3)


def test_compiled_grammars_are_cached_by_format(tiny):
    fmt = json_schema(TINY_SCHEMA)
    copied = json.loads(json.dumps(TINY_SCHEMA))
    same = parse_response_format({"type": "json_schema", "json_schema": {"schema": copied}})
    same = ResponseFormat(same.kind, same.schema, strict=True)
    assert tiny.compile(fmt) is tiny.compile(same)
    assert tiny.compile(json_schema(TINY_SCHEMA, strict=False)) is not tiny.compile(fmt)


def test_regex_allows_the_end_while_more_may_follow(tiny):
    matcher = tiny.matcher(parse_response_format({"type": "regex", "regex": "1[12]+"}))
    assert not matcher.is_allowed(EOS)
    matcher.advance(TOKENS.index(b"12"))
    allowed = {TOKENS[t] for t in np.flatnonzero(matcher.allowed())}
    assert allowed == {b"<eos>", b"1", b"2", b"12"}


def test_json_object_takes_any_object_and_nothing_else(smol, smol_tokenizer):
    matcher = smol.matcher(parse_response_format({"type": "json_object"}))
    assert not matcher.is_allowed(smol_tokenizer.encode("[", add_special_tokens=False)[0])
    walk(matcher, smol_tokenizer.encode(NESTED_DOC, add_special_tokens=False))
    assert matcher.is_complete()
