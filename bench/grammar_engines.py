"""Which grammar engine structured output should use, measured (``python -m bench.grammar_engines``).

Three maintained engines compute "which tokens may come next" for a JSON schema or a regex: xgrammar,
llguidance and outlines-core. This script measures each on the default target's tokenizer
(SmolLM2-135M-Instruct, vocabulary 49152):

- **compile**: the time to turn each grammar (a flat object, a nested schema with arrays, enums and
  required fields, a tool-call schema with ``anyOf``, ``json_object``, a regex) into something a
  matcher runs, and the time of the first mask after it (llguidance builds lazily, so compile time
  alone would flatter it);
- **mask per token**: median and p99 of the time to fill a next-token bitmask at every position of a
  schema-valid document, walked token by token as the tokenizer splits it;
- **rollback and fork**: what speculative verification needs (advance through k draft tokens, roll
  back to the accepted prefix; explore a token tree's siblings from one state), checked to restore
  the exact mask, and timed;
- **coverage**: for each JSON-schema feature, a valid and an invalid instance: an engine *refuses*
  the schema, *enforces* it (valid accepted, invalid rejected), *ignores* it (both accepted) or is
  *wrong* (valid rejected).

The machine is shared and noisy, so the engines take turns (A B C, then C B A, ...) and the report
gives ratios to the fastest beside the raw figures. Every engine compiles on one thread: the services
share two cores. The engines need not be installed in the project; a scratch virtual environment
with them and this tree on its path is enough::

    python -m bench.grammar_engines --out reports/grammar-engines.json
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# The documents walked for mask timing, and the schemas they satisfy. Realistic sizes (40-150
# tokens) and shapes: what `with_structured_output` and tool calling send.
FLAT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "active"],
    "additionalProperties": False,
}
FLAT_DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "active": True}

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
            "required": ["name", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer"},
                    "price": {"type": "number"},
                    "tags": {"type": "array", "items": {"enum": ["fragile", "gift", "bulk"]}},
                },
                "required": ["sku", "quantity", "price", "tags"],
                "additionalProperties": False,
            },
        },
        "note": {"type": ["string", "null"]},
    },
    "required": ["order_id", "status", "customer", "items", "note"],
    "additionalProperties": False,
}
NESTED_DOC = {
    "order_id": "A-10293",
    "status": "shipped",
    "customer": {"name": "Grace Hopper", "vip": True},
    "items": [
        {"sku": "KB-01", "quantity": 2, "price": 49.5, "tags": ["fragile", "gift"]},
        {"sku": "MS-77", "quantity": 1, "price": 19.99, "tags": []},
        {"sku": "CB-3", "quantity": 10, "price": 2.25, "tags": ["bulk"]},
    ],
    "note": None,
}

TOOL_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["city", "unit"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "name": {"const": "search_web"},
                "arguments": {
                    "type": "object",
                    "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"}},
                    "required": ["query", "max_results"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
    ]
}
TOOL_DOC = {"name": "search_web", "arguments": {"query": "speculative decoding exactness proof", "max_results": 5}}

# An ISO date and a phone-like number: the regex extension's kind of grammar.
REGEX = r"\d{4}-\d{2}-\d{2} \+\d{1,3} \d{3} \d{4}"
REGEX_TEXT = "2024-06-01 +44 207 9460"

# (name, kind, grammar source, a document it accepts)
GRAMMARS: list[tuple[str, str, str, str]] = [
    ("flat", "json_schema", json.dumps(FLAT_SCHEMA), json.dumps(FLAT_DOC)),
    ("nested", "json_schema", json.dumps(NESTED_SCHEMA), json.dumps(NESTED_DOC)),
    ("tool_anyof", "json_schema", json.dumps(TOOL_SCHEMA), json.dumps(TOOL_DOC)),
    ("json_object", "json_object", "", json.dumps(NESTED_DOC)),
    ("regex", "regex", REGEX, REGEX_TEXT),
]


def _obj(props: dict, required: list[str] | None = None, **extra: Any) -> dict:
    """A closed object schema with ``props``, all required unless ``required`` says otherwise."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


