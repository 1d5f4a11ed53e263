"""Prompt logprobs (echo with logprobs): the engine's, through chunked prefill and batched with
other requests, equal a full forward's log-softmax at each prompt position; requests that do not
ask get no prompt logits."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_model, tiny_config

from kdaserve import LLM, SamplingParams
from kdaserve.model.loader import save_model

PROMPT = torch.randint(3, 60, (45,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompt_lp")
    save_model(random_model(tiny_config(), seed=2), path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    model = random_model(tiny_config(), seed=2)
    with torch.inference_mode():
        return model.forward_dense(torch.tensor([PROMPT]))[0].float().log_softmax(-1)


@pytest.mark.parametrize("chunk", [2048, 16])
def test_prompt_logprobs_match_a_full_forward(model_dir, reference, chunk):
    llm = LLM(str(model_dir), max_num_batched_tokens=chunk)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    asks = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    # beside a request that does not ask, so the step's batch mixes both
    plain, echoed = llm.generate([{"prompt_token_ids": PROMPT[:30]},
                                  {"prompt_token_ids": PROMPT}], [greedy, asks], use_tqdm=False)
    assert plain.prompt_logprobs is None
    lps = echoed.prompt_logprobs
    assert len(lps) == len(PROMPT) and lps[0] is None
    for i in range(1, len(PROMPT)):
        want = reference[i - 1]
        assert lps[i][PROMPT[i]] == pytest.approx(want[PROMPT[i]].item(), abs=1e-4)
        top = want.topk(3)
        assert set(top.indices.tolist()) <= set(lps[i])
        assert len(lps[i]) <= 4
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert lps[i][t] == pytest.approx(v, abs=1e-4)
    # the completion is what it is without prompt logprobs
    alone = llm.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False)[0]
    assert echoed.outputs[0].token_ids == alone.outputs[0].token_ids


def test_only_requests_that_ask_get_prompt_logits(model_dir):
    llm = LLM(str(model_dir), max_num_batched_tokens=16)
    rows: list[int] = []
    forward = llm.engine.runner.model.forward

    def spy(ids, fb, **kw):
        rows.append(len(fb.logits_indices))
        return forward(ids, fb, **kw)

    llm.engine.runner.model.forward = spy
    llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert max(rows) == 1                       # logits only where sampled
    rows.clear()
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert sum(rows) == len(PROMPT) - 1 + 1    # every prompt position once, and the sample
    assert max(rows) <= 16                      # a chunk at a time
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])


def test_prompt_logprobs_skip_prefix_hits_and_a_one_token_prompt(model_dir, reference):
    llm = LLM(str(model_dir))
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False)     # cached now
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs[-1][PROMPT[-1]] == pytest.approx(
        reference[-2][PROMPT[-1]].item(), abs=1e-4)
    one = llm.generate({"prompt_token_ids": PROMPT[:1]},
                       SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]
