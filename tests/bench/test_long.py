"""`kdaserve bench long` prints one JSON object with the issue's keys, from runs that complete
with the token counts asked for and rates and ratios that are the reported figures divided; its
summary arithmetic holds on made-up runs (the real contexts are for docs, not CI)."""

from __future__ import annotations

import json

from kdaserve.bench.long import summarize
from kdaserve.bench.long_model import bench_config
from kdaserve.model.registry import load_config

KEYS = ("tpot_ratio_128k_1k", "cache_bytes_ratio_vs_mla", "completed_1m", "peak_rss_1m_mb")


def _within_rounding(reported: float, num: float, den: float, den_digits: int,
                     digits: int) -> bool:
    """`reported` is round(num / d, digits) for some d that rounds to `den` at den_digits."""
    half = 0.5 * 10 ** -den_digits
    slack = 0.5 * 10 ** -digits
    return num / (den + half) - slack <= reported <= num / (den - half) + slack


def test_bench_long_runs_hybrid_and_all_mla(capsys):
    from kdaserve.cli import main

    assert main(["bench", "long", "--json", "--contexts", "1200", "--mla-contexts", "1200",
                 "--decode-tokens", "3", "--max-num-batched-tokens", "512"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(KEYS) <= set(out)
    assert out["decode_tokens"] == 3 and out["max_num_batched_tokens"] == 512
    assert [r["context"] for r in out["hybrid"]] == [1200]
    assert [r["context"] for r in out["all_mla"]] == [1200]
    for run in out["hybrid"] + out["all_mla"]:
        assert run["completed"], run
        # the prompt fills the context but for the decoded tokens
        assert run["prompt_tokens"] == 1200 - 3
        assert 0 < run["prefill_s"] and run["tpot_ms"] > 0
        assert _within_rounding(run["prefill_tok_s"], run["prompt_tokens"], run["prefill_s"],
                                3, 1), run
        assert run["cache_bytes_per_token"] == round(run["cache_bytes"] / 1200, 1)
        assert run["peak_rss_mb"] >= run["rss_before_mb"] > 0
        # past BASE_CONTEXT a 1k request decodes beside it (the side-by-side TPOT ratio)
        assert run["tpot_base_beside_ms"] > 0
    hybrid, mla = out["hybrid"][0], out["all_mla"][0]
    assert (hybrid["layers_mla"], mla["layers_mla"]) == (1, 4)
    assert hybrid["layers"] == mla["layers"] == 4
    # a quarter of the layers hold latents; the KDA slot is a constant on top
    assert 0.25 < out["cache_bytes_ratio_vs_mla"] < 0.35
    assert out["cache_bytes_ratio_vs_mla"] == round(hybrid["cache_bytes"] / mla["cache_bytes"], 3)
    assert out["tpot_ratio_vs_mla"] == round(hybrid["tpot_ms"] / mla["tpot_ms"], 3)
    assert out["cache_bytes_ratio_context"] == 1200
    # no 128k or 1k row: those ratios have nothing to compare
    assert out["tpot_ratio_128k_1k"] is None and out["tpot_ratio_128k_1k_across_runs"] is None
    assert out["completed_1m"] is False and out["peak_rss_1m_mb"] is None


def test_summary_keys():
    def run(ctx, tpot, cache, rss=100.0):
        return {"context": ctx, "completed": True, "tpot_ms": tpot, "cache_bytes": cache,
                "peak_rss_mb": rss}
    long_run = dict(run(131072, 12.0, 2600), tpot_base_beside_ms=8.0)
    hybrid = [run(1024, 10.0, 300), long_run, run(1 << 20, 20.0, 20000, 700.0)]
    mla = [run(1024, 9.0, 1000), run(131072, 30.0, 10000)]
    out = summarize(hybrid, mla)
    # against the 1k decode beside it in the 128k run's process; across runs as well
    assert out["tpot_ratio_128k_1k"] == 1.5 and out["tpot_ratio_128k_1k_across_runs"] == 1.2
    assert out["cache_bytes_ratio_vs_mla"] == 0.26 and out["cache_bytes_ratio_context"] == 131072
    assert out["tpot_ratio_vs_mla"] == 0.4
    assert out["completed_1m"] is True and out["peak_rss_1m_mb"] == 700.0


def test_bench_model_is_configured_for_1m_positions():
    cfg = load_config(bench_config())
    assert cfg.max_position_embeddings >= 1 << 20
    assert len(cfg.mla_layers) * 4 == cfg.num_hidden_layers


def test_proportional_shape_has_the_released_latent_to_weight_bytes():
    """The proportional bench model caches at 128k about 0.18 of the bytes of weights a token
    reads, as the released Kimi Linear does (1 GiB of bf16 latents at 128k, 6 GB of active
    bf16 weights); the toy's cache is many times its weights."""
    from kdaserve.cache.spec import specs_for
    from kdaserve.model.registry import build_model

    def ratio(shape):
        cfg = load_config(bench_config(shape=shape))
        latent, _ = specs_for(cfg, 16, "float32")
        weights = sum(p.numel() * 4 for p in build_model(cfg).parameters())
        return 131072 * latent.bytes_per_token / weights

    assert 0.15 < ratio("proportional") < 0.22
    assert ratio("toy") > 3
    assert len(load_config(bench_config(shape="proportional")).mla_layers) == 1