# (feature, schema, an instance that satisfies it, an instance that breaks only that feature)
FEATURES: list[tuple[str, dict, Any, Any]] = [
    ("required", _obj({"a": {"type": "integer"}, "b": {"type": "integer"}}), {"a": 1, "b": 2}, {"a": 1}),
    ("additionalProperties: false", _obj({"a": {"type": "integer"}}), {"a": 1}, {"a": 1, "z": 2}),
    (
        "additionalProperties: schema",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"x": 1},
        {"x": "s"},
    ),
    ("enum", _obj({"a": {"enum": ["x", "y"]}}), {"a": "x"}, {"a": "z"}),
    ("const", _obj({"a": {"const": "fixed"}}), {"a": "fixed"}, {"a": "other"}),
    ("anyOf", _obj({"a": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}}), {"a": True}, {"a": "s"}),
    ("oneOf", _obj({"a": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}}), {"a": 3}, {"a": "s"}),
    (
        "allOf",
        _obj({"a": {"allOf": [{"type": "integer"}, {"minimum": 5}]}}),
        {"a": 7},
        {"a": 2},
    ),
    ("type list", _obj({"a": {"type": ["integer", "null"]}}), {"a": None}, {"a": "s"}),
    (
        "$ref / $defs",
        {**_obj({"p": {"$ref": "#/$defs/pt"}}), "$defs": {"pt": _obj({"x": {"type": "integer"}})}},
        {"p": {"x": 1}},
        {"p": {"x": "s"}},
    ),
    (
        "recursive $ref",
        {
            "$ref": "#/$defs/node",
            "$defs": {
                "node": _obj({"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}})
            },
        },
        {"v": 1, "kids": [{"v": 2, "kids": []}]},
        {"v": 1, "kids": [{"v": "s", "kids": []}]},
    ),
    (
        "minItems / maxItems",
        _obj({"a": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}}),
        {"a": [1]},
        {"a": [1, 2, 3]},
    ),
    (
        "prefixItems",
        _obj({"a": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False}}),
        {"a": [1, "s"]},
        {"a": ["s", 1]},
    ),
    (
        "uniqueItems",
        _obj({"a": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}),
        {"a": [1, 2]},
        {"a": [1, 1]},
    ),
    (
        "contains",
        _obj({"a": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}}),
        {"a": [1, 7]},
        {"a": [1, 2]},
    ),
    (
        "minLength / maxLength",
        _obj({"a": {"type": "string", "minLength": 2, "maxLength": 3}}),
        {"a": "ab"},
        {"a": "abcd"},
    ),
    ("pattern", _obj({"a": {"type": "string", "pattern": "^[a-z]+[0-9]$"}}), {"a": "ab1"}, {"a": "1ab"}),
    (
        "format: date-time",
        _obj({"a": {"type": "string", "format": "date-time"}}),
        {"a": "2024-06-01T12:00:00Z"},
        {"a": "yesterday"},
    ),
    ("format: email", _obj({"a": {"type": "string", "format": "email"}}), {"a": "a@b.org"}, {"a": "not an email"}),
    (
        "format: uuid",
        _obj({"a": {"type": "string", "format": "uuid"}}),
        {"a": "123e4567-e89b-12d3-a456-426614174000"},
        {"a": "123"},
    ),
    ("minimum / maximum", _obj({"a": {"type": "integer", "minimum": 1, "maximum": 9}}), {"a": 5}, {"a": 12}),
    ("exclusiveMinimum", _obj({"a": {"type": "number", "exclusiveMinimum": 0}}), {"a": 0.5}, {"a": -1}),
    ("multipleOf", _obj({"a": {"type": "integer", "multipleOf": 5}}), {"a": 15}, {"a": 7}),
    (
        "minProperties / maxProperties",
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
        {"x": 1},
        {"x": 1, "y": 2},
    ),
    (
        "patternProperties",
        {"type": "object", "patternProperties": {"^n_": {"type": "integer"}}, "additionalProperties": False},
        {"n_a": 1},
        {"n_a": "s"},
    ),
    (
        "propertyNames",
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": {"type": "integer"}},
        {"ab": 1},
        {"A1": 1},
    ),
    (
        "dependentRequired",
        {**_obj({"a": {"type": "integer"}, "b": {"type": "integer"}}, required=[]), "dependentRequired": {"a": ["b"]}},
        {"a": 1, "b": 2},
        {"a": 1},
    ),
    ("not", _obj({"a": {"not": {"type": "string"}}}), {"a": 1}, {"a": "s"}),
    (
        "if / then / else",
        _obj({"a": {"if": {"type": "integer"}, "then": {"minimum": 5}, "else": {"type": "string"}}}),
        {"a": 6},
        {"a": 1},
    ),
]


