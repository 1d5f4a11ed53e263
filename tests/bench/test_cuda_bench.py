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
    for section in ("correctness", "kda_op", "throughput", "graphs", "long", "spec",
                    "shapes48b"):
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
    shapes = out["shapes48b"]
    assert "error" not in shapes, shapes
    assert shapes["layers"] == shapes["of_layers"] == 8       # the demo's shapes on the CPU
    for b, row in ((1, shapes["decode"]["batch1"]), (2, shapes["decode"]["batch2"])):
        assert row["output_tok_s"] == round(b / (row["tpot_ms"] / 1e3), 1) or \
            abs(row["output_tok_s"] - b / (row["tpot_ms"] / 1e3)) < 0.5
        assert row["roofline_tpot_ms"] is None                 # no bandwidth figure for a CPU
    assert shapes["decode"]["batch2"]["bytes_per_step"] > shapes["decode"]["batch1"][
        "bytes_per_step"]
    summary = out["summary"]
    assert summary["shapes48b_tpot_batch1_ms"] == shapes["decode"]["batch1"]["tpot_ms"]
    for name in ("kimi_k3", "kimi_linear"):      # the CPU replay backend of the graphs
        row = out["graphs"][name]
        assert row["greedy_identical"] is True and row["graphs_vs_eager"] > 0
        assert row["capture"]["sizes"] == [1, 2, 4] and row["capture"]["mib"] == 0
    assert summary["greedy_identical_graphs_vs_eager"] is True
    assert summary["graphs_vs_eager"] == out["graphs"]["kimi_linear"]["graphs_vs_eager"]
    assert summary["shapes48b_graphs_vs_eager"] is None       # no graphs on the CPU
    assert summary["kimi_linear_batch64_output_tok_s"] == \
        out["throughput"]["kimi_linear_bf16"]["batch64_output_tok_s"]
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


def test_48b_step_bytes_and_layer_cut():
    """What a decode step of the 48B shapes reads, from its config: at batch 1 the 8 routed
    experts of 256 per MoE layer, all of them at a large batch; and the layer cut keeps an
    MLA layer."""
    import torch

    from kdaserve.bench.cuda.shapes_48b import CONFIG_48B, first_layers, step_bytes

    raw = json.loads(CONFIG_48B.read_text())
    routed_per_layer = 256 * 3 * 2304 * 1024 * 2
    routed = 26 * routed_per_layer                      # 26 MoE layers (the first is dense)
    dense = 10 ** 9
    b1 = step_bytes(raw, torch.bfloat16, 1, 0, dense, routed)
    embed = 163840 * 2304 * 2
    kda = 20 * 32 * 128 * 128 * 4 * 2
    assert b1 == int(dense - embed + 2304 * 2 + routed * 8 / 256 + kda)
    big = step_bytes(raw, torch.bfloat16, 4096, 0, dense, routed)
    assert abs(big - (dense - embed + 4096 * 2304 * 2 + routed + 4096 * kda)) < 1e-6 * big
    # MLA latents: 7 layers x context x (512 + 64) x 2 bytes per row
    assert step_bytes(raw, torch.bfloat16, 1, 100, dense, routed) - b1 == 7 * 100 * 576 * 2
    cut = first_layers(raw, 6)
    lac = cut["linear_attn_config"]
    assert cut["num_hidden_layers"] == 6 and lac["full_attn_layers"] == [4]
    assert lac["kda_layers"] == [1, 2, 3, 5, 6]
    assert first_layers(raw, 3)["linear_attn_config"]["full_attn_layers"] == [3]
