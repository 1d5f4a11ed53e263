"""bench spec's long-input rows: each prompt is prefilled once, before the timing, so that
both sides of every timed pair decode from its cached pages and state instead of prefilling
it again (bench/spec_long.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kdaserve.assets import default_model_path
from kdaserve.bench.spec_long import long_engines, long_row
from kdaserve.engine.llm import LLM


def test_the_timed_runs_recompute_only_the_prompts_tail():
    torch.set_num_threads(1)
    model = str(default_model_path())
    args = SimpleNamespace(input_lens=[300], max_tokens=4, k=3, num_prompts=2, long_repeats=2,
                           temperature=0.8, top_p=0.95)
    kw = {"speculative_method": "dspark", "num_speculative_tokens": 3,
          "speculative_adaptive": False}
    shared = LLM(model, enable_prefix_caching=False, **kw)
    spec = long_engines(model, shared, ["block"], args, kw)["block"]
    assert spec.engine.config.scheduler.max_model_len >= 300 + 4 + 4
    runner = spec.engine.runner
    timed: list[int] = []
    real = spec.generate

    def counted(prompts, params, use_tqdm=False):
        n0 = runner.num_forward_tokens
        out = real(prompts, params, use_tqdm=use_tqdm)
        timed.append(runner.num_forward_tokens - n0)
        return out

    spec.generate = counted
    row = long_row(spec, 300, "greedy", {}, args)
    assert row["input_len"] == 300 and row["prompt_cached"] and row["identical"] is True
    assert row["baseline_tokens"] == row["spec_tokens"] == 2 * 4
    # two warm prefills of the whole prompt, then 2 repeats x 2 sides x 2 prompts that
    # recompute at most a block of it (and decode a few tokens, with their drafts)
    assert len(timed) == 2 + 2 * 2 * 2
    assert min(timed[:2]) >= 300
    assert max(timed[2:]) < 300 // 2, timed
    skipped = long_row(spec, 10 ** 7, "greedy", {}, args)
    assert "skipped" in skipped and "batch" not in skipped
