"""Adaptive speculation: the cost model recovers a machine's step costs; a request whose drafts
are never accepted stops speculating (probes aside), one whose drafts always are keeps all of
them; with a useless draft the engine takes no more steps than without speculation, and greedy
output is unchanged. Decisions and step counts, never wall time."""

from __future__ import annotations

import random

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.engine.spec.adaptive import AdaptiveSpeculation, StepCostModel
from test_spec_dspark import _random_draft


def test_cost_model_recovers_coefficients():
    m = StepCostModel(warmup=0)
    rng = random.Random(0)
    for _ in range(200):
        t, r = rng.randint(1, 64), rng.randint(0, 8)
        m.observe(t, r, 0.008 + 5e-5 * t + 1e-3 * r)
    a, b, c = m.coefficients()
    assert a == pytest.approx(0.008, rel=0.05) and b == pytest.approx(5e-5, rel=0.05)
    assert c == pytest.approx(1e-3, rel=0.05)


def test_decisions_follow_acceptance():
    p = AdaptiveSpeculation(7, probe_every=16)
    for _ in range(30):
        p.record("bad", 7, 0)
        p.record("good", 7, 7)
    plans = [p.plan({"bad": 7, "good": 7}, 2) for _ in range(32)]
    assert all(pl["good"] == 7 for pl in plans)
    assert sum(pl["bad"] for pl in plans) == 2          # one probe every 16 steps


def test_bad_draft_turns_speculation_off(hf_checkpoint, tmp_path):
    path, hf = hf_checkpoint
    draft = _random_draft(path, tmp_path / "draft", block=6)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, hf.config.vocab_size, (12,), generator=g).tolist()
               for _ in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)

    def run(**kw):
        llm = LLM(str(path), **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine

    plain, plain_engine = run()
    fixed, fixed_engine = run(speculative_method="dspark", num_speculative_tokens=6,
                              speculative_model=str(draft), speculative_adaptive=False)
    adaptive, engine = run(speculative_method="dspark", num_speculative_tokens=6,
                           speculative_model=str(draft))
    assert fixed == plain and adaptive == plain
    policy = engine.scheduler.spec_policy
    assert engine.stats.steps <= plain_engine.stats.steps
    # a useless draft: nearly nothing accepted, so nearly nothing verified after the start
    assert engine.scheduler.num_accepted_tokens <= 2
    assert engine.scheduler.num_draft_tokens < fixed_engine.scheduler.num_draft_tokens / 3
    assert policy.steps_speculating < policy.steps / 2
