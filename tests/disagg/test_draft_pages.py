"""The DSpark draft's context travels with a request's cache: a prefill instance that
speculates with the bundled demo's draft sends the draft's pages of the prompt and the drafts
it proposed after the first token; the decode instance's first step verifies them, and its
draft attends to the prompt. Greedy output equals the colocated engine's, and so do the
drafts proposed and accepted (counted tokens, all at once and one at a time). A prefill
instance without the draft sends neither: the output is the same, the acceptance is not."""

from __future__ import annotations

import pytest

from kdaserve import LLM, SamplingParams
from kdaserve.assets import kimi_linear_demo_path
from kdaserve.disagg.local import run_colocated, run_disaggregated

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SPEC = {"speculative_method": "dspark", "speculative_adaptive": False,
        "num_speculative_tokens": 3}
TEXTS = ("ROMEO:\n", "HAMLET:\nTo be, or not", "KING HENRY:\nOnce more unto the breach")


def tokens(traces) -> list[list[int]]:
    assert all(t.error is None for t in traces), [t.error for t in traces]
    return [t.tokens for t in traces]


def counted(llm: LLM, run) -> tuple[list[list[int]], int, int]:
    """What `run` produced, and the drafts `llm` verified and accepted meanwhile."""
    s = llm.engine.scheduler
    drafts, accepted = s.num_draft_tokens, s.num_accepted_tokens
    out = tokens(run())
    return out, s.num_draft_tokens - drafts, s.num_accepted_tokens - accepted


@pytest.fixture(scope="module")
def demo():
    path = kimi_linear_demo_path()
    if not (path / "draft" / "config.json").is_file():
        pytest.skip("the bundled demo has no draft")
    model = str(path)
    ref = LLM(model, num_threads=1, block_size=8, **SPEC)
    ps = [ref.tokenizer.encode(t) for t in TEXTS]
    dec = LLM(model, num_threads=1, block_size=8, role="decode", kv_transfer_port=0, **SPEC)
    pres = {}
    for name, spec in (("draft", SPEC), ("none", {})):
        pres[name] = LLM(model, num_threads=1, block_size=4, role="prefill", **spec)
    yield ref, pres, dec, ps
    for e in (*pres.values(), dec):
        e.engine.transfer.connector.close()


def test_draft_pages_travel_and_acceptance_equals_colocated(demo):
    ref, pres, dec, ps = demo
    want = counted(ref, lambda: run_colocated(ref.engine, ps, GREEDY))
    assert want[2] > 0
    pre = pres["draft"]
    assert counted(dec, lambda: run_disaggregated(pre.engine, dec.engine, ps, GREEDY)) == want
    one = [counted(ref, lambda p=p: run_colocated(ref.engine, [p], GREEDY)) for p in ps]
    assert [counted(dec, lambda p=p: run_disaggregated(pre.engine, dec.engine, [p], GREEDY))
            for p in ps] == one
    sent = pre.engine.transfer.connector.stats
    assert sent.sent == 2 * len(ps) and dec.engine.transfer.connector.stats.pending == 0
    assert sent.sent_draft_bytes > 0
    assert pre.engine.cache.all_free() and dec.engine.cache.all_free()


def test_without_the_draft_pages_the_output_stands_and_acceptance_differs(demo):
    ref, pres, dec, ps = demo
    want = counted(ref, lambda: run_colocated(ref.engine, ps, GREEDY))
    got = counted(dec, lambda: run_disaggregated(pres["none"].engine, dec.engine, ps, GREEDY))
    assert got[0] == want[0] and got[1:] != want[1:]


def test_second_turn_hit_sends_only_the_rest_of_the_draft_pages(demo):
    """A chat's second turn that hits the decode instance's prefix cache (the hit query): the
    draft's pages of the held tokens stay there with the target's latents, the rest travel,
    and the drafts and acceptance still equal the colocated engine's."""
    ref, pres, dec, ps = demo
    pre = pres["draft"]
    [answer] = tokens(run_disaggregated(pre.engine, dec.engine, [ps[2]], GREEDY))
    second = ps[2] + answer + ps[1]
    want = counted(ref, lambda: run_colocated(ref.engine, [second], GREEDY))
    assert want[2] > 0
    sent = pre.engine.transfer.connector.stats
    moved = {}
    for hit_query in (True, False):
        hits, draft = dec.engine.cache.stats.hit_tokens, sent.sent_draft_bytes
        assert counted(dec, lambda h=hit_query: run_disaggregated(
            pre.engine, dec.engine, [second], GREEDY, hit_query=h)) == want
        moved[hit_query] = (dec.engine.cache.stats.hit_tokens - hits,
                            sent.sent_draft_bytes - draft)
    (held, with_hits), (_, whole) = moved[True], moved[False]
    n = len(second)
    assert held > 0 and with_hits * n == whole * (n - held)
    assert pre.engine.cache.all_free() and dec.engine.cache.all_free()
