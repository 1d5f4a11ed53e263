"""Long context through the engine: a 64k-token prompt prefilled in chunks equals one unchunked
forward, prefill memory grows only by the MLA latents, a long prompt does not starve short
requests, and the planner says what a budget holds at max_model_len 1M."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tiny_models import random_model, tiny_config

from kdaserve import LLM, SamplingParams
from kdaserve.cache import planner
from kdaserve.cache.planner import fraction_budget, plan_cache
from kdaserve.cache.spec import specs_for
from kdaserve.config import CacheConfig, ConfigError
from kdaserve.engine.device_memory import cache_budget
from kdaserve.model.loader import save_model
from kdaserve.model_config import ModelConfig

LONG, SHORT, CHUNK, NEW = 65536, 16384, 4096, 6
MAX_MODEL_LEN = 1 << 20

# Runs in a fresh process, so ru_maxrss is this prefill's peak alone.
_CHILD = """
import json, resource, sys, torch
torch.set_num_threads(2)
from kdaserve import LLM, SamplingParams
from kdaserve.model_config import ModelConfig
path, n, chunk, new, max_len = sys.argv[1], *map(int, sys.argv[2:])
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
llm = LLM(path, max_model_len=max_len, max_num_batched_tokens=chunk, cache_memory=64 << 20)
prompt = torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(1)).tolist()
before = rss()
out = llm.generate([{"prompt_token_ids": prompt}],
                   SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=20),
                   use_tqdm=False)[0].outputs[0]
print(json.dumps({"prompt": prompt, "tokens": out.token_ids,
                  "logprobs": [{str(k): v for k, v in d.items()} for d in out.logprobs],
                  "before": before,
                  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "steps": llm.engine.stats.steps}))
