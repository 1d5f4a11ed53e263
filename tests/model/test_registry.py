"""The model registry, the K3 config, and `kdaserve inspect` on the published 2.8T config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3_models import k3_raw
from kdaserve.cli import main
from kdaserve.config import ConfigError
from kdaserve.model.inspect import measure
from kdaserve.model.registry import build_model, entry_for, hf_config, load_config, supported

K3_CONFIG = Path(__file__).parents[1] / "data" / "kimi-k3-config.json"


def test_supported_types_and_clear_error():
    assert {"kimi_linear", "kimi_k3", "dspark_draft", "k3_dspark"} <= set(supported())
    with pytest.raises(ConfigError, match="kimi_linear, kimi_k3"):
        load_config({"model_type": "llama"})
    with pytest.raises(ConfigError, match="supported"):
        load_config({"model_type": "qwen3"})
    assert entry_for({"architectures": ["KimiK3ForConditionalGeneration"]}).model_type == \
        "kimi_k3"


def test_k3_config_roundtrip_and_classes():
    cfg = load_config(k3_raw(mxfp4=True))
    assert cfg.architecture == "kimi_k3" and cfg.experts_quantization == "mxfp4"
    assert load_config(hf_config(cfg)) == cfg
    model = build_model(cfg)
    names = set(model.state_dict())
    assert "language_model.model.layers.1.block_sparse_moe.experts_w13_packed" in names
    assert "language_model.model.output_attn_res_proj.weight" in names
    assert "language_model.model.layers.0.self_attn.g_proj.weight" in names     # KDA gate
    assert "language_model.model.layers.3.self_attn.g_proj.weight" in names     # MLA gate


def test_bad_k3_fields_are_named():
    with pytest.raises(ConfigError, match="quantization_config"):
        load_config({**k3_raw(), "quantization_config": {
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}})
    with pytest.raises(ConfigError, match="hidden_act"):
        load_config(k3_raw(hidden_act="gelu"))
    with pytest.raises(ConfigError, match="multiple of 32"):
        load_config(k3_raw(mxfp4=True, moe_intermediate_size=40))


def test_published_k3_config_sizes():
    cfg = load_config(K3_CONFIG)
    assert (len(cfg.kda_layers), len(cfg.mla_layers)) == (69, 24)
    size = measure(cfg)
    assert 2.7e12 < size.total < 2.9e12            # "about 2.8T"
    assert 100e9 < size.total_active < 108e9       # "about 104B active"
    state, latent = size.cache_bytes("bfloat16")
    assert latent == 24 * 576 * 2
    assert state == 69 * (96 * 128 * 128 * 4 + 3 * 3 * 96 * 128 * 2)


def test_inspect_cli(capsys):
    assert main(["inspect", "--model", str(K3_CONFIG), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["architecture"] == "kimi_k3" and out["mla_latent_bytes_per_token"] == 27648
    assert main(["inspect", "--model", str(K3_CONFIG)]) == 0
    table = capsys.readouterr().out
    assert "routed experts" in table and "KDA state per request" in table
