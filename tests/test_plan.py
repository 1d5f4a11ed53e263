"""`kdaserve plan` (kdaserve/plan/): totals equal `kdaserve inspect`'s, the fit follows the bytes,
the layout choice follows the interconnect, and the figures move the way the roofline says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdaserve.model.inspect import measure
from kdaserve.model.registry import load_config
from kdaserve.plan.hardware import find, load_table
from kdaserve.plan.model import Layout, plan, recommend

from kdaserve.plan.cli import PUBLISHED

K3, KL48 = PUBLISHED["kimi-k3"], PUBLISHED["kimi-linear-48b"]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def test_the_shipped_configs_are_the_published_ones():
    if not SHARED.is_dir():
        pytest.skip("no shared/data beside this checkout")
    assert K3.read_bytes() == (SHARED / "kimi-k3-config.json").read_bytes()
    assert KL48.read_bytes() == (SHARED / "kimi-linear-48b-config.json").read_bytes()


@pytest.mark.parametrize("path", [K3, KL48], ids=["k3", "kimi_linear_48b"])
def test_totals_equal_inspect(path, capsys):
    from kdaserve.cli import main

    cfg = load_config(path)
    size = measure(cfg)
    assert main(["plan", "--model", str(path), "--gpu", "H200", "--num-gpus", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total_params"] == size.total
    assert out["active_params"] == int(size.total_active)
    for key in ("fits", "weights_bytes_per_gpu", "decode_tpot_ms_batch1",
                "cost_per_million_output_tokens"):
        assert key in out


def test_k3_fits_where_the_bytes_say():
    cfg, table = load_config(K3), load_table()
    h200, gb300 = find(table, "H200"), find(table, "gb300")
    on_h200 = plan(cfg, h200, recommend(cfg, h200, 8, 1))
    assert not on_h200.fits                       # 1.5 TB of MXFP4 weights, 8 x 141 GB
    assert on_h200.weights_bytes_per_gpu > h200.memory_bytes
    on_gb300 = plan(cfg, gb300, recommend(cfg, gb300, 16, 4))
    assert on_gb300.fits and on_gb300.max_requests_at_context > 0


def test_layout_follows_the_interconnect():
    cfg, table = load_config(K3), load_table()
    slow = recommend(cfg, find(table, "RTX5090"), 80, 10)
    assert slow.pp == 10 and slow.tp == 8 and slow.dp == 1 and "Ethernet" not in slow.reason
    fast = recommend(cfg, find(table, "GB300"), 16, 4)
    assert fast.pp == 1 and fast.dp == 4 and fast.moe_backend == "ep_all2all"


def test_the_roofline_moves_the_right_way():
    cfg, table = load_config(KL48), load_table()
    h200 = find(table, "H200")
    one = Layout(1, 1, 1, 1, "tp_sharded", "test")
    p = plan(cfg, h200, one, "bf16", context=4096, api_price=2.0)
    # batch 1 reads every dense weight once (and k of E experts): at least bytes / bandwidth
    dense = p.bytes_per_gpu["tp_sharded"] + p.bytes_per_gpu["replicated"]
    assert p.decode_tpot_ms_batch1 / 1e3 >= dense / h200.memory_bw
    assert p.decode_tpot_ms_memory_limited >= p.decode_tpot_ms_batch1
    assert p.decode_output_tok_s_memory_limited > 1e3 / p.decode_tpot_ms_batch1
    fp4 = plan(cfg, h200, one, "mxfp4", context=4096)
    assert fp4.weights_bytes_per_gpu < p.weights_bytes_per_gpu
    assert fp4.decode_tpot_ms_batch1 < p.decode_tpot_ms_batch1
    longer = plan(cfg, h200, one, "bf16", context=65536)
    assert longer.max_requests_at_context < p.max_requests_at_context
    tp2 = plan(cfg, h200, Layout(2, 1, 1, 1, "tp_sharded", "test"), "bf16", context=4096)
    assert tp2.weights_bytes_per_gpu < p.weights_bytes_per_gpu
    assert p.break_even_days > 0 and p.cost_per_million_output_tokens > 0


def test_unknown_hardware_is_a_clear_error(tmp_path):
    table = load_table()
    with pytest.raises(ValueError, match="known: "):
        find(table, "TPU-v9")
    extra = tmp_path / "hw.json"
    extra.write_text(json.dumps({"MYGPU": {**json.loads(
        (Path(__file__).parents[1] / "kdaserve/plan/hardware.json").read_text())["H100"],
        "memory_bytes": 1e12}}))
    assert find(load_table(str(extra)), "mygpu").memory_bytes == 1e12