"""


def tiny_long_config() -> ModelConfig:
    """One MLA head: the quadratic attention of a 64k prefill stays a few seconds on CPU."""
    return tiny_config(num_attention_heads=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("long_ctx")
    save_model(random_model(tiny_long_config(), seed=3), path)
    return path


def _run(path, n: int, new: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(n), str(CHUNK), str(new),
                          str(MAX_MODEL_LEN)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def long_run(model_dir):
    return _run(model_dir, LONG, NEW)


def test_64k_chunked_prefill_matches_one_unchunked_forward(long_run):
    assert long_run["steps"] >= LONG // CHUNK, "the prompt was not prefilled in chunks"
    ids = torch.tensor(long_run["prompt"] + long_run["tokens"])
    with torch.no_grad():
        logits = random_model(tiny_long_config(), seed=3).forward_dense(ids[None])[0]
    want = logits[LONG - 1: LONG - 1 + NEW].log_softmax(-1)                  # [NEW, vocab]
    # greedy continuation: each engine token is the reference's argmax after its prefix
    assert want.argmax(-1).tolist() == long_run["tokens"]
    # logits (as log-probs, top 20 of each step) within rounding of the blockwise softmax
    for step, top in enumerate(long_run["logprobs"]):
        for token, lp in top.items():
            assert abs(want[step, int(token)].item() - lp) < 1e-3, (step, token)


def test_prefill_peak_memory_grows_only_by_the_latents(model_dir, long_run):
    short = _run(model_dir, SHORT, 1)
    growth = {n: r["peak"] - r["before"] for n, r in ((SHORT, short), (LONG, long_run))}
    latent, _ = specs_for(tiny_long_config(), 16, "float32")
    latents = (LONG - SHORT) * latent.bytes_per_token
    # a dense [chunk, context] mask alone would be CHUNK * LONG bytes (256 MiB) more
    assert growth[LONG] - growth[SHORT] < latents + (24 << 20), growth


def test_long_prompt_does_not_starve_short_requests(model_dir):
    llm = LLM(str(model_dir), max_num_batched_tokens=256, long_prefill_token_threshold=192,
              max_model_len=MAX_MODEL_LEN)
    eng = llm.engine
    per_step: list[dict[str, int]] = []
    execute = eng.runner.execute

    def spy(out):
        per_step.append({s.request_id: len(s.token_ids) for s in out.sequences})
        return execute(out)

    eng.runner.execute = spy
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    eng.add_request("short-a", [5, 6, 7], greedy)        # decoding before the long one comes
    eng.step()
    eng.add_request("long", list(range(3, 63)) * 40, SamplingParams(max_tokens=1))
    eng.add_request("short-b", [8, 9], greedy)           # arrives while the long one prefills
    while eng.has_unfinished():
        eng.step()
    prefill = [s for s in per_step if s.get("long", 0) > 1]
    assert len(prefill) >= 2400 // 192
    # every step that carried a chunk of the long prompt also carried one decode token of each
    # short request still running (short-b's first step is its own prompt)
    assert all(s["short-a"] == 1 for s in prefill)
    assert all(s["short-b"] == 1 for s in prefill[1:])


def test_default_budget_admits_a_short_request_during_a_long_prefill(model_dir):
    llm = LLM(str(model_dir), max_num_batched_tokens=256, max_model_len=MAX_MODEL_LEN)
    eng = llm.engine
    eng.add_request("long", list(range(3, 63)) * 40, SamplingParams(max_tokens=1))
    eng.step()
    eng.add_request("short", [8, 9], SamplingParams(temperature=0.0, max_tokens=4))
    eng.step()
    assert eng.scheduler.requests["long"].num_computed_tokens < 2400
    assert "short" in {r.request_id for r in eng.scheduler.running}


def test_default_budget_keeps_decodes_running_between_long_prefill_chunks(model_dir):
    """No long_prefill_token_threshold: decodes go before partial prefills, and a partial
    prefill leaves room to admit a request that arrives meanwhile. (The decode guard is off:
    its chunks follow measured step costs; tests/engine/test_decode_guard.py has them.)"""
    llm = LLM(str(model_dir), max_num_batched_tokens=256, max_model_len=MAX_MODEL_LEN,
              max_decode_slowdown=0)
    eng = llm.engine
    per_step: list[dict[str, int]] = []
    execute = eng.runner.execute

    def spy(out):
        per_step.append({s.request_id: len(s.token_ids) for s in out.sequences})
        return execute(out)

    eng.runner.execute = spy
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    got: dict[str, list[int]] = {"short-a": [], "short-b": []}

    def step():
        for d in eng.step():
            got.setdefault(d.request_id, []).extend(d.new_token_ids)

    eng.add_request("short-a", [5, 6, 7], greedy)
    step()
    eng.add_request("long", list(range(3, 63)) * 40, SamplingParams(max_tokens=1))
    step()                           # the long prompt is admitted: its first chunk
    eng.add_request("short-b", [8, 9], greedy)
    while eng.has_unfinished():
        step()
    prefill = [s for s in per_step if s.get("long", 0) > 1]
    assert sum(s["long"] for s in prefill) == 2400
    assert len(prefill) == -(-(2400 - 255 - 253) // 254) + 2     # chunks: 255, 253, 254...
    assert all(s["short-a"] == 1 for s in prefill)
    assert prefill[1]["short-b"] == 2                 # admitted at the chunk after its arrival
    assert all(s["short-b"] == 1 for s in prefill[2:])
    assert all(sum(s.values()) <= 256 for s in per_step)
    alone = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}],
                         greedy, use_tqdm=False)
    assert [got["short-a"], got["short-b"]] == [o.outputs[0].token_ids for o in alone]


def test_planner_says_what_fits_at_1m_context():
    demo_like = tiny_config(num_hidden_layers=8, kv_lora_rank=64, qk_rope_head_dim=16,
                            linear_attn_config={"kda_layers": [1, 2, 3, 5, 6, 7],
                                                "full_attn_layers": [4, 8], "num_heads": 4,
                                                "head_dim": 64, "short_conv_kernel_size": 4})
    latent, state = specs_for(demo_like, 16, "float32")
    plan = plan_cache(latent, state, 8 << 30, 64, snapshot_bytes=2 << 30,
                      max_model_len=MAX_MODEL_LEN)
    fits = plan.requests_at(MAX_MODEL_LEN)
    assert fits >= 8 and plan.num_tokens >= fits * MAX_MODEL_LEN
    assert f"{fits} requests of max_model_len {MAX_MODEL_LEN} tokens fit" in plan.describe()
    small = plan_cache(latent, state, 256 << 20, 64, max_model_len=MAX_MODEL_LEN)
    assert small.requests_at(MAX_MODEL_LEN) == 0 and "does not fit" in small.describe()
    assert fraction_budget(80 << 30, 0.9, 20 << 30) == int((80 << 30) * 0.9) - (20 << 30)
    with pytest.raises(ValueError):
        fraction_budget(16 << 30, 0.5, 10 << 30)


def test_gpu_memory_utilization_sizes_the_cache_on_cuda_only():
    cc = CacheConfig(cache_memory_bytes=1 << 30, gpu_memory_utilization=0.9)
    info = lambda device: (60 << 30, 80 << 30)      # noqa: E731 - 20 GiB in use (weights)
    want = int((80 << 30) * 0.9) - (20 << 30) - (2 << 30)     # less an activation reserve
    assert cache_budget(cc, torch.device("cuda", 0), info) == want
    assert cache_budget(cc, torch.device("cpu"), info) == 1 << 30    # --cache-memory on CPU
    assert cache_budget(CacheConfig(cache_memory_bytes=1 << 30), torch.device("cuda"), info) \
        == 1 << 30
    with pytest.raises(ValueError, match="raise the fraction"):
        cache_budget(CacheConfig(gpu_memory_utilization=0.2), torch.device("cuda"), info)
    # the planner's own form takes the numbers (cache/ asks no device)
    assert planner.cache_budget(cc, (60 << 30, 80 << 30)) == want
    assert planner.cache_budget(cc, None) == 1 << 30
    with pytest.raises(ConfigError):
        CacheConfig(gpu_memory_utilization=1.5)


def test_engine_plans_at_the_clamped_max_model_len(model_dir):
    llm = LLM(str(model_dir), max_model_len=4 * MAX_MODEL_LEN, cache_memory=64 << 20)
    plan = llm.engine.plan
    assert plan.max_model_len == llm.engine.max_model_len == MAX_MODEL_LEN   # the model's limit
    assert f"max_model_len {plan.max_model_len} tokens" in plan.describe()
