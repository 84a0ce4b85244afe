"""Structured output: a ``response_format`` compiled into a grammar, and per-session token masks.

The engine is llguidance (chosen by measurement: ``bench/grammar_engines.py``, docs/openai.md
"Structured output: engine choice"). This module is the whole of the project's contact with it:

- ``ResponseFormat`` is what a request asks for: ``json_object``, ``json_schema`` (``strict`` or not)
  or ``regex`` (an extension); ``parse_response_format`` reads OpenAI's ``response_format`` object.
  A fourth kind, ``lark`` (a grammar in llguidance's Lark syntax), is the server's own: the OpenAI
  API builds one to enforce ``tool_choice`` (``coordinator.tools``); no request names it directly.
- ``GrammarCompiler`` holds one tokenizer's view for the engine and compiles formats, cached by
  (format text, tokenizer fingerprint): agents send the same schema on every call.
- ``GrammarMatcher`` is one session's grammar state: ``allowed()`` (the mask), ``advance``,
  ``rollback`` and ``fork``; ``masks_along`` and ``masks_for_tree`` give the masks a verify pass needs
  for a chain or a tree of draft tokens in one go, without touching the session's state.

**The mask defines the constrained distribution.** Exactness under a grammar means: the draft samples
from its q masked by ``allowed()``, the target verifies against its p masked the same way, and both
advance with the committed tokens only. The mask is a deterministic function of the committed prefix
(rollback and fork restore it bit for bit). It can be narrower than "every token whose bytes keep the
text valid": where the grammar forces text (``{"name": `` in a closed object), llguidance allows only
that text's canonical tokens. So ``advance`` accepts exactly the tokens the mask allows, never merely
byte-valid ones, or a session could reach states no constrained target-only run reaches.

**End of grammar.** An end token is allowed exactly when the text is a complete document; once
nothing else can follow, it is the only token allowed. After an end token nothing is allowed.

**Vocabulary padding.** A model's ``vocab_size`` can exceed its tokenizer's (padding rows of the
embedding). Masks are as wide as the model's vocabulary, and padding ids are never allowed.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import llguidance.hf
import numpy as np

from specdec.vocab import tokenizer_fingerprint

FormatKind = Literal["json_object", "json_schema", "regex", "lark"]

# JSON is written with the separators json.dumps uses and no other whitespace: a small model under
# "any whitespace" can spend its whole budget on newlines inside a document, and one fixed layout keeps
# the constrained distribution sharp. "lenient" stays off in every case, so a schema's own
# "x-guidance" cannot make the engine ignore keywords it does not implement.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}

# Schema keywords whose value is one subschema, a list of them, or a map of names to them: where
# ``close_objects`` looks for objects.
_ONE_SCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


@dataclass(frozen=True)
class ResponseFormat:
    """What the output must match.

    ``kind`` is ``json_object`` (any JSON object), ``json_schema`` (a document that ``schema``, a JSON
    text, accepts) or ``regex`` (text that ``pattern`` matches in full; an extension, as vLLM's
    ``guided_regex``) or ``lark`` (text the Lark grammar ``pattern`` derives; built by the server, never
    read from a request's ``response_format``). ``strict`` (json_schema) closes every object that does not say
    ``additionalProperties``, as OpenAI's strict mode requires them closed; without it such objects
    take extra properties, as JSON Schema says.
    """

    kind: FormatKind
    schema: str = ""
    pattern: str = ""
    strict: bool = False

    def key(self) -> str:
        """A canonical text of the format: equal keys compile to the same grammar."""
        return json.dumps([self.kind, self.schema, self.pattern, self.strict])

    @classmethod
    def from_key(cls, key: str) -> ResponseFormat:
        """The format whose ``key()`` is ``key`` (as the services read it off the wire); ValueError
        naming ``sampling.response_format`` when it is not one."""
        try:
            kind, schema, pattern, strict = json.loads(key)
        except (ValueError, TypeError):
            raise ValueError("sampling.response_format: not a [kind, schema, pattern, strict] JSON list") from None
        if kind not in ("json_object", "json_schema", "regex", "lark") or not isinstance(strict, bool):
            raise ValueError(f"sampling.response_format: kind {kind!r} is not json_object, json_schema, regex or lark")
        if not isinstance(schema, str) or not isinstance(pattern, str):
            raise ValueError("sampling.response_format: schema and pattern must be strings")
        return cls(kind, schema, pattern, strict)


def parse_response_format(value: Mapping[str, Any]) -> ResponseFormat:
    """Reads OpenAI's ``response_format`` (``{"type": "json_schema", "json_schema": {"schema": ...,
    "strict": true}}``, ``{"type": "json_object"}``) or the extension ``{"type": "regex", "regex": ...}``.

    ``{"type": "text"}`` is no constraint and is not a format: the caller checks for it first. Raises
    ValueError naming the field that is wrong.
    """
    kind = value.get("type")
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise ValueError("response_format.json_schema.schema must be a JSON object")
        strict = spec.get("strict", False)
        if not isinstance(strict, bool):
            raise ValueError("response_format.json_schema.strict must be a boolean")
        # Not sort_keys: the order of "properties" is the order the document is written in.
        return ResponseFormat("json_schema", schema=json.dumps(spec["schema"]), strict=strict)
    if kind == "regex":
        pattern = value.get("regex")
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("response_format.regex must be a non-empty string")
        return ResponseFormat("regex", pattern=pattern)
    raise ValueError(f"response_format.type {kind!r} is not one of json_object, json_schema, regex")


def response_format_key(value: Any) -> str:
    """The wire form (``ResponseFormat.key()``) of OpenAI's ``response_format`` object; "" for none
    (absent, null or ``{"type": "text"}``). ValueError naming the field that is wrong."""
    if value is None:
        return ""
    if not isinstance(value, Mapping):
        raise ValueError("response_format must be a JSON object with a type")
    if value.get("type") == "text":
        return ""
    return parse_response_format(value).key()


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema without ``additionalProperties`` (or
    ``patternProperties``) gets ``additionalProperties: false``: strict mode's closed objects."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    for key in _ONE_SCHEMA + ("additionalProperties",):
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    if isinstance(out.get("items"), list):  # draft-04 tuples
        out["items"] = [close_objects(s) for s in out["items"]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    return out


def grammar_text(fmt: ResponseFormat) -> str:
    """The engine's grammar for ``fmt`` (not yet checked: ``GrammarCompiler.compile`` checks it)."""
    if fmt.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(fmt.pattern)
    if fmt.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(fmt.pattern)
    if fmt.kind == "json_object":
        schema: Any = {"type": "object"}
    else:
        try:
            schema = json.loads(fmt.schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise ValueError("the JSON schema must be a JSON object")
        if fmt.strict:
            schema = close_objects(schema)
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)  # type: ignore[arg-type]


