"""The compile thread that keeps grammar work off the engine loop (issue 35): a request comes
back once its spec is compiled, or with the compiler's refusal; an aborted one is forgotten;
what it compiled is cached for the engine's own check and the request's matchers."""

from __future__ import annotations

import time

import pytest

from kdaserve.assets import kimi_linear_demo_path
from kdaserve.engine.grammar_admission import GrammarAdmission
from kdaserve.structured.manager import StructuredOutputs
from kdaserve.structured.spec import GuidedDecoding, GuidedDecodingError
from kdaserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def so():
    tok = Tokenizer.from_pretrained(str(kimi_linear_demo_path()))
    s = StructuredOutputs(tok, tok.vocab_size)
    yield s
    s.close()


def _settle(adm: GrammarAdmission, want: int) -> list:
    out: list = []
    deadline = time.monotonic() + 60         # a bound against a hang, not a timing assert
    while len(out) < want and time.monotonic() < deadline:
        out += adm.done()
        time.sleep(0.01)
    return out


def test_compiled_refused_and_discarded(so):
    adm: GrammarAdmission[str] = GrammarAdmission(so.validate)
    try:
        good = GuidedDecoding("regex", "(ab){2,9}c", field="guided_regex")
        adm.submit("a", good, "item-a")
        adm.submit("b", GuidedDecoding("regex", "(a{1000}){1000}", field="guided_regex"), "b")
        adm.submit("c", GuidedDecoding("json", '{"type": "object"}'), "item-c")
        assert adm.discard("c") and not adm.discard("c")
        done = _settle(adm, 2)
        assert [(c.request_id, c.item) for c in done] == [("a", "item-a"), ("b", "b")]
        assert done[0].error is None
        assert isinstance(done[1].error, GuidedDecodingError)
        assert str(done[1].error).startswith("guided_regex: the regex spec is too complex")
        assert not adm.busy and adm.done() == []
        cache = so._grammar_cache()
        misses = cache.misses
        so.validate(good)                    # the engine's own check: a lookup now
        m1, m2 = cache.matcher(good), cache.matcher(good)
        assert cache.misses == misses
        assert m1.consume_tokens(so._tokenizer.encode("ab", add_special_tokens=False))
        assert m2.compute_bitmask() == cache.get(good).compute_bitmask()   # copies: apart
    finally:
        adm.close()
