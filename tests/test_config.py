from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdaserve.config import CacheConfig, ConfigError, SchedulerConfig
from kdaserve.model.registry import hf_config, load_config

RELEASED_48B = Path(__file__).parent / "data" / "kimi-linear-48b-config.json"

BASE = dict(
    model_type="kimi_linear",
    vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
    num_hidden_layers=4, num_attention_heads=2, kv_lora_rank=8, q_lora_rank=None,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 2,
                        "head_dim": 8, "short_conv_kernel_size": 4},
    num_experts=4, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
)


def test_released_48b_config():
    raw = json.loads(RELEASED_48B.read_text())
    cfg = load_config(raw)
    assert len(cfg.kda_layers) == 20 and cfg.mla_layers == (3, 7, 11, 15, 19, 23, 26)
    assert cfg.moe_layers == tuple(range(1, 27))
    assert cfg.num_experts == 256 and cfg.num_experts_per_token == 8
    assert cfg.mla_latent_dim == 576 and cfg.mla_use_nope


def test_roundtrip_through_hf_dict():
    cfg = load_config(BASE)
    assert load_config(hf_config(cfg)) == cfg


@pytest.mark.parametrize("field,value,match", [
    ("bogus_field", 1, "bogus_field"),
    ("num_experts_per_token", 9, "num_experts_per_token"),
    ("linear_attn_config", {"kda_layers": [1, 2], "full_attn_layers": [4], "num_heads": 2,
                            "head_dim": 8}, "kda_layers"),
    ("num_key_value_heads", 1, "num_key_value_heads"),
    ("hidden_size", "big", "hidden_size"),
    ("layer_types", ["linear_attention"] * 4, "layer_types"),
    ("topk_group", 3, "topk_group"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_bad_fields_are_named(field, value, match):
    raw = dict(BASE)
    raw[field] = value
    with pytest.raises(ConfigError, match=match):
        load_config(raw)


def test_missing_required_field():
    raw = dict(BASE)
    del raw["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        load_config(raw)


def test_other_configs_validate():
    with pytest.raises(ConfigError, match="block_size"):
        CacheConfig(block_size=12)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
