"""The engine loop under bad luck and heavy users: a failure in a step ends only the request that
causes it; one request with many sequences cannot hold every slot; extreme parameter values are
refused (or made harmless) before they reach a tensor."""

from __future__ import annotations

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.engine import sampler as sampler_mod
from kdaserve.request import SamplingParamsError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
POISON_TOP_K = 4093        # the injected fault fires for requests with this top_k


def _prompts(vocab: int, n: int = 4):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (int(length),), generator=g).tolist()
            for length in torch.randint(3, 30, (n,), generator=g)]


@pytest.fixture
def poisoned_sampler(monkeypatch):
    real = sampler_mod.sample

    def sample(logits, rows):
        if any(r.params.top_k == POISON_TOP_K for r in rows):
            raise RuntimeError("injected fault")
        return real(logits, rows)

    monkeypatch.setattr("kdaserve.engine.row_sampling.sample", sample)


def test_failure_is_isolated_to_its_request(hf_checkpoint, poisoned_sampler):
    path, hf = hf_checkpoint
    prompts = _prompts(hf.config.vocab_size)
    clean = LLM(str(path))
    want = [o.outputs[0].token_ids for o in clean.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    llm = LLM(str(path))
    poison = SamplingParams(temperature=0.5, top_k=POISON_TOP_K, max_tokens=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids": [5]}],
                        [GREEDY] * len(prompts) + [poison], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:-1]] == want
    bad = outs[-1].outputs[0]
    assert bad.finish_reason == "error" and "injected fault" in bad.stop_reason
    assert llm.engine.stats.failed == 1 and llm.engine.cache.all_free()
    # and the engine serves normally afterwards
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want


def test_heavy_request_does_not_hold_every_slot(hf_checkpoint):
    """n=64 fills all 8 slots; a short request arriving later still gets a slot within a few
    steps (fair-share preemption), long before the heavy one finishes."""
    path, _ = hf_checkpoint
    llm = LLM(str(path), max_num_seqs=8)
    core = llm.engine
    core.add_request("heavy", [5, 6, 7], SamplingParams(n=64, max_tokens=40, ignore_eos=True,
                                                         temperature=0.0))
    for _ in range(3):
        core.step()
    assert core.num_running == 8
    core.add_request("short", [9, 10], SamplingParams(max_tokens=2, ignore_eos=True,
                                                      temperature=0.0))
    steps, done = 0, False
    while not done:
        steps += 1
        done = any(d.request_id == "short" and d.finished for d in core.step())
    assert steps <= 4
    assert core.scheduler.num_fair_preemptions >= 1
    while core.has_unfinished():
        core.step()
    assert core.cache.all_free()


def test_fairness_keeps_greedy_output(hf_checkpoint):
    """Fair-share preemptions recompute; a greedy request's tokens do not change."""
    path, hf = hf_checkpoint
    prompts = _prompts(hf.config.vocab_size, 3)
    want = [o.outputs[0].token_ids for o in LLM(str(path)).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    llm = LLM(str(path), max_num_seqs=4)
    heavy = SamplingParams(n=12, temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompts[0]}] + [
        {"prompt_token_ids": p} for p in prompts], [heavy] + [GREEDY] * 3, use_tqdm=False)
    assert all(c.token_ids == want[0] for c in outs[0].outputs)
    assert [o.outputs[0].token_ids for o in outs[1:]] == want


@pytest.mark.parametrize("field,value", [
    ("top_k", 9223372036854775808), ("top_k", 2**31), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("min_tokens", 2**40), ("max_tokens", 2**63), ("n", 129), ("n", 0),
    ("stop_token_ids", [2**64]), ("stop", ["x"] * 65), ("stop", ["y" * 5000]),
    ("temperature", float("nan")), ("logprobs", 21), ("stop_token_ids", [1] * 1025),
])
def test_extreme_values_are_refused(field, value):
    with pytest.raises(SamplingParamsError):
        SamplingParams(**{field: value})


def test_extreme_but_valid_values_run(hf_checkpoint):
    path, _ = hf_checkpoint
    llm = LLM(str(path))
    sps = [SamplingParams(n=2, seed=2**64 - 1, max_tokens=3, temperature=0.8),
           SamplingParams(top_k=2**31 - 1, max_tokens=3, temperature=0.8, seed=-(2**63)),
           SamplingParams(temperature=1e-45, max_tokens=3, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": [3, 4, 5]}] * 3, sps, use_tqdm=False)
    assert all(len(c.token_ids) >= 1 for o in outs for c in o.outputs)
    assert sps[2].temperature == 0.0          # a vanishing temperature samples greedily
    greedy = llm.generate([{"prompt_token_ids": [3, 4, 5]}],
                          SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == greedy
