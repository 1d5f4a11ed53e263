"""Turn a `GuidedDecoding` into an llguidance grammar, and refuse what cannot compile.

Why llguidance (docs/structured-outputs.md has the figures): at vocab 163,840 its masks cost
~0.2 ms per token on average on one core, a new schema compiles in ~5 ms (xgrammar: ~0.1-0.25 s,
paid in the engine loop by every request bringing new tools), and it has no dependencies
(xgrammar's wheel pulls triton, which switches transformers' kimi_linear to GPU-only kernels).

`grammar_text` needs no tokenizer (the API edge calls it to answer 400s early); compiled
grammars are cached by spec in the engine process.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict

import llguidance as llg

from kdaserve.structured.spec import GuidedDecoding, GuidedDecodingError
from kdaserve.structured.strict import close_objects

# Compact JSON unless the request wants free whitespace: what `json.dumps` writes.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_OBJECT = '{"type": "object"}'


# What one request's grammar may cost. llguidance's default lexer fuel lets a regex like
# (a{1000}){1000} spend seconds on its first mask (measured: 3-5 s at the demo's vocabulary,
# ~0.2 s with this fuel, while a 30-property JSON schema needs ~0.02 s). A compile and first
# mask over the budget, or a matcher out of fuel, is a 400 at admission (which runs off the
# engine loop: engine/grammar_admission.py); one that runs out later ends its request with
# an error (manager.py).
INITIAL_LEXER_FUEL = 100_000
FIRST_MASK_BUDGET_S = 1.0


def _limits() -> llg.LLParserLimits:
    # verbose errors would put grammar internals in messages that go back to clients
    return llg.LLParserLimits(verbose_errors=False, initial_lexer_fuel=INITIAL_LEXER_FUEL)


def grammar_text(g: GuidedDecoding) -> str:
    """The llguidance grammar (JSON text) for a spec; raises GuidedDecodingError."""
    try:
        if g.kind in ("json", "json_object"):
            options = None if g.whitespace else _COMPACT
            spec = _ANY_OBJECT
            if g.kind == "json":
                spec = json.dumps(close_objects(json.loads(g.spec))) if g.strict else g.spec
            return llg.LLMatcher.grammar_from_json_schema(spec, defaults=options)
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
    text = " ".join(line.strip() for line in message.splitlines()
                    if line.strip() and line.strip() != "<non-verbose/>")
    return text[:500] or "unknown error"


class GrammarCache:
    """Grammars checked against the tokenizer, by spec (LRU), each kept as a matcher in its
    start state: a request's matcher is a copy of it (microseconds, where building one from
    the grammar text recompiles it: ~20 ms for a large schema, paid once per sequence).

    `get` is what admission calls (structured/admission in the engine process runs it on its
    compile thread, never on the engine loop): a miss compiles and tries the first mask
    under the budget. `matcher` is what a step calls; a miss there (a rank's own cache: rank
    0 admitted the spec) compiles without the trial. Both threads use the cache: the lock
    guards the dictionary only, never a compile."""

    def __init__(self, tokenizer: llg.LLTokenizer, capacity: int = 256,
                 first_mask_budget_s: float = FIRST_MASK_BUDGET_S) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.first_mask_budget_s = first_mask_budget_s
        # refusals are kept too: a client repeating a costly spec pays its price once
        self._cache: OrderedDict[tuple, llg.LLMatcher | GuidedDecodingError] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, g: GuidedDecoding) -> llg.LLMatcher:
        """The spec's matcher in its start state (not to be advanced: `matcher` copies it)."""
        return self._entry(g, trial=True)

    def matcher(self, g: GuidedDecoding) -> llg.LLMatcher:
        return self._entry(g, trial=False).deep_copy()

    def _entry(self, g: GuidedDecoding, trial: bool) -> llg.LLMatcher:
        key = g.key
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
        if entry is None:
            try:
                entry = self._compile(g, trial)
            except GuidedDecodingError as exc:
                entry = exc
            with self._lock:
                self._cache[key] = entry
                if len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)
        if isinstance(entry, GuidedDecodingError):
            raise GuidedDecodingError(str(entry))
        return entry

    def _compile(self, g: GuidedDecoding, trial: bool) -> llg.LLMatcher:
        start = time.perf_counter()
        m = llg.LLMatcher(self.tokenizer, validate(g, self.tokenizer), log_level=0,
                          limits=_limits())
        if m.is_error():         # the lexer's fuel ran out building it
            raise GuidedDecodingError(f"the {g.kind} spec is too complex to follow: "
                                      f"{_clean(m.get_error())}")
        if trial:
            self._first_mask(g, m.deep_copy(), start)
        return m

    def _first_mask(self, g: GuidedDecoding, m: llg.LLMatcher, start: float) -> None:
        """Computes a first mask under the limits, and checks the time budget (the compile's
        and the mask's: what every request with this spec would cost)."""
        mask = m.compute_bitmask()
        # and one step along it: a lexer that runs out of fuel on its first token (the
        # (a{1000}){1000} kind) is refused here, not after the request was admitted
        first = _first_allowed(mask)
        if first is not None and not m.is_stopped() and m.consume_token(first) \
                and not m.is_stopped():
            m.compute_bitmask()
        took = time.perf_counter() - start
        if m.is_error():
            raise GuidedDecodingError(f"the {g.kind} spec is too complex to follow: "
                                      f"{_clean(m.get_error())}")
        if took > self.first_mask_budget_s:
            raise GuidedDecodingError(
                f"the {g.kind} spec is too costly to follow: its compile and first token "
                f"mask took {took:.2f} s, over the budget of {self.first_mask_budget_s:g} s")


def _first_allowed(mask: bytes) -> int | None:
    for i, byte in enumerate(mask):     # little-endian bits: token id 8 * i + bit
        if byte:
            return 8 * i + (byte & -byte).bit_length() - 1
    return None


def json_schema_of(g: GuidedDecoding) -> dict | bool | None:
    """The schema a json spec carries (None for other kinds)."""
    return json.loads(g.spec) if g.kind == "json" else None
