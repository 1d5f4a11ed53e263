"""`kdaserve bench offline` prints one JSON object with the ratios against transformers, and
the engine's greedy tokens are the same as transformers' on every repeat. Every rate is the
reported tokens over the reported seconds, every ratio the ratio of two reported rates, and
both engines generate exactly the tokens asked for."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_bench_offline_prints_ratios_and_matches_transformers(capsys):
    pytest.importorskip("transformers")
    from kdaserve.cli import main

    assert main(["bench", "offline", "--json", "--num-prompts", "3", "--input-len", "12",
                 "--output-len", "6", "--single-output-len", "5", "--repeats", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["repeats"] == 2 and out["num_prompts"] == 3 and out["output_len"] == 6
    asked = {"batch": 3 * 6, "single": 5}
    rates = {}
    for engine in ("", "hf_"):
        for workload, n in asked.items():
            name = f"{engine}{workload}"
            assert out[f"{name}_output_tokens"] == n, name
            assert out[f"{name}_seconds"] > 0, name
            rates[name] = out[f"{name}_output_tokens"] / out[f"{name}_seconds"]
            # rounded to 0.1 tok/s from unrounded seconds (reported to the microsecond)
            assert out[f"{name}_tok_s"] == pytest.approx(rates[name], rel=1e-4, abs=0.06), name
    for workload in asked:
        assert out[f"{workload}_ratio_vs_hf"] == pytest.approx(
            rates[workload] / rates[f"hf_{workload}"], rel=1e-4, abs=0.006), workload
    assert out["batch_identical_to_hf"] is True and out["single_identical_to_hf"] is True
