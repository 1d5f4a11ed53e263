"""`kdaserve plan --simulate` (kdaserve/plan/simulate.py): the engine's scheduler and cache
manager in simulated time. With a known step cost the times are exact; preemptions and prefix
hits are the scheduler's and the cache manager's, counted where the rules say they happen."""

from __future__ import annotations

import itertools
import json

import pytest

from kdaserve.cache.planner import CachePlan
from kdaserve.config import CacheConfig, SchedulerConfig
from kdaserve.plan.simulate import host_tier, simulate
from kdaserve.plan.step_cost import LinearCost, StepShape, fit_linear
from kdaserve.plan.workload import from_trace, length_sampler, synthetic

VOCAB = 4096
COST = LinearCost(decode_fixed=0.01, per_decode_row=0.002, prompt_fixed=0.01, per_token=0.001,
                  per_prompt_chunk=0.0)


def _plan(num_blocks: int, slots: int = 4, snapshots: int = 0) -> CachePlan:
    return CachePlan(num_blocks, 16, slots, snapshots, block_bytes=16 * 100, slot_bytes=1000,
                     max_model_len=512)


def _trace(tmp_path, rows: list[dict]):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return from_trace(path, VOCAB)


def test_a_known_cost_gives_exact_times(tmp_path):
    work = _trace(tmp_path, [{"arrival_s": 0.0, "prompt_len": 100, "output_len": 3},
                             {"arrival_s": 0.05, "prompt_len": 10, "output_len": 2}])
    res = simulate(work, _plan(64), CacheConfig(), SchedulerConfig(max_num_batched_tokens=64),
                   COST)
    # step 1: 64 of r0's prompt (0.074 s); r1 arrived meanwhile. Step 2: r0's last 36 and
    # r1's 10 (0.056 s): both sample. Step 3: two decode rows (0.014 s), r1 is done.
    # Step 4: r0 alone (0.012 s).
    assert [s.__dict__ for s in res.shapes] == [
        {"prefill_tokens": 64, "prefill_rows": 1, "decode_rows": 0, "kv_tokens": 64},
        {"prefill_tokens": 46, "prefill_rows": 2, "decode_rows": 0, "kv_tokens": 110},
        {"prefill_tokens": 0, "prefill_rows": 0, "decode_rows": 2, "kv_tokens": 112},
        {"prefill_tokens": 0, "prefill_rows": 0, "decode_rows": 1, "kv_tokens": 102}]
    assert res.ttft_s["r0"] == pytest.approx(0.130, abs=1e-12)
    assert res.ttft_s["r1"] == pytest.approx(0.080, abs=1e-12)
    s = res.summary
    assert s["completed"] == 2 and s["total_output_tokens"] == 5
    assert s["duration_s"] == pytest.approx(0.156, abs=1e-12)
    assert s["median_ttft_ms"] == pytest.approx(105.0, abs=1e-9)
    assert s["mean_tpot_ms"] == pytest.approx((13.0 + 14.0) / 2, abs=1e-9)
    assert res.preemptions == 0


def test_a_tiny_cache_preempts_the_newest(tmp_path):
    # 4 blocks of 16: both 16-token prompts run; at 33 tokens each needs a third block, none is
    # free: r1 (the newest) is preempted once, and runs again only when r0 has finished
    work = _trace(tmp_path, [{"arrival_s": 0.0, "prompt_len": 16, "output_len": 40},
                             {"arrival_s": 0.0, "prompt_len": 16, "output_len": 40}])
    res = simulate(work, _plan(4), CacheConfig(), SchedulerConfig(), COST)
    assert res.preemptions == 1
    assert res.summary["completed"] == 2 and res.summary["total_output_tokens"] == 80
    big = simulate(work, _plan(64), CacheConfig(), SchedulerConfig(), COST)
    assert big.preemptions == 0
    assert big.summary["duration_s"] < res.summary["duration_s"]


