"""`kdaserve bench moe --json` runs end to end at tiny sizes (2 gloo ranks for tp_sharded and
ep_all2all, 2-worker engines for TP=2, EP=2 and DP=2 x EP=2) and prints the issue's keys;
every backend's output matches `reference` and the layouts' greedy tokens match one process."""

from __future__ import annotations

import json

BACKENDS = {"reference", "grouped", "tp_sharded", "ep_all2all"}
KEYS = ("grouped_vs_reference", "tp_sharded_vs_grouped", "ep_all2all_vs_grouped",
        "ep_all2all_vs_tp_sharded", "tp2_identical", "ep2_identical", "pp2_identical",
        "dp2_ep2_identical", "tp2_step_vs_one", "ep2_step_vs_one", "dp2_ep2_step_vs_one",
        "decode_step_s", "ratio_tokens")


def test_bench_moe_json(capsys):
    from kdaserve.cli import main

    assert main(["bench", "moe", "--json", "--experts", "8", "--top-k", "2", "--hidden", "32",
                 "--intermediate", "64", "--tokens", "1", "8", "--repeats", "1",
                 "--layout-tokens", "4"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(KEYS) <= set(out), sorted(out)
    assert set(out["backends"]) == BACKENDS
    for name, per in out["backends"].items():
        assert set(per) == {"1", "8"}, name
        for t, row in per.items():
            assert row["tokens_per_s"] > 0, (name, t)
            # fp32 sums in another order (sharded widths, dispatched tokens): rounding only
            assert row["max_abs_err_vs_reference"] < 1e-5, (name, t, row)
    assert out["ratio_tokens"] == 8
    assert out["experts_format"] == "mxfp4"          # K3's format, the default
    assert set(out["grouped_vs_reference_by_format"]) == {"mxfp4", "fp32"}
    for key in ("grouped_vs_reference", "tp_sharded_vs_grouped", "ep_all2all_vs_grouped",
                "tp2_step_vs_one", "ep2_step_vs_one", "dp2_ep2_step_vs_one"):
        assert out[key] > 0, key
    assert out["tp2_identical"] is True and out["ep2_identical"] is True
    assert out["dp2_ep2_identical"] is True
    assert out["pp2_identical"] is None          # pipeline parallelism is not built
    assert set(out["decode_step_s"]) == {"one", "tp2", "ep2", "dp2_ep2"}


def test_bench_moe_fp32_experts(capsys):
    from kdaserve.cli import main

    assert main(["bench", "moe", "--json", "--experts", "8", "--top-k", "2", "--hidden", "32",
                 "--intermediate", "16", "--tokens", "4", "--repeats", "1", "--no-layouts",
                 "--experts-format", "fp32"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["experts_format"] == "fp32"
    for name, per in out["backends"].items():
        assert per["4"]["max_abs_err_vs_reference"] < 1e-5, name
    assert out["grouped_vs_reference"] == out["grouped_vs_reference_by_format"]["fp32"]
