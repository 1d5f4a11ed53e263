"""`kdaserve bench reference --arch kimi_k3` runs, small, and reports agreement with mlx-lm."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("mlx_lm.models.kimi_k3")


def test_reference_k3_small(tmp_path):
    from kdaserve.bench.reference_k3 import run

    args = argparse.Namespace(seed=0, batch=1, seq_len=24, repeat=1, greedy_tokens=4)
    res = run(args, tmp_path)
    assert res["greedy_identical_vs_mlx"] is True
    assert res["max_abs_logit_diff_vs_mlx"] < 1e-3
    # 4 bits per weight plus one scale byte per 32
    assert res["expert_bytes_per_weight"] == pytest.approx(17 / 32, abs=1e-3)
    assert res["forward_s_kdaserve"] > 0 and res["forward_s_mlx"] > 0
