"""Issue 35's grammar rules without a model: a costly spec is refused at admission (and the
refusal cached), equal matcher states share one mask, and a matcher that fails is reported
for its request to end with an error instead of finishing unconstrained."""

from __future__ import annotations

import pytest
import torch

from kdaserve.assets import kimi_linear_demo_path
from kdaserve.engine.step_message import RunnerRequest
from kdaserve.outputs import ScheduledSequence
from kdaserve.request import SamplingParams
from kdaserve.structured import bitmask
from kdaserve.structured.manager import StructuredOutputs
from kdaserve.structured.spec import GuidedDecoding, GuidedDecodingError
from kdaserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def so():
    tok = Tokenizer.from_pretrained(str(kimi_linear_demo_path()))
    s = StructuredOutputs(tok, tok.vocab_size)
    yield s
    s.close()


def _ids(so, text: str) -> list[int]:
    return so._tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("regex", ["(a{1000}){1000}", "(a{300}){300}"])
def test_costly_specs_are_refused_naming_the_field_and_the_refusal_is_cached(so, regex):
    g = GuidedDecoding("regex", regex, field="guided_regex")
    with pytest.raises(GuidedDecodingError, match=r"^guided_regex: the regex spec is too"):
        so.validate(g)
    cache = so._grammar_cache()
    misses = cache.misses
    with pytest.raises(GuidedDecodingError, match="too complex"):
        so.validate(g)
    assert cache.misses == misses           # the second refusal costs nothing
    so.validate(GuidedDecoding("regex", "(ab){3}c", field="guided_regex"))   # a fine one


def test_first_mask_budget_refuses_what_takes_longer(so):
    cache = so._grammar_cache()
    old = cache.first_mask_budget_s
    cache.first_mask_budget_s = 0.0
    try:
        with pytest.raises(GuidedDecodingError, match="over the budget"):
            cache.get(GuidedDecoding("regex", "[a-z]+@[a-z]+"))
    finally:
        cache.first_mask_budget_s = old


def _step(so, reqs: dict[str, RunnerRequest]) -> dict[str, torch.Tensor]:
    seqs = [ScheduledSequence(rid, [0], 5, [], 0, True) for rid in reqs]
    return so.prepare(seqs, reqs).result()


def test_equal_states_share_one_mask_and_a_failed_matcher_is_reported(so, monkeypatch):
    import llguidance.torch as llt

    computed: list[int] = []
    fill = llt.fill_next_token_bitmask_par
    monkeypatch.setattr(llt, "fill_next_token_bitmask_par",
                        lambda ex, rows, out: (computed.append(len(rows)), fill(ex, rows, out)))
    params = SamplingParams(guided=GuidedDecoding("regex", "(hello|help) world"))
    other = SamplingParams(guided=GuidedDecoding("regex", "[0-9]+"))
    reqs = {f"r#{i}": RunnerRequest(f"r#{i}", [1, 2], params) for i in range(4)}
    reqs["x"] = RunnerRequest("x", [1, 2], other)
    masks = _step(so, reqs)
    assert computed == [2]                  # one for the four siblings, one for "x"
    assert all(torch.equal(masks["r#0"], masks[f"r#{i}"]) for i in range(4))
    assert not torch.equal(masks["r#0"], masks["x"])
    # the siblings diverge: r#1 takes "hel" + "lo", the others stay at the start, and r#3
    # takes a token the grammar refuses (a stop string, a retry: a matcher that fails)
    reqs["r#1"].output_token_ids = _ids(so, "hello")
    reqs["r#3"].output_token_ids = _ids(so, "7")
    computed.clear()
    masks = _step(so, reqs)
    assert computed == [3]                  # r#0 and r#2 share; r#1 and x alone; r#3 failed
    assert torch.equal(masks["r#0"], masks["r#2"]) and not torch.equal(masks["r#0"],
                                                                        masks["r#1"])
    allowed = bitmask.allocate(1, so.vocab_size)
    so._eos_only(allowed)
    assert torch.equal(masks["r#3"], allowed)
    failed = so.take_failures()
    assert set(failed) == {"r#3"} and failed["r#3"]
    assert so.take_failures() == {}
    for rid in reqs:
        so.forget(rid)
