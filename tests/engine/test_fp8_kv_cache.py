"""`--kv-cache-dtype fp8`: the MLA latents cached as e4m3 with a scale per token. The cache
holds about a quarter of fp32's bytes a token; what the model computes over it stays within
e4m3's rounding of the full-precision forward; cached prefixes are reused as they are."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_model, tiny_config

from kdaserve import LLM, SamplingParams
from kdaserve.cache.spec import specs_for
from kdaserve.model.loader import save_model

PROMPT = torch.randint(3, 60, (45,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8_kv")
    save_model(random_model(tiny_config(), seed=3), path)
    return path


@pytest.fixture(scope="module")
def reference():
    model = random_model(tiny_config(), seed=3)
    with torch.inference_mode():
        return model.forward_dense(torch.tensor([PROMPT]))[0].float().log_softmax(-1)


def test_the_plan_counts_fp8_bytes():
    cfg = tiny_config()
    full, _ = specs_for(cfg, 16, "float32")
    fp8, _ = specs_for(cfg, 16, "float32", "fp8")
    assert fp8.fp8 and fp8.bytes_per_token == len(cfg.mla_layers) * (cfg.mla_latent_dim + 4)
    assert fp8.bytes_per_token < full.bytes_per_token / 2


def test_chunked_prefill_over_fp8_pages_stays_close(model_dir, reference):
    # 16-token chunks: every chunk after the first attends to the context through the pages
    llm = LLM(str(model_dir), kv_cache_dtype="fp8", max_num_batched_tokens=16)
    assert llm.engine.plan.kv_cache_dtype == "fp8"
    pages = llm.engine.executor.runner.cache.mla_pages
    assert pages and all(p.dtype == torch.uint8 for p in pages)
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                      prompt_logprobs=0), use_tqdm=False)[0]
    got = torch.tensor([out.prompt_logprobs[i][PROMPT[i]] for i in range(1, len(PROMPT))])
    want = reference[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    err = (got - want).abs()
    # fp8's rounding shows (the fp32 cache agrees to ~1e-5 here) and stays small: on this
    # random model's log-probs (-8.7 .. -2.7) ~0.016 on average, 0.13 at most
    assert 0 < err.mean().item() < 0.03 and err.max().item() < 0.25, err


def test_a_cached_prefix_is_reused_as_it_is(model_dir):
    llm = LLM(str(model_dir), kv_cache_dtype="fp8", enable_prefix_caching=True)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0]
    again = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
