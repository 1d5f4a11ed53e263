"""`kdaserve bench serve` against the test server."""

from __future__ import annotations

import argparse
import json

import pytest

from kdaserve.bench.serve import add_bench_serve_arguments, run_bench_serve

KEYS = {"model", "num_prompts", "request_rate", "input_len", "output_len", "range_ratio",
        "completed", "errors", "duration_s", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "total_token_throughput",
        *(f"{s}_{m}_ms" for s in ("mean", "median", "p99") for m in ("ttft", "tpot", "itl"))}


def bench(capsys, *argv: str) -> tuple[int, dict]:
    parser = argparse.ArgumentParser()
    add_bench_serve_arguments(parser)
    rc = run_bench_serve(parser.parse_args(list(argv)))
    return rc, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("rate", ["inf", "40"])
def test_bench_serve_json(server, tiny_model_dir, capsys, rate):
    rc, out = bench(capsys, "--url", server.url, "--num-prompts", "8", "--request-rate", rate,
                    "--input-len", "12", "--output-len", "4", "--seed", "3", "--json")
    assert rc == 0
    assert set(out) == KEYS
    assert out["completed"] == 8 and out["errors"] == 0
    assert out["model"] == tiny_model_dir.name
    assert out["total_output_tokens"] == 32
    assert out["request_rate"] == (rate if rate == "inf" else 40.0)
    assert out["output_throughput"] == pytest.approx(32 / out["duration_s"])
    assert out["p99_ttft_ms"] >= out["median_ttft_ms"] > 0


def test_bench_serve_range_ratio(server, capsys):
    rc, out = bench(capsys, "--url", server.url, "--num-prompts", "8", "--input-len", "10",
                    "--output-len", "4", "--range-ratio", "0.5", "--json")
    assert rc == 0 and out["completed"] == 8
    assert 8 * 2 <= out["total_output_tokens"] <= 8 * 6
