"""`kdaserve bench moe --json` runs end to end at tiny sizes (2 gloo ranks for tp_sharded and
ep_all2all, 2-worker engines for TP=2, EP=2, DP=2 x EP=2 and PP=2) and prints the issue's keys;
every backend's output matches `reference` and the layouts' greedy tokens match one process;
every rate is tokens over the reported step time and every ratio the ratio of two reported
figures, and the layouts generate the tokens asked for."""

from __future__ import annotations

import json

import pytest

BACKENDS = {"reference", "grouped", "tp_sharded", "ep_all2all"}
KEYS = ("grouped_vs_reference", "tp_sharded_vs_grouped", "ep_all2all_vs_grouped",
        "ep_all2all_vs_tp_sharded", "tp2_identical", "ep2_identical", "pp2_identical",
        "dp2_ep2_identical", "tp2_step_vs_one", "ep2_step_vs_one", "dp2_ep2_step_vs_one",
        "pp2_step_vs_one",
        "decode_step_s", "ratio_tokens")
LAYOUTS = {"one", "tp2", "ep2", "dp2_ep2", "pp2"}


def _rate(out: dict, backend: str, tokens: int) -> float:
    return tokens / out["backends"][backend][str(tokens)]["step_s"]


def _check_backend_rows(out: dict, tokens: list[int]) -> None:
    assert set(out["backends"]) == BACKENDS
    for name, per in out["backends"].items():
        assert set(per) == {str(t) for t in tokens}, name
        for t in tokens:
            row = per[str(t)]
            assert row["step_s"] > 0, (name, t)
            assert row["tokens_per_s"] == round(_rate(out, name, t), 1), (name, t, row)
            # fp32 sums in another order (sharded widths, dispatched tokens): rounding only
            assert row["max_abs_err_vs_reference"] < 1e-5, (name, t, row)
    top = max(tokens)
    assert out["ratio_tokens"] == top
    for key, (a, b) in {"grouped_vs_reference": ("grouped", "reference"),
                        "tp_sharded_vs_grouped": ("tp_sharded", "grouped"),
                        "ep_all2all_vs_grouped": ("ep_all2all", "grouped"),
                        "ep_all2all_vs_tp_sharded": ("ep_all2all", "tp_sharded")}.items():
        assert out[key] == pytest.approx(_rate(out, a, top) / _rate(out, b, top),
                                         rel=1e-12), key
    fmt = out["experts_format"]
    assert out["grouped_vs_reference_by_format"][fmt] == out["grouped_vs_reference"]


def _ratio_bounds(a: float, b: float, digits: int) -> tuple[float, float]:
    """The range of x / y for x, y that round to a, b at `digits`."""
    h = 0.5 * 10 ** -digits
    return (a - h) / (b + h), (a + h) / (b - h)


def test_bench_moe_json(capsys):
    from kdaserve.cli import main

    assert main(["bench", "moe", "--json", "--experts", "8", "--top-k", "2", "--hidden", "32",
                 "--intermediate", "64", "--tokens", "1", "8", "--repeats", "1",
                 "--layout-tokens", "4"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(KEYS) <= set(out), sorted(out)
    _check_backend_rows(out, [1, 8])
    assert out["experts_format"] == "mxfp4"          # K3's format, the default
    assert set(out["grouped_vs_reference_by_format"]) == {"mxfp4", "fp32"}
    assert out["grouped_vs_reference_by_format"]["fp32"] > 0
    assert out["tp2_identical"] is True and out["ep2_identical"] is True
    assert out["dp2_ep2_identical"] is True
    assert out["pp2_identical"] is True
    # two prompts of --layout-tokens greedy tokens in every layout
    assert out["output_tokens_per_prompt"] == {k: [4, 4] for k in LAYOUTS}
    steps = out["decode_step_s"]
    assert set(steps) == LAYOUTS and all(v > 0 for v in steps.values())
    for layout in LAYOUTS - {"one"}:
        lo, hi = _ratio_bounds(steps[layout], steps["one"], 5)
        assert lo <= out[f"{layout}_step_vs_one"] <= hi, layout


def test_bench_moe_fp32_experts(capsys):
    from kdaserve.cli import main

    assert main(["bench", "moe", "--json", "--experts", "8", "--top-k", "2", "--hidden", "32",
                 "--intermediate", "16", "--tokens", "4", "--repeats", "1", "--no-layouts",
                 "--experts-format", "fp32"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["experts_format"] == "fp32"
    _check_backend_rows(out, [4])
    # MXFP4 needs widths of 32: no ratio in the other format, and no layout runs
    assert out["grouped_vs_reference_by_format"]["mxfp4"] is None
    assert "tp2_identical" not in out and "decode_step_s" not in out
