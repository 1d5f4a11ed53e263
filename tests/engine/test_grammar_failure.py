"""A grammar matcher that fails mid-output ends its request with an error (issue 35), never a
"stop" whose output breaks the constraint; its neighbours in the batch go on."""

from __future__ import annotations

from kdaserve import LLM, SamplingParams
from kdaserve.assets import KIMI_LINEAR_DEMO_DIR
from kdaserve.structured import matcher
from kdaserve.structured.spec import GuidedDecoding


def test_a_failed_matcher_ends_its_request_with_an_error(monkeypatch):
    llm = LLM(str(KIMI_LINEAR_DEMO_DIR), max_model_len=256, cache_memory=64 << 20)
    accept = matcher.RequestGrammar.accept

    def failing(self, tokens):                 # the matcher runs out of fuel at token 3
        if self.num_tokens + len(tokens) >= 3:
            self._fail("lexer error: too many expressions constructed")
            return
        accept(self, tokens)
    monkeypatch.setattr(matcher.RequestGrammar, "accept", failing)
    eng = llm.engine
    eng.add_request("bad", eng.tokenizer.encode("ROMEO:"),
                    SamplingParams(temperature=0.0, max_tokens=12,
                                   guided=GuidedDecoding("regex", "[a-z ]{1,40}")))
    eng.add_request("good", eng.tokenizer.encode("JULIET:"),
                    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    final = {}
    while eng.has_unfinished():
        final.update({d.request_id: d for d in eng.step() if d.finished})
    assert final["bad"].finish_reason == "error"
    assert "grammar failed: lexer error" in final["bad"].error
    assert final["good"].finish_reason == "length"
    assert eng.stats.failed == 1
