"""Greedy outputs are token-identical across batching, chunked prefill, preemption, and match
transformers' greedy generate on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from kdaserve import LLM, SamplingParams

MAX_NEW = 10


@pytest.fixture(scope="module")
def prompts(hf_checkpoint):
    _, hf = hf_checkpoint
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(1, 60, (32,), generator=g).tolist()
    return [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def hf_greedy(hf_checkpoint, prompts):
    _, hf = hf_checkpoint
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            outs.append(ids[0, len(p):].tolist())
    return outs


def run(llm: LLM, prompts, one_at_a_time=False):
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    if one_at_a_time:
        outs = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert llm.engine.cache.all_free(), "pages or slots leaked"
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(hf_checkpoint, prompts):
    path, _ = hf_checkpoint
    return run(LLM(str(path)), prompts)


def test_batched_matches_transformers(reference, hf_greedy):
    assert reference == hf_greedy


def test_one_at_a_time(hf_checkpoint, prompts, reference):
    path, _ = hf_checkpoint
    assert run(LLM(str(path)), prompts, one_at_a_time=True) == reference


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill(hf_checkpoint, prompts, reference, chunk):
    path, _ = hf_checkpoint
    llm = LLM(str(path), long_prefill_token_threshold=chunk, max_num_batched_tokens=max(chunk, 40))
    assert run(llm, prompts) == reference


def test_tiny_pool_preempts(hf_checkpoint, prompts, reference):
    path, _ = hf_checkpoint
    llm = LLM(str(path), num_blocks=12, block_size=8, max_num_batched_tokens=64)
    assert run(llm, prompts) == reference
    assert llm.engine.scheduler.num_preemptions > 0


def test_request_metrics_mark_the_first_and_last_token(hf_checkpoint, prompts):
    """RequestOutput.metrics: added, first token (the prefill's end), last token, finished, in
    that order; one token: the first is the last (bench compare's decode time is the gap)."""
    path, _ = hf_checkpoint
    llm = LLM(str(path), long_prefill_token_threshold=7, max_num_batched_tokens=40)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]],
                        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                         for n in (MAX_NEW, 1, 2)], use_tqdm=False)
    for o, n in zip(outs, (MAX_NEW, 1, 2)):
        m = o.metrics
        assert len(o.outputs[0].token_ids) == n
        assert m.arrival_time < m.first_token_time <= m.last_token_time <= m.finished_time
        assert (m.first_token_time == m.last_token_time) == (n == 1)