def test_prefix_hits_need_a_snapshot_where_prompts_branch(tmp_path):
    # r0 and r1 share 48 tokens. r0's snapshot sits at its prompt's end (64), so r1 finds the
    # MLA blocks but no state: no hit, and r1 snapshots the branch point. r2 then hits 48.
    rows = [{"arrival_s": float(i), "prompt_len": 64, "output_len": 2, "shared_prefix_len": 48}
            for i in range(3)]
    res = simulate(_trace(tmp_path, rows), _plan(64, snapshots=8), CacheConfig(),
                   SchedulerConfig(), COST)
    assert res.prefix_hits == 1
    assert res.prefix_hit_rate == pytest.approx(48 / (3 * 64))
    assert res.snapshot_bytes_peak == 4 * 1000     # each prompt's end, r1's branch
    none = simulate(_trace(tmp_path, [{**r, "shared_prefix_len": 0} for r in rows]),
                    _plan(64, snapshots=8), CacheConfig(), SchedulerConfig(), COST)
    assert none.prefix_hits == 0 and none.prefix_hit_rate == 0.0


def test_an_offload_tier_keeps_what_the_device_evicts(tmp_path):
    # r0 and r1 leave a snapshot where they branch (48); four long prompts then evict it from
    # a 12-block device cache. Without a tier r6 misses; with one it loads the 3 blocks and
    # the snapshot back: a 48-token hit and exactly those bytes loaded.
    rows = [{"arrival_s": float(i), "prompt_len": 64, "output_len": 2, "shared_prefix_len": 48}
            for i in range(2)]
    rows += [{"arrival_s": 2.0 + i, "prompt_len": 100, "output_len": 2} for i in range(4)]
    rows += [{"arrival_s": 10.0, "prompt_len": 64, "output_len": 2, "shared_prefix_len": 48}]
    work = _trace(tmp_path, rows)
    plan = _plan(12, slots=2, snapshots=2)
    bare = simulate(work, plan, CacheConfig(), SchedulerConfig(), COST)
    assert bare.prefix_hits == 0 and bare.offload_loaded_bytes == {}
    tiered = simulate(work, plan, CacheConfig(), SchedulerConfig(), COST,
                      host_tier(1 << 20, plan))
    assert tiered.prefix_hits == 1
    assert tiered.prefix_hit_rate == pytest.approx(48 / sum(r["prompt_len"] for r in rows))
    assert tiered.offload_loaded_bytes == {"host": 3 * plan.block_bytes + plan.slot_bytes}
    assert tiered.offload_stored_bytes["host"] >= 3 * plan.block_bytes + plan.slot_bytes


def test_workload_lengths_and_prefix_share():
    work = synthetic(50, 4.0, "uniform:20:40", "exp:8", VOCAB, prefix_share=0.5, seed=3)
    assert all(20 <= len(a.prompt_token_ids) <= 40 and a.output_len >= 1 for a in work)
    assert work[0].arrival_s == 0.0
    assert all(b.arrival_s > a.arrival_s for a, b in itertools.pairwise(work))
    head = work[0].prompt_token_ids[:10]
    assert all(a.prompt_token_ids[:10] == head for a in work)
    with pytest.raises(ValueError, match="length distribution"):
        length_sampler("normal:3", None)


def test_the_fit_recovers_a_linear_cost():
    shapes = [StepShape(p, r, d, 0) for p, r, d in
              [(64, 1, 0), (128, 2, 3), (0, 0, 5), (0, 0, 1), (32, 1, 7), (200, 3, 0)]]
    fit, err = fit_linear(shapes, [COST.seconds(s) for s in shapes])
    assert err < 1e-9
    for s in shapes:
        assert fit.seconds(s) == pytest.approx(COST.seconds(s), rel=1e-9)


def test_simulate_cli_on_a_published_config(capsys):
    from kdaserve.cli import main

    assert main(["plan", "--model", "kimi-linear-48b", "--gpu", "H200", "--num-gpus", "2",
                 "--simulate", "--num-requests", "30", "--arrival-rate", "4", "--prompt-len",
                 "uniform:500:1500", "--output-len", "32", "--prefix-share", "0.8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sim = out["simulation"]
    assert out["total_params"] > 0 and "cache_plan" in out
    assert sim["completed"] == 30 and sim["total_output_tokens"] == 30 * 32
    for key in ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                "preemptions", "snapshot_bytes_peak", "offload_stored_bytes"):
        assert key in sim
    # 80% of each prompt is one common prefix: most requests hit (a hit needs a snapshot where
    # the prompts branch, taken by the first request that branches there)
    assert 0.5 < sim["prefix_hit_rate"] < 0.8 and sim["prefix_hits"] >= 20
