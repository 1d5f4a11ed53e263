"""`kdaserve bench compare --shape memory-bound`'s sizing and byte counts (the model it builds
and the peers' GGUFs are too large for a test; docs/benchmarks.md has its runs)."""

from __future__ import annotations

from tiny_models import random_model, tiny_config

from kdaserve.bench import memory_bound as mb
from kdaserve.model.inspect import measure_model
from kdaserve.model.quantize import quantize_model
from kdaserve.quant_config import WeightQuant


def test_the_shape_reads_at_least_8x_the_cache():
    assert mb.llc_bytes() > 0
    for llc in (4 << 20, 32 << 20, 480 << 20):
        raw = mb.pick_shape(llc)
        assert mb.active_bf16_bytes(raw) >= mb.LLC_MULTIPLE * llc
        assert (raw["hidden_size"], raw["num_experts"]) in mb._SCALES
        assert raw["num_experts_per_token"] == 8
    # bigger caches, bigger models; a 480 MiB L3 takes the half-expert h4096, whose total
    # is no larger than h3072's (llama.cpp's bf16 copy is held beside kdaserve's)
    assert mb.pick_shape(32 << 20)["hidden_size"] > mb.pick_shape(4 << 20)["hidden_size"]
    big = mb.pick_shape(480 << 20)
    assert mb.model_name(big) == "memory-bound-h4096-e16"
    assert mb.model_name(mb.pick_shape(32 << 20)) == "memory-bound-h1024"
    assert mb.total_bf16_bytes(big) <= 1.02 * mb.total_bf16_bytes(mb.config_for(3072))
    # the machine's memory bounds the scale: both bf16 copies must fit
    for ram in (24 << 30, 12 << 30, 6 << 30):
        raw = mb.pick_shape(480 << 20, ram)
        assert 2 * mb.total_bf16_bytes(raw) <= 0.9 * ram
    assert mb.pick_shape(480 << 20, 24 << 30) == big
    assert mb.pick_shape(480 << 20, 12 << 30)["hidden_size"] < 3072
    assert mb.pick_shape(32 << 20, 24 << 30) == mb.pick_shape(32 << 20)
    assert mb.ram_bytes() > 0


def test_active_bytes_count_top_k_experts_and_one_embedding_row():
    cfg = tiny_config()
    model = random_model(cfg)
    size = measure_model(model, cfg)
    share = cfg.num_experts_per_token / cfg.num_experts
    want = sum(b * (share if part in ("routed experts", "expert scales") else 1)
               for part, b in size.stored_bytes.items() if part != "embedding")
    assert mb.active_bytes(model) == int(want)
    experts = size.stored_bytes["routed experts"]
    dense = mb.active_bytes(model) - experts * share
    assert 0 < dense < sum(size.stored_bytes.values()) - experts
    # packed INT8 weights: fewer bytes read a token than fp32 (scales included)
    q = quantize_model(random_model(cfg), WeightQuant(bits=8, group_size=16))
    assert mb.active_bytes(q) < 0.5 * mb.active_bytes(model)


def test_decode_report_takes_each_runs_own_decode_time():
    model = random_model(tiny_config())
    single = {"kdaserve": [{"seconds": 3.0, "prefill_seconds": 0.6, "decode_seconds": 2.4},
                           {"seconds": 2.5, "prefill_seconds": 0.5, "decode_seconds": 2.0}],
              "llamacpp": [{"seconds": 2.0, "prefill_seconds": 1.0, "decode_seconds": 1.0}]}
    rep = mb.decode_report(model, single, 21, 1)
    assert rep["kdaserve_decode_tok_s"] == 10.0 and rep["llamacpp_decode_tok_s"] == 20.0
    assert rep["kdaserve_single_prefill_seconds"] == 0.5
    assert rep["ratio_vs_llamacpp_decode"] == 0.5
    frac = mb.active_bytes(model) * 10.0 / rep["read_bytes_per_s"]
    assert abs(rep["bandwidth_fraction_single"] - frac) <= 1e-3
    assert rep["read_bytes_per_s"] > 1e8


def test_the_fraction_takes_the_read_rate_beside_the_best_decode():
    """Runs timed beside_read_rate carry their own rate: the fraction uses the best decode's,
    and the range of all of them is printed."""
    model = random_model(tiny_config())
    single = {"kdaserve": [{"prefill_seconds": 0.5, "decode_seconds": 2.0,
                            "read_bytes_per_s": 4e9},
                           {"prefill_seconds": 0.5, "decode_seconds": 4.0,
                            "read_bytes_per_s": 2e9}]}
    rep = mb.decode_report(model, single, 21, 1)
    assert rep["read_bytes_per_s"] == 4e9 and rep["read_bytes_per_s_range"] == [2e9, 4e9]
    assert abs(rep["bandwidth_fraction_single"] - mb.active_bytes(model) * 10.0 / 4e9) <= 1e-3
    calls = []
    timed = mb.beside_read_rate(lambda x: calls.append(x) or {"decode_seconds": 1.0}, 1)
    out = timed(7)
    assert calls == [7] and out["decode_seconds"] == 1.0 and out["read_bytes_per_s"] > 1e8
