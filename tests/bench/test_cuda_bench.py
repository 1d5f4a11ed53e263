"""`kdaserve bench cuda --tiny` on the CPU: every section's code path runs with a few tokens
(the figures themselves come from a CUDA machine: docs/benchmarks.md)."""

from __future__ import annotations

import json

from kdaserve.bench.cuda.cli import summarize
from kdaserve.bench.cuda.correctness import first_diff


def test_bench_cuda_tiny_runs_every_section_on_cpu(capsys, tmp_path):
    from kdaserve.cli import main

    saved = tmp_path / "cuda.json"
    assert main(["bench", "cuda", "--json", "--tiny", "--device", "cpu", "--torch-threads", "1",
                 "--budget-s", "600", "--out", str(saved)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads(saved.read_text()) == out
    for section in ("correctness", "kda_op", "throughput", "long", "spec"):
        assert "error" not in out[section], out[section]
    corr = out["correctness"]
    # the "device" is the CPU here: the reference is the torch forward, the device run takes
    # the fused decode blocks (test_correctness_reports_where_the_runs_differ: a difference
    # is reported)
    assert corr["cpu_reference"] == "cpu, torch forward (KDASERVE_FUSED_DECODE=0)"
    for name in ("kimi_k3", "kimi_linear"):
        assert corr[name]["greedy_identical_cuda_vs_cpu"] is True
        assert corr[name]["first_diffs"] == [] and corr[name]["tokens_per_prompt"] == [4, 4]
    assert out["kda_op"]["torch_ref_vs_fla_naive_max_abs_err"] < 1e-4
    assert out["kda_op"]["prefill_timing"]["torch_ref_ms"] > 0
    for key in ("kimi_linear_fp32", "kimi_linear_bf16", "kimi_k3_fp32", "kimi_k3_bf16"):
        row = out["throughput"][key]
        assert "error" not in row, row
        assert row["single_decode_tok_s"] > 0 and row["batch32_output_tok_s"] > 0
        assert row["prefill_tok_s"] > 0
    runs = out["long"]["runs"]
    assert [r["context"] for r in runs] == [64, 128] and all(r["completed"] for r in runs)
    assert out["long"]["tpot_ratio_128_64"] > 0
    for name in ("kimi_k3", "kimi_linear"):
        row = out["spec"][name]
        assert "error" not in row, row
        assert row["identical"] is True and row["requests"] == row["batch"] == 1
        assert row["baseline_tokens"] == row["spec_tokens"] == row["max_tokens"]
        assert 0 <= row["accepted"] <= row["drafted"] <= row["k"] * row["verifications"]
    summary = out["summary"]
    assert summary["kimi_k3_greedy_identical_cuda_vs_cpu"] is True
    assert summary["kimi_k3_spec_speedup_batch1"] == out["spec"]["kimi_k3"]["speedup"]


def test_correctness_reports_where_the_runs_differ(monkeypatch):
    """The device's tokens against the CPU reference's, with the engine runs replaced: the
    reference runs with the fused decode off, and a differing token is reported where it is."""
    import os

    import torch

    from kdaserve.bench.cuda import correctness
    from kdaserve.bench.cuda.workload import TINY

    def greedy(llm, prompts, max_tokens):
        ids = [[1, 2, 3, 4], [5, 6, 7, 8]]
        if os.environ.get("KDASERVE_FUSED_DECODE") == "0":     # the reference run
            ids[1][2] = 9
        return ids

    monkeypatch.delenv("KDASERVE_FUSED_DECODE", raising=False)
    monkeypatch.setattr(correctness, "build_llm", lambda *a, **kw: object())
    monkeypatch.setattr(correctness, "_greedy", greedy)
    out = correctness.correctness(torch.device("cpu"), TINY)
    for name in ("kimi_k3", "kimi_linear"):
        assert out[name]["greedy_identical_cuda_vs_cpu"] is False
        assert out[name]["first_diffs"] == [{"prompt": 1, "first_diff_position": 2}]
    assert "KDASERVE_FUSED_DECODE" not in os.environ


def test_first_diff_and_summary():
    assert first_diff([1, 2, 3], [1, 2, 3]) is None
    assert first_diff([1, 2, 3], [1, 5, 3]) == 1
    assert first_diff([1, 2], [1, 2, 3]) == 2
    s = summarize({"correctness": {"kda_backend": "fla-triton",
                                   "kimi_k3": {"greedy_identical_cuda_vs_cpu": False}},
                   "kda_op": {"fla_chunk_vs_torch_ref_max_abs_err_o": 1e-6,
                              "fla_chunk_vs_torch_ref_max_abs_err_state": 2e-6},
                   "long": {"tpot_ratio_128k_1k": 1.5},
                   "spec": {"kimi_linear": {"speedup": 1.7}}})
    assert s == {"kimi_k3_greedy_identical_cuda_vs_cpu": False, "kda_backend": "fla-triton",
                 "fla_chunk_vs_torch_ref_max_abs_err": 2e-6, "tpot_ratio_128k_1k": 1.5,
                 "kimi_linear_spec_speedup_batch1": 1.7}