@dataclass
class Engine:
    """One engine behind a small common interface: everything the bench times goes through it."""

    name: str
    package: str
    prepare: Callable[[Any], Any]  # tokenizer -> engine context (tokenizer info)
    compile: Callable[[Any, str, str], Any]  # (ctx, kind, source) -> compiled grammar
    matcher: Callable[[Any], Any]  # compiled -> fresh matcher
    fill: Callable[[Any, np.ndarray], None]  # (matcher, int32 bitmask row [ceil(V/32)]) -> None
    advance: Callable[[Any, int], bool]
    rollback: Callable[[Any, int], None]
    fork: Callable[[Any], Any]
    notes: list[str] = field(default_factory=list)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: each printable stand-in character to its byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def xgrammar_engine() -> Engine:
    """xgrammar: grammars precompiled against the vocabulary; masks from an adaptive token cache."""
    import torch
    import xgrammar as xg

    def prepare(tokenizer):
        info = xg.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        # One thread (the services share two cores) and no cache, so each compile is timed afresh.
        return xg.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_(compiler, kind, source):
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(source)
        return compiler.compile_json_schema(source, strict_mode=True)

    def fill(m, row):
        m.fill_next_token_bitmask(torch.from_numpy(row[None, :]), 0)

    return Engine(
        "xgrammar",
        "xgrammar",
        prepare,
        compile_,
        lambda cg: xg.GrammarMatcher(cg, max_rollback_tokens=64),
        fill,
        lambda m, t: bool(m.accept_token(t)),
        lambda m, n: m.rollback(n),
        lambda m: m.fork(),
    )


