"""N-gram (prompt lookup) speculation: the proposer's exact drafts, and the engine's invariant.

- `NgramProposer.propose`: the tokens that followed the latest earlier occurrence of the longest
  matching tail (ngram_max down to ngram_min), at most k of them, none when nothing matches, and
  only within the lookup window; `NgramDrafts` looks up prompt + output + the new tokens.
- End to end on the bundled demo model (its text repeats, so drafts are proposed and accepted):
  greedy output with `speculative_method="ngram"` is token-identical to the engine without
  speculation, for batches mixing text prompts with random token ids, with chunked prefill under
  a small token budget, with prefix-cache hits and with preemption; every block and slot is free
  afterwards. With penalties the logprobs match too, and a stop token inside an accepted run ends
  the request there. In a batch where greedy and seeded sampled requests run at once, the greedy
  ones still match, and the sampled ones are reproducible from their seeds.
"""
from __future__ import annotations

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.assets import kimi_linear_demo_path
from kdaserve.engine.spec.ngram import NgramProposer
from kdaserve.engine.spec.proposer import NgramDrafts, ProposalInput
from kdaserve.request import Request

# ---- the proposer ----------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,k,want", [
    ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),                 # the 2-gram [1, 2] seen at 0
    ([1, 2, 5, 1, 2, 6, 1, 2], 3, [6, 1, 2]),           # the latest occurrence wins
    ([7, 1, 2, 9, 8, 1, 2, 5, 7, 1, 2], 3, [9, 8, 1]),  # a longer match beats a later shorter
    ([1, 2, 3, 1, 2], 5, [3, 1, 2]),                    # fewer than k tokens follow the match
    ([1, 2, 3, 4, 5], 3, []),                           # no earlier occurrence
    ([4, 1, 2, 3, 4], 3, []),                           # only a 1-gram repeats (below min)
    ([3, 3, 3, 3], 2, [3]),                             # overlapping match right before the tail
    ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8], 4, [5, 6, 7, 8]),  # a 4-gram (max) match
    ([9], 3, []),
    ([], 3, []),
])
def test_propose_exact(tokens, k, want):
    assert NgramProposer(k, ngram_min=2, ngram_max=4).propose(tokens) == want


def test_propose_ngram_bounds():
    toks = [4, 5, 6, 5]
    assert NgramProposer(2, ngram_min=2, ngram_max=4).propose(toks) == []
    assert NgramProposer(2, ngram_min=1, ngram_max=4).propose(toks) == [6, 5]   # [5] seen at 1
    # a 5-gram match exists but ngram_max=2 looks only at the last 2 tokens: its latest match
    toks = [1, 2, 3, 4, 5, 9, 4, 5, 8, 1, 2, 3, 4, 5]
    assert NgramProposer(3, ngram_min=2, ngram_max=2).propose(toks) == [8, 1, 2]
    assert NgramProposer(3, ngram_min=2, ngram_max=5).propose(toks) == [9, 4, 5]


def test_propose_window():
    toks = [1, 2, 9, 9, 9, 9, 1, 2]
    assert NgramProposer(3).propose(toks) == [9, 9, 9]
    assert NgramProposer(3, window=5).propose(toks) == []           # the match fell out
    assert NgramProposer(3, window=8).propose(toks) == [9, 9, 9]


def test_ngram_drafts_look_at_prompt_output_and_new_tokens():
    greedy = SamplingParams(temperature=0.0)
    a = Request("a", [1, 2, 3, 1], greedy, output_token_ids=[])
    b = Request("b", [7, 8], greedy, output_token_ids=[9, 7])
    c = Request("c", [5, 6, 7], greedy)
    drafts = NgramDrafts(3, 2, 4)
    assert drafts.capture_layers == ()
    inp = ProposalInput(seqs=[], num_valid=[], new_tokens={"a": [2], "b": [8], "c": [8]},
                        requests={"a": a, "b": b, "c": c}, positions=torch.zeros(0),
                        cache_slots=torch.zeros(0), hidden=None, sampling={})
    out = drafts.propose(inp)
    assert set(out) == {"a", "b"}                                 # no match for c: no entry
    assert out["a"].tokens == [3, 1, 2] and out["a"].probs is None
    assert out["b"].tokens == [9, 7, 8]


# ---- end to end ------------------------------------------------------------------------------
# The bundled demo model (trained on plays): its greedy text repeats names and phrases, so n-gram
# drafts are proposed and many accepted (a random model's output rarely repeats a bigram).

TEXTS = [
    "ROMEO:\n",
    "HAMLET:\nTo be, or not to be",
    "the the the the the",
    ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
     "First Citizen:\n"),
    "KING RICHARD III:\nNow is the winter of our discontent\n",
]


