"""Tiny random models of the architecture, built in-process for tests."""

from __future__ import annotations

import torch

from kdaserve.model.kimi_linear import KimiLinearForCausalLM
from kdaserve.model.registry import load_config
from kdaserve.model_config import ModelConfig


def tiny_config(**over) -> ModelConfig:
    raw = dict(
        model_type="kimi_linear",
        vocab_size=64, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=3, kv_lora_rank=12, q_lora_rank=None,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 2,
                            "head_dim": 8, "short_conv_kernel_size": 4},
        num_experts=6, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=1.5,
    )
    raw.update(over)
    return load_config(raw)


def random_model(cfg: ModelConfig, seed: int = 0, chunk: int = 8) -> KimiLinearForCausalLM:
    torch.manual_seed(seed)
    m = KimiLinearForCausalLM(cfg, chunk_size=chunk)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
            elif name.endswith("A_log"):
                p.uniform_(0, 1.5)
            elif name.endswith("dt_bias"):
                p.normal_(0, 1)
        for name, b in m.named_buffers():
            b.normal_(0, 0.1)
    return m.eval()