def llguidance_engine() -> Engine:
    """llguidance: an Earley parser over a lexer, masks computed on the fly through a token trie."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    def prepare(tokenizer):
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))

    def compile_(tok, kind, source):
        if kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(source)
        else:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(source)
        # The matcher is the compiled form: construction parses and checks the grammar.
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(m, row):
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.size * 4)

    return Engine(
        "llguidance",
        "llguidance",
        prepare,
        compile_,
        lambda proto: proto.deep_copy(),
        fill,
        lambda m, t: bool(m.consume_token(t)),
        lambda m, n: m.rollback(n),
        lambda m: m.deep_copy(),
    )


def outlines_engine() -> Engine:
    """outlines-core: a regex (JSON schemas are turned into one) compiled to a token-level DFA index."""
    import outlines_core as oc

    def prepare(tokenizer):
        decoder = _byte_decoder()
        special = set(tokenizer.all_special_ids)
        by_bytes: dict[bytes, list[int]] = {}
        for text, tid in tokenizer.get_vocab().items():
            if tid not in special:
                by_bytes.setdefault(bytes(decoder[c] for c in text), []).append(tid)
        return oc.Vocabulary(tokenizer.eos_token_id, by_bytes)

    def compile_(vocabulary, kind, source):
        if kind == "json_object":
            regex = oc.json_schema.build_regex_from_schema(json.dumps({"type": "object"}))
        elif kind == "regex":
            regex = source
        else:
            regex = oc.json_schema.build_regex_from_schema(source)
        return oc.Index(regex, vocabulary)

    def fill(m, row):
        m.write_mask_into(row.ctypes.data, row.size, 4)

    def advance(m, t):
        try:
            m.advance(t, return_tokens=False)
        except ValueError:
            return False
        return True

    return Engine(
        "outlines-core",
        "outlines_core",
        prepare,
        compile_,
        lambda index: oc.Guide(index, max_rollback=64),
        fill,
        advance,
        lambda m, n: m.rollback_state(n),
        copy.copy,
    )


def _allowed(row: np.ndarray, token: int) -> bool:
    """Whether bit ``token`` of a packed int32 bitmask row is set."""
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def _walk(engine: Engine, matcher: Any, ids: list[int], eos: int, row: np.ndarray, times: list[int] | None) -> bool:
    """Walks ``ids`` (every token checked against the mask), then asks whether EOS may end it."""
    for token in ids:
        start = time.perf_counter_ns()
        engine.fill(matcher, row)
        if times is not None:
            times.append(time.perf_counter_ns() - start)
        if not _allowed(row, token) or not engine.advance(matcher, token):
            return False
    engine.fill(matcher, row)
    return _allowed(row, eos)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else float("nan")


def time_round(engine: Engine, ctx: Any, tokenizer: Any, acc: dict) -> None:
    """One turn of an engine: compile every grammar afresh, then walk its document timing each mask."""
    eos = tokenizer.eos_token_id
    row = np.zeros((len(tokenizer) + 31) // 32, dtype=np.int32)
    for name, kind, source, doc in GRAMMARS:
        start = time.perf_counter()
        compiled = engine.compile(ctx, kind, source)
        acc["compile_ms"].setdefault(name, []).append((time.perf_counter() - start) * 1e3)
        matcher = engine.matcher(compiled)
        start = time.perf_counter()
        engine.fill(matcher, row)
        acc["first_mask_ms"].setdefault(name, []).append((time.perf_counter() - start) * 1e3)
        matcher = engine.matcher(compiled)
        ids = tokenizer.encode(doc, add_special_tokens=False)
        times: list[int] = []
        ok = _walk(engine, matcher, ids, eos, row, times)
        acc["accepts_doc"].setdefault(name, []).append(ok)
        acc["mask_ns"].setdefault(name, []).extend(times[1:])  # the first mask is timed above


def speculation_support(engine: Engine, ctx: Any, tokenizer: Any) -> dict:
    """Roll back k draft tokens and fork for siblings: supported, exact (same mask after), and cost."""
    _, kind, source, doc = GRAMMARS[1]
    compiled = engine.compile(ctx, kind, source)
    ids = tokenizer.encode(doc, add_special_tokens=False)
    words = (len(tokenizer) + 31) // 32
    m = engine.matcher(compiled)
    masks = []
    for token in ids[:40]:
        row = np.zeros(words, dtype=np.int32)
        engine.fill(m, row)
        masks.append(row)
        engine.advance(m, token)
    out: dict[str, Any] = {}
    # Rollback: from 40 tokens in, back k = 8 (a draft chain), and the mask must be the one seen there.
    rollback_us = []
    exact = True
    try:
        for _ in range(20):
            start = time.perf_counter_ns()
            engine.rollback(m, 8)
            rollback_us.append((time.perf_counter_ns() - start) / 1e3)
            row = np.zeros(words, dtype=np.int32)
            engine.fill(m, row)
            exact &= bool(np.array_equal(row, masks[32]))
            for token in ids[32:40]:
                engine.advance(m, token)
        out["rollback"] = {"supported": True, "exact": exact, "median_us_k8": _median(rollback_us)}
    except Exception as error:  # noqa: BLE001 - the report records what the engine refused
        out["rollback"] = {"supported": False, "error": str(error)[:200]}
    # Fork: copy the state 30 tokens in, advance the copy, check the original's mask is untouched.
    m = engine.matcher(compiled)
    for token in ids[:30]:
        engine.advance(m, token)
    try:
        fork_us = []
        exact = True
        for _ in range(20):
            start = time.perf_counter_ns()
            child = engine.fork(m)
            fork_us.append((time.perf_counter_ns() - start) / 1e3)
            for token in ids[30:38]:
                engine.advance(child, token)
            row = np.zeros(words, dtype=np.int32)
            engine.fill(m, row)
            exact &= bool(np.array_equal(row, masks[30]))
        out["fork"] = {"supported": True, "independent": exact, "median_us": _median(fork_us)}
    except Exception as error:  # noqa: BLE001
        out["fork"] = {"supported": False, "error": str(error)[:200]}
    return out


def coverage(engine: Engine, ctx: Any, tokenizer: Any) -> dict[str, str]:
    """Each feature's verdict: refused (with the engine's reason), enforced, ignored or wrong."""
    eos = tokenizer.eos_token_id
    row = np.zeros((len(tokenizer) + 31) // 32, dtype=np.int32)
    verdicts = {}
    for feature, schema, good, bad in FEATURES:
        try:
            compiled = engine.compile(ctx, "json_schema", json.dumps(schema))
        except Exception as error:  # noqa: BLE001
            verdicts[feature] = "refused: " + str(error).strip().splitlines()[0][:120]
            continue
        ok_good = _walk(engine, engine.matcher(compiled), tokenizer.encode(json.dumps(good)), eos, row, None)
        ok_bad = _walk(engine, engine.matcher(compiled), tokenizer.encode(json.dumps(bad)), eos, row, None)
        verdicts[feature] = "wrong" if not ok_good else "ignored" if ok_bad else "enforced"
    return verdicts


def main() -> None:
    """Measures the engines in turns and writes the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("reports/grammar-engines.json"))
    parser.add_argument("--rounds", type=int, default=6, help="turns per engine, alternating order")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "specdec")
    args = parser.parse_args()

    from specdec.vocab import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path("default", args.cache_dir))
    engines = [xgrammar_engine(), llguidance_engine(), outlines_engine()]
    contexts, prepare_s = {}, {}
    for engine in engines:
        start = time.perf_counter()
        contexts[engine.name] = engine.prepare(tokenizer)
        prepare_s[engine.name] = time.perf_counter() - start
    acc: dict[str, dict] = {
        e.name: {"compile_ms": {}, "first_mask_ms": {}, "mask_ns": {}, "accepts_doc": {}} for e in engines
    }
    for turn in range(args.rounds):
        # A B C, then C B A: each engine runs early and late alike on a machine whose load drifts.
        for engine in engines if turn % 2 == 0 else engines[::-1]:
            time_round(engine, contexts[engine.name], tokenizer, acc[engine.name])
            print(f"turn {turn} {engine.name} done", flush=True)

    report: dict[str, Any] = {
        "tokenizer": "SmolLM2-135M-Instruct",
        "vocab_size": len(tokenizer),
        "rounds": args.rounds,
        "machine": f"{platform.machine()}, shared 2-core CPU; one compile thread per engine",
        "engines": {},
    }
    for engine in engines:
        a = acc[engine.name]
        all_ns = [t for ts in a["mask_ns"].values() for t in ts]
        report["engines"][engine.name] = {
            "version": importlib.metadata.version(engine.package.replace("_", "-")),
            "tokenizer_prepare_s": round(prepare_s[engine.name], 3),
            "compile_ms": {k: round(_median(v), 2) for k, v in a["compile_ms"].items()},
            "first_mask_ms": {k: round(_median(v), 3) for k, v in a["first_mask_ms"].items()},
            "mask_us": {
                "median": round(_median(all_ns) / 1e3, 2),
                "p99": round(_p99(all_ns) / 1e3, 2),
                "mean": round(statistics.fmean(all_ns) / 1e3, 2),
                "tokens": len(all_ns),
                "by_grammar_median": {k: round(_median(v) / 1e3, 2) for k, v in a["mask_ns"].items()},
            },
            "accepts_documents": {k: all(v) for k, v in a["accepts_doc"].items()},
            "speculation": speculation_support(engine, contexts[engine.name], tokenizer),
            "coverage": coverage(engine, contexts[engine.name], tokenizer),
        }
    best_median = min(e["mask_us"]["median"] for e in report["engines"].values())
    best_p99 = min(e["mask_us"]["p99"] for e in report["engines"].values())
    for e in report["engines"].values():
        e["mask_median_vs_fastest"] = round(e["mask_us"]["median"] / best_median, 2)
        e["mask_p99_vs_fastest"] = round(e["mask_us"]["p99"] / best_p99, 2)
        e["compile_plus_first_mask_ms"] = {
            k: round(e["compile_ms"][k] + e["first_mask_ms"][k], 2) for k in e["compile_ms"]
        }
        verdicts = list(e["coverage"].values())
        e["coverage_summary"] = {
            "enforced": sum(v == "enforced" for v in verdicts),
            "ignored": sum(v == "ignored" for v in verdicts),
            "refused": sum(v.startswith("refused") for v in verdicts),
            "wrong": sum(v == "wrong" for v in verdicts),
            "of": len(verdicts),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, e in report["engines"].items():
        print(
            f"{name:14} mask median {e['mask_us']['median']:8.2f} us  p99 {e['mask_us']['p99']:9.2f} us  "
            f"compile {e['compile_plus_first_mask_ms']}  coverage {e['coverage_summary']}"
        )


if __name__ == "__main__":
    main()
