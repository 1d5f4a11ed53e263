"""Turn a `GuidedDecoding` into an llguidance grammar, and refuse what cannot compile.

Why llguidance (docs/structured-outputs.md has the figures): at vocab 163,840 its masks cost
~0.2 ms per token on average on one core, a new schema compiles in ~5 ms (xgrammar: ~0.1-0.25 s,
paid in the engine loop by every request bringing new tools), and it has no dependencies
(xgrammar's wheel pulls triton, which switches transformers' kimi_linear to GPU-only kernels).

`grammar_text` needs no tokenizer (the API edge calls it to answer 400s early); `Compiled`
grammars are cached by spec in the engine process.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict

import llguidance as llg

from kdaserve.structured.spec import GuidedDecoding, GuidedDecodingError

# Compact JSON unless the request wants free whitespace: what `json.dumps` writes.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_OBJECT = '{"type": "object"}'


def _limits() -> llg.LLParserLimits:
    # verbose errors would put grammar internals in messages that go back to clients
    return llg.LLParserLimits(verbose_errors=False)


def grammar_text(g: GuidedDecoding) -> str:
    """The llguidance grammar (JSON text) for a spec; raises GuidedDecodingError."""
    try:
        if g.kind in ("json", "json_object"):
            options = None if g.whitespace else _COMPACT
            return llg.LLMatcher.grammar_from_json_schema(
                g.spec if g.kind == "json" else _ANY_OBJECT, defaults=options)
        if g.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(g.spec)
        if g.kind == "choice":
            return llg.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in g.choices))
        return llg.LLMatcher.grammar_from_lark(g.spec)
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:
        raise GuidedDecodingError(f"the {g.kind} spec cannot be compiled: {_clean(str(exc))}"
                                  ) from None


def validate(g: GuidedDecoding, tokenizer: llg.LLTokenizer | None = None) -> str:
    """Compile the spec's grammar and return it; a grammar llguidance rejects (unsupported
    schema keyword, bad regex, Lark syntax) raises GuidedDecodingError saying why."""
    text = grammar_text(g)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, tokenizer,
                                                                     limits=_limits())
    if is_error:
        raise GuidedDecodingError(f"the {g.kind} spec cannot be compiled: "
                                  f"{_clean(messages[0] if messages else 'unknown error')}")
    return text


def _clean(message: str) -> str:
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return text[:500] or "unknown error"


class GrammarCache:
    """Grammars checked against the tokenizer, by spec (LRU). A matcher is cheap to make from
    a cached grammar text (~1 ms); the validation against the vocabulary is what is saved."""

    def __init__(self, tokenizer: llg.LLTokenizer, capacity: int = 256) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self._cache: OrderedDict[tuple, str] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, g: GuidedDecoding) -> str:
        key = g.key
        text = self._cache.get(key)
        if text is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return text
        self.misses += 1
        text = validate(g, self.tokenizer)
        self._cache[key] = text
        if len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return text

    def matcher(self, g: GuidedDecoding) -> llg.LLMatcher:
        m = llg.LLMatcher(self.tokenizer, self.get(g), log_level=0, limits=_limits())
        if m.is_error():
            raise GuidedDecodingError(f"the {g.kind} spec cannot be compiled: "
                                      f"{_clean(m.get_error())}")
        return m


def json_schema_of(g: GuidedDecoding) -> dict | bool | None:
    """The schema a json spec carries (None for other kinds)."""
    return json.loads(g.spec) if g.kind == "json" else None