@dataclass(frozen=True)
class CompiledGrammar:
    """A checked grammar for one tokenizer. ``prototype`` is a matcher that never advances: each
    session's matcher is a copy of it, which costs microseconds where building one costs milliseconds."""

    fmt: ResponseFormat
    prototype: llguidance.LLMatcher
    tokenizer_vocab: int
    vocab_size: int
    eos_ids: tuple[int, ...]


class _TokenList:
    """A plain list of token byte strings in the shape llguidance's ``TokenizerWrapper`` reads."""

    def __init__(self, tokens: Sequence[bytes], eos_id: int, special_ids: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.eos_token_id = eos_id
        self.bos_token_id = None
        self.special_token_ids = list(special_ids)
        self._ids = {t: i for i, t in enumerate(self.tokens) if t}
        self._longest = max((len(t) for t in self.tokens), default=1)

    def __call__(self, text: bytes | str) -> list[int]:
        # Greedy longest match: llguidance tokenizes only to split forced text, where any valid split
        # of the bytes will do. It probes with bytes first and falls back to str when that raises.
        if isinstance(text, str):
            text = text.encode()
        out, i = [], 0
        while i < len(text):
            for n in range(min(self._longest, len(text) - i), 0, -1):
                token = self._ids.get(text[i : i + n])
                if token is not None:
                    out.append(token)
                    i += n
                    break
            else:
                raise ValueError(f"byte {text[i]!r} has no token")
        return out


class GrammarCompiler:
    """Compiles ``ResponseFormat`` for one tokenizer, caching the result.

    ``vocab_size`` is the model's (its logits' width), at least the tokenizer's; ids past the
    tokenizer's are padding and never allowed. ``eos_ids`` are the tokens that end a document (default:
    the tokenizer's EOS). Building the engine's view of a 49k vocabulary takes about a second, so make
    one compiler per tokenizer and keep it.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        eos_ids: Sequence[int] | None = None,
        cache_size: int = 64,
    ) -> None:
        """Wraps a transformers fast tokenizer (``specdec.vocab.load_tokenizer``)."""
        eos = list(eos_ids) if eos_ids is not None else [tokenizer.eos_token_id]
        self._init(
            llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=eos),
            len(tokenizer),
            vocab_size,
            eos,
            tokenizer_fingerprint(tokenizer),
            cache_size,
        )

    @classmethod
    def from_token_bytes(
        cls,
        tokens: Sequence[bytes],
        eos_ids: Sequence[int],
        vocab_size: int | None = None,
        cache_size: int = 64,
    ) -> GrammarCompiler:
        """A compiler over a bare vocabulary: token ``i`` is the bytes ``tokens[i]``; the end tokens'
        entries are ignored (they stand for no text). For small test vocabularies and tokenizers that
        transformers cannot load as fast tokenizers."""
        self = cls.__new__(cls)
        eos = list(eos_ids)
        wrapper = _TokenList([b"" if i in eos else t for i, t in enumerate(tokens)], eos[0], eos)
        fingerprint = json.dumps([[t.hex() for t in tokens], eos])
        self._init(
            llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper), n_vocab=len(tokens), eos_token=eos),
            len(tokens),
            vocab_size,
            eos,
            fingerprint,
            cache_size,
        )
        return self

    def _init(
        self,
        engine_tokenizer: llguidance.LLTokenizer,
        tokenizer_vocab: int,
        vocab_size: int | None,
        eos_ids: list[int],
        fingerprint: str,
        cache_size: int,
    ) -> None:
        vocab = tokenizer_vocab if vocab_size is None else vocab_size
        if vocab < tokenizer_vocab:
            raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer's {tokenizer_vocab} tokens")
        if not eos_ids or any(not 0 <= e < tokenizer_vocab for e in eos_ids):
            raise ValueError(f"end token ids {eos_ids} must be tokenizer ids")
        self._tokenizer = engine_tokenizer
        self.tokenizer_vocab = tokenizer_vocab
        self.vocab_size = vocab
        self.eos_ids = tuple(eos_ids)
        self.fingerprint = fingerprint
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()

    def compile(self, fmt: ResponseFormat) -> CompiledGrammar:
        """The checked grammar for ``fmt``, from the cache when it was compiled before.

        Raises ValueError with the engine's reason when the format cannot be compiled: a schema
        keyword the engine does not implement (its message names it, as ``Unimplemented keys:
        ["uniqueItems"]``), a ``$ref`` that points nowhere, an invalid regex.
        """
        key = (fmt.key(), self.fingerprint)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        grammar = grammar_text(fmt)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if failed:
            what = {"regex": "regex", "lark": "grammar"}.get(fmt.kind, "JSON schema")
            raise ValueError(f"unsupported {what}: {messages[0].strip()}")
        prototype = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if prototype.is_error():
            raise ValueError(f"unsupported grammar: {prototype.get_error()}")
        compiled = CompiledGrammar(fmt, prototype, self.tokenizer_vocab, self.vocab_size, self.eos_ids)
        self._cache[key] = compiled
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, fmt_or_grammar: ResponseFormat | CompiledGrammar) -> GrammarMatcher:
        """A fresh session matcher at the start of the document."""
        compiled = fmt_or_grammar if isinstance(fmt_or_grammar, CompiledGrammar) else self.compile(fmt_or_grammar)
        return GrammarMatcher(compiled, compiled.prototype.deep_copy(), 0, False)


def compiler_for(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> GrammarCompiler:
    """The compiler for a served model's tokenizer (``vocab_size``: the model's logits' width).

    A tokenizer whose decoder llguidance cannot read (the word-level test vocabularies) is taken as a
    bare vocabulary: each token's bytes are its own string. Its grammars then speak of tokens' strings
    without the separators its decoder would add."""
    try:
        return GrammarCompiler(tokenizer, vocab_size, eos_ids)
    except ValueError as error:
        if "decoder type" not in str(error):
            raise
    tokens = [str(t).encode() for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))]
    return GrammarCompiler.from_token_bytes(tokens, eos_ids, vocab_size)


class GrammarMatcher:
    """One session's position in its grammar, advanced with committed tokens.

    ``allowed()`` is the next token's mask, as wide as the model's vocabulary. ``advance`` takes only
    allowed tokens (ValueError otherwise, the state unchanged), ``rollback(n)`` undoes the last n and
    ``fork()`` copies the state for exploring another path. ``consumed`` counts advanced tokens, the
    end token included.
    """

    def __init__(self, grammar: CompiledGrammar, engine: llguidance.LLMatcher, consumed: int, ended: bool) -> None:
        """Internal: use ``GrammarCompiler.matcher`` or ``fork``."""
        self.grammar = grammar
        self._engine = engine
        self.consumed = consumed
        # The end token is kept out of the engine: its rollback does not count one (measured), so a
        # rollback over an end would undo a real token too.
        self._ended = ended
        self._words = (grammar.tokenizer_vocab + 31) // 32

    @property
    def vocab_size(self) -> int:
        """The mask's width: the model's vocabulary."""
        return self.grammar.vocab_size

    @property
    def ended(self) -> bool:
        """Whether an end token was advanced: nothing more is allowed."""
        return self._ended

    def is_complete(self) -> bool:
        """Whether the text so far is a whole document (an end token may come now)."""
        return self._ended or self._engine.is_accepting()

    def bitmask(self) -> np.ndarray:
        """The mask packed 32 tokens to an int32, bit ``t % 32`` of word ``t // 32`` (llguidance's and
        xgrammar's layout): int32 [ceil(tokenizer vocab / 32)]. Ids past it are padding, never allowed."""
        row = np.zeros(self._words, dtype=np.int32)  # [W]
        if self._ended:
            return row
        self._engine.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self._engine.is_error():
            # The engine's per-step budget (lexer fuel, Earley items) ran out: no mask can be trusted.
            raise RuntimeError(f"grammar engine failed: {self._engine.get_error()}")
        return row

    def allowed(self) -> np.ndarray:
        """The next token's mask: bool [vocab_size], True where the grammar allows the token."""
        mask = np.zeros(self.vocab_size, dtype=bool)  # [V]
        bits = np.unpackbits(self.bitmask().view(np.uint8), bitorder="little")  # [32 W]
        mask[: self.grammar.tokenizer_vocab] = bits[: self.grammar.tokenizer_vocab]
        return mask

    def is_allowed(self, token: int) -> bool:
        """Whether ``token`` may come next."""
        if not 0 <= token < self.grammar.tokenizer_vocab:
            return False
        return bool((int(self.bitmask()[token >> 5]) >> (token & 31)) & 1)

    def advance(self, token: int) -> None:
        """Moves past ``token``; ValueError, and no change, when the mask does not allow it."""
        if not self.is_allowed(token):
            raise ValueError(f"token {token} is not allowed by the grammar after {self.consumed} tokens")
        if token in self.grammar.eos_ids:
            self._ended = True
        elif not self._engine.consume_token(token):
            raise RuntimeError(f"grammar engine refused an allowed token: {self._engine.get_error()}")
        self.consumed += 1

    def advance_many(self, tokens: Sequence[int]) -> None:
        """``advance`` each token in turn; on a refused token, the ones before it stay advanced."""
        for token in tokens:
            self.advance(token)

    def rollback(self, n: int) -> None:
        """Undoes the last ``n`` advanced tokens (at most ``consumed``), restoring the exact mask."""
        if not 0 <= n <= self.consumed:
            raise ValueError(f"cannot roll back {n} of {self.consumed} tokens")
        if n == 0:
            return
        engine_n = n
        if self._ended:
            self._ended = False
            engine_n -= 1
        # A rollback past what the engine holds would put it into its error state for good: checked above.
        if engine_n and not self._engine.rollback(engine_n):
            raise RuntimeError(f"grammar engine failed to roll back: {self._engine.get_error()}")
        self.consumed -= n

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar leaves no choice over from here, this state unchanged: while exactly
        one token is allowed, that token (at most ``limit`` of them, an end token last).

        A constrained target can emit nothing else there, greedy or sampled, so such a run is accepted
        whole wherever it is proposed. Token-level, not text-level: where the forced text could be cut
        into tokens in more than one way (llguidance's fast-forward tokens pick one cut), the grammar
        allows each first piece and the run stops.
        """
        out: list[int] = []
        probe = self.fork()
        while len(out) < limit and not probe.ended:
            bits = np.unpackbits(probe.bitmask().view(np.uint8), bitorder="little")  # [32 W]
            allowed = np.flatnonzero(bits[: self.grammar.tokenizer_vocab])
            if len(allowed) != 1:
                break
            out.append(int(allowed[0]))
            probe.advance(out[-1])
        return out

    def fork(self) -> GrammarMatcher:
        """An independent copy of this state (about 2 us): advancing one never moves the other."""
        return GrammarMatcher(self.grammar, self._engine.deep_copy(), self.consumed, self._ended)

    def masks_along(self, tokens: Sequence[int]) -> np.ndarray:
        """The masks a verify pass needs for a chain of draft tokens, this state unchanged.

        bool [len(tokens) + 1, vocab_size]: row 0 is this state's mask (for ``tokens[0]``), row i + 1
        the mask after ``tokens[: i + 1]`` (for the next draft token, or the target's own token after
        the last). Where a token is not allowed by its row, that token cannot be accepted and no state
        follows it: every later row is all False.
        """
        masks = np.zeros((len(tokens) + 1, self.vocab_size), dtype=bool)  # [k + 1, V]
        state = self.fork()
        masks[0] = state.allowed()
        for i, token in enumerate(tokens):
            if not (0 <= token < self.vocab_size and masks[i, token]):
                break
            state.advance(token)
            masks[i + 1] = state.allowed()
        return masks

    def masks_for_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """The masks for a token tree (``specdec.trees``' layout), this state unchanged.

        Node i holds ``tokens[i]`` and hangs under node ``parents[i]`` (-1: under the committed state),
        with every parent before its children. bool [len(tokens) + 1, vocab_size]: row 0 is this state's
        mask (for the root's children), row i + 1 the mask after the path from the root to node i (for
        node i's children, or the target's own token after it). A node its parent's row does not allow,
        and everything under it, gets an all-False row, as in ``masks_along``. Each row equals
        ``masks_along(path)[-1]`` for that node's path.
        """
        if len(parents) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(parents)} parents")
        masks = np.zeros((len(tokens) + 1, self.vocab_size), dtype=bool)  # [N + 1, V]
        masks[0] = self.allowed()
        has_children = {p for p in parents if p >= 0}
        states: dict[int, GrammarMatcher] = {-1: self}
        for i, (token, parent) in enumerate(zip(tokens, parents)):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}'s parent {parent} does not come before it")
            base = states.get(parent)
            if base is None or not (0 <= token < self.vocab_size and masks[parent + 1, token]):
                continue  # an illegal node (or one under it): its row stays all False
            state = base.fork()
            state.advance(token)
            masks[i + 1] = state.allowed()
            if i in has_children:
                states[i] = state
        return masks