@pytest.fixture(scope="module")
def demo():
    path = kimi_linear_demo_path()
    if not (path / "model.safetensors").is_file():
        pytest.skip("the bundled demo model is missing")
    return str(path)


@pytest.fixture(scope="module")
def prompts(demo):
    """Text prompts (repetitive output: n-gram hits) interleaved with random token ids."""
    tok = LLM(demo).tokenizer
    g = torch.Generator().manual_seed(4)
    out = []
    for text in TEXTS:
        out.append(tok.encode(text))
        n = int(torch.randint(1, 30, (1,), generator=g))
        out.append(torch.randint(3, 4000, (n,), generator=g).tolist())
    return out


def _generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.cache.all_free()
    return [o.outputs[0].token_ids for o in outs]


def _greedy(n=32):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(demo, prompts):
    return _generate(LLM(demo), prompts, _greedy())


def _assert_speculated(llm):
    s = llm.engine.scheduler
    assert s.num_draft_tokens > 0
    assert 0 < s.num_accepted_tokens <= s.num_draft_tokens


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_identical(demo, prompts, reference, k):
    llm = LLM(demo, speculative_method="ngram",
              speculative_adaptive=False, num_speculative_tokens=k)
    assert _generate(llm, prompts, _greedy()) == reference
    _assert_speculated(llm)


def test_greedy_identical_chunked_small_budget(demo, prompts, reference):
    llm = LLM(demo, speculative_method="ngram",
              speculative_adaptive=False, num_speculative_tokens=4,
              max_num_batched_tokens=12, long_prefill_token_threshold=5, block_size=4)
    assert _generate(llm, prompts, _greedy()) == reference
    _assert_speculated(llm)
    # again: now with prefix-cache hits on every prompt
    assert _generate(llm, prompts, _greedy()) == reference


def test_greedy_identical_shared_prefixes_preempted(demo, prompts):
    shared = [prompts[6] + p for p in prompts]
    ref = _generate(LLM(demo), shared, _greedy(24))
    llm = LLM(demo, speculative_method="ngram",
              speculative_adaptive=False, num_speculative_tokens=4, num_blocks=14,
              block_size=8, long_prefill_token_threshold=7, max_num_batched_tokens=32)
    assert _generate(llm, shared, _greedy(24)) == ref
    _assert_speculated(llm)
    assert llm.engine.scheduler.num_preemptions > 0


def test_mixed_greedy_and_sampled(demo, prompts, reference):
    params = [_greedy() if i % 3 != 1 else
              SamplingParams(temperature=0.8, top_k=20, max_tokens=32, seed=100 + i,
                             ignore_eos=True)
              for i in range(len(prompts))]
    llm = LLM(demo, speculative_method="ngram",
              speculative_adaptive=False, num_speculative_tokens=3,
              max_num_batched_tokens=24)
    a = _generate(llm, prompts, params)
    _assert_speculated(llm)
    for i, (got, want) in enumerate(zip(a, reference)):
        assert len(got) == 32
        if params[i].temperature == 0:
            assert got == want, f"greedy request {i}"
    # seeded requests are reproducible (their generator is their own, whatever the batch)
    b = _generate(llm, prompts[1::3], params[1::3])
    assert b == a[1::3]


def test_greedy_identical_with_penalties_logprobs_and_stops(demo, prompts, reference):
    """Penalties at a verified position count the drafts before it; logprobs of accepted drafts
    are the target's; a stop token inside an accepted run ends the request right there."""
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2,
                        repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2)
    base = LLM(demo).generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    llm = LLM(demo, speculative_method="ngram",
              speculative_adaptive=False, num_speculative_tokens=4)
    spec = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert llm.engine.cache.all_free()
    assert llm.engine.scheduler.num_draft_tokens > 0
    for b, s in zip(base, spec):
        assert s.outputs[0].token_ids == b.outputs[0].token_ids
        for lb, ls in zip(b.outputs[0].logprobs, s.outputs[0].logprobs, strict=True):
            assert lb.keys() == ls.keys()
            assert all(abs(lb[t] - ls[t]) < 1e-4 for t in lb)
    # stops: the 12th token of each reference output (its first occurrence ends the request)
    llm = LLM(demo, speculative_method="ngram",
              speculative_adaptive=False, num_speculative_tokens=4)
    stops = [SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[r[11]],
                            ignore_eos=True) for r in reference]
    got = _generate(llm, prompts, stops)
    assert llm.engine.scheduler.num_accepted_tokens > 0
    assert got == [r[:r.index(r[11]) + 1] for r in reference]
