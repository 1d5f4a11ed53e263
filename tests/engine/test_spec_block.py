"""Block verification in the engine (--speculative-config rejection_sample_method "block"):
greedy output equals plain decoding on both demos at batch 1 and a batch, with point-mass
(n-gram) and sampled (DSpark) drafts; sampled decoding runs and accepts drafts."""

from __future__ import annotations

import json

import pytest

from kdaserve import LLM, SamplingParams
from kdaserve.assets import default_model_path, kimi_linear_demo_path


def _prompts(llm: LLM, n: int) -> list[list[int]]:
    texts = ["ROMEO:\n", "HAMLET:\nTo be", "First Citizen:\nWe are", "KING:\n"]
    return [llm.tokenizer.encode(texts[i % 4]) + [5 + i] for i in range(n)]


def _tokens(llm: LLM, prompts, sp) -> list[list[int]]:
    return [list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                  use_tqdm=False)]


@pytest.mark.parametrize("model", [kimi_linear_demo_path, default_model_path],
                         ids=["kimi_linear_demo", "k3_demo"])
def test_greedy_with_block_verification_equals_plain(model):
    base = LLM(str(model()), max_num_seqs=8, num_threads=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for method, k in (("dspark", 5), ("ngram", 3)):
        spec = json.dumps({"method": method, "num_speculative_tokens": k,
                           "rejection_sample_method": "block"})
        llm = LLM(str(model()), max_num_seqs=8, num_threads=1, speculative_config=spec,
                  speculative_adaptive=False)
        assert llm.engine.runner.sampler.block_verification
        for n in (1, 6):
            prompts = _prompts(base, n)
            assert _tokens(llm, prompts, greedy) == _tokens(base, prompts, greedy)


def test_sampled_block_verification_accepts_drafts():
    spec = json.dumps({"method": "dspark", "num_speculative_tokens": 5,
                       "rejection_sample_method": "block"})
    llm = LLM(str(kimi_linear_demo_path()), max_num_seqs=4, num_threads=1,
              speculative_config=spec, speculative_adaptive=False)
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=32, ignore_eos=True)
    out = _tokens(llm, _prompts(llm, 4), sp)
    assert all(len(t) == 32 for t in out)
    s = llm.engine.scheduler
    assert s.num_accepted_tokens > 0 and s.num_draft_tokens > 0


@pytest.mark.parametrize("model", [kimi_linear_demo_path, default_model_path],
                         ids=["kimi_linear_demo", "k3_demo"])
def test_greedy_at_batch_32_with_a_sleeping_and_waking_drafter_equals_plain(model):
    """Adaptive speculation on, made to sleep and wake within the run (a short sleep and wait;
    half the requests admitted while the first half decodes): requests draft from whatever
    context the drafter holds, and greedy output is still plain decoding's."""
    base = LLM(str(model()), max_num_seqs=32, num_threads=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = _prompts(base, 32)
    want = _tokens(base, prompts, greedy)
    llm = LLM(str(model()), max_num_seqs=32, num_threads=1, speculative_method="dspark",
              num_speculative_tokens=4)
    engine, policy = llm.engine, llm.engine.scheduler.spec_policy
    policy.sleep_after, policy.wake_after, policy.sleep_trials = 2, 1, 0
    for shared in policy.shared.values():                   # asleep early: nothing earns
        shared.prior = 0.05
    outs: dict[str, list[int]] = {}

    def step() -> None:
        for d in engine.step():
            outs.setdefault(d.request_id, []).extend(d.new_token_ids)

    for i in range(16):
        engine.add_request(str(i), prompts[i], greedy)
    while not policy.dormant and engine.has_unfinished():
        step()
    assert policy.dormant
    step()                                      # a step asleep: the first half misses it
    for i in range(16, 32):
        engine.add_request(str(i), prompts[i], greedy)
    step()
    assert policy.sleeps >= 1 and not policy.dormant       # an admission woke it
    policy.alpha.update({str(i): 0.99 for i in range(16)})  # they draft again, as if earning
    while engine.has_unfinished():
        step()
    assert [outs[str(i)] for i in range(32)] == want
    assert engine.cache.all_free()


@pytest.mark.parametrize("rule", ["token", "block"])
def test_seeded_sampled_speculation_is_the_same_alone_and_in_a_batch(rule):
    """Each request draws from its own seeded stream, drafts included, and a row's sums do
    not depend on its batch: a request sampled alone and the same request in a batch of four
    give the same tokens and verify the same blocks (bench spec's per-request counts rest on
    this)."""
    spec = json.dumps({"method": "dspark", "num_speculative_tokens": 5,
                       "draft_sample_method": "probabilistic",
                       "rejection_sample_method": rule})
    llm = LLM(str(kimi_linear_demo_path()), max_num_seqs=4, num_threads=1,
              speculative_config=spec, speculative_adaptive=False)
    prompts = [{"prompt_token_ids": p} for p in _prompts(llm, 4)]
    sps = [SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i, max_tokens=24,
                          ignore_eos=True) for i in range(4)]

    def seen(outs):
        return [(list(o.outputs[0].token_ids), o.outputs[0].spec_verifications,
                 o.outputs[0].acceptance_length) for o in outs]

    alone = [seen(llm.generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(prompts, sps)]
    together = seen(llm.generate(prompts, sps, use_tqdm=False))
    assert together == alone
    assert sum(v for _, v, _ in alone) > 0
