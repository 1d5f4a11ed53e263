"""Structured outputs in the engine: the demo model constrained by grammars, alone and with
speculative decoding (drafts checked against the grammar, rejected ones rolled back): the
same greedy tokens with and without drafts; and seeded sampling too."""

from __future__ import annotations

import json

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.assets import KIMI_LINEAR_DEMO_DIR
from kdaserve.structured.spec import GuidedDecoding

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "lines": {"type": "array", "items": {"enum": ["to be", "or not", "to be"]}, "maxItems": 3},
    "act": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["name", "lines", "act"], "additionalProperties": False}
PROMPTS = ["ROMEO: What say you?", "JULIET: O Romeo, Romeo", "HAMLET: Speak the speech"]


def generate(llm: LLM, guided: GuidedDecoding | None, temperature: float = 0.0,
             max_tokens: int = 60) -> list[list[int]]:
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, guided=guided, seed=3)
    torch.set_num_threads(1)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain():
    return LLM(str(KIMI_LINEAR_DEMO_DIR), max_model_len=512, cache_memory=64 << 20)


@pytest.mark.parametrize("method,model", [
    ("ngram", None), ("dspark", str(KIMI_LINEAR_DEMO_DIR / "draft"))])
def test_speculation_with_grammar_gives_the_same_tokens(plain, method, model):
    spec = LLM(str(KIMI_LINEAR_DEMO_DIR), max_model_len=512, cache_memory=64 << 20,
               speculative_method=method, num_speculative_tokens=4, speculative_model=model,
               speculative_adaptive=False)
    g = GuidedDecoding("json", json.dumps(SCHEMA))
    want = generate(plain, g)
    assert generate(spec, g) == want
    for ids in want:
        json.loads(plain.tokenizer.decode(ids))
    assert spec.engine.scheduler.num_draft_tokens > 0    # drafts were verified under it
    # unconstrained greedy output is untouched by the grammar machinery
    assert generate(spec, None) == generate(plain, None)


def test_outputs_match_the_grammar(plain):
    sp = SamplingParams(temperature=1.0, max_tokens=120, seed=5,
                        guided=GuidedDecoding("json", json.dumps(SCHEMA)))
    for out in plain.generate(PROMPTS, sp, use_tqdm=False):
        doc = json.loads(out.outputs[0].text)
        assert set(doc) == {"name", "lines", "act"} and 1 <= doc["act"] <= 5
    sp = SamplingParams(temperature=0.0, max_tokens=10,
                        guided=GuidedDecoding("choice", choices=["aye", "nay"]))
    assert {o.outputs[0].text for o in plain.generate(PROMPTS, sp, use_tqdm=False)} <= {
        "aye", "nay"}


def test_bad_grammar_is_refused_at_add(plain):
    with pytest.raises(ValueError, match="cannot be compiled"):
        plain.generate(["x"], SamplingParams(guided=GuidedDecoding("regex", "a(")),
                       use_tqdm=False)
    # the engine goes on
    assert plain.generate(["x"], SamplingParams(max_tokens=2, temperature=0.0),
                          use_tqdm=False)[0].outputs[0].token_ids
