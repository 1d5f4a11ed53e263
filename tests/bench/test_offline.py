"""`kdaserve bench offline` prints one JSON object with the ratios against transformers, and
the engine's greedy tokens are the same as transformers' on every repeat."""

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
    for key in ("batch_tok_s", "single_tok_s", "hf_batch_tok_s", "hf_single_tok_s",
                "batch_ratio_vs_hf", "single_ratio_vs_hf"):
        assert out[key] > 0, key
    assert out["batch_identical_to_hf"] is True and out["single_identical_to_hf"] is True
    assert out["repeats"] == 2
