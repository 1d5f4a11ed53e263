"""Tiny random Kimi K3 checkpoints in the released layout, and mlx-lm's kimi_k3 as the oracle."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from kdaserve.model.loader import save_model
from kdaserve.model.random_init import init_random
from kdaserve.model.registry import build_model, load_config
from kdaserve.model_config import ModelConfig

K3_TINY = {
    "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
    "text_config": {
        "model_type": "kimi_linear", "vocab_size": 96, "hidden_size": 64,
        "num_hidden_layers": 5, "num_attention_heads": 2, "num_key_value_heads": 2,
        "intermediate_size": 96, "rms_norm_eps": 1e-6,
        "linear_attn_config": {"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4],
                               "num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                               "use_full_rank_gate": True, "gate_lower_bound": -5.0},
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 2, "q_lora_rank": 32, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True,
        "mla_use_output_gate": True, "num_experts": 8, "num_experts_per_token": 2,
        "num_shared_experts": 1, "moe_intermediate_size": 32, "routed_expert_hidden_size": 32,
        "latent_moe_use_norm": True, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True,
        "routed_scaling_factor": 1.5, "tie_word_embeddings": False, "eos_token_id": 1,
    },
    "vision_config": {"model_type": "kimi_k3_vision"}, "media_placeholder_token_id": 95,
}


def k3_raw(mxfp4: bool = False, **text_over) -> dict:
    raw = copy.deepcopy(K3_TINY)
    for k, v in text_over.items():
        if v is None:
            raw["text_config"].pop(k, None)
        else:
            raw["text_config"][k] = v
    if mxfp4:
        raw["quantization_config"] = {"quant_method": "compressed-tensors",
                                      "format": "mxfp4-pack-quantized"}
    return raw


def random_k3(cfg: ModelConfig, seed: int = 0, chunk: int = 8):
    torch.manual_seed(seed)
    return init_random(build_model(cfg, chunk_size=chunk), seed).eval()


def write_k3_checkpoint(out: Path, raw: dict, seed: int = 0):
    cfg = load_config(raw)
    model = random_k3(cfg, seed)
    save_model(model, out)
    return model


def mlx_logits(path: Path, prompts: list[list[int]]) -> list:
    """Last-position logits (numpy fp32) of each prompt through mlx-lm's kimi_k3."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))
    out = []
    for p in prompts:
        logits = model(mx.array([p]))[0, -1].astype(mx.float32)
        out.append(np.array(logits))
    return out


def mlx_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens per prompt from mlx-lm (loaded once) with its own incremental cache."""
    from mlx_lm.utils import load_model

    from kdaserve.bench.reference_k3 import mlx_greedy_tokens

    model, _ = load_model(Path(path))
    return [mlx_greedy_tokens(model, p, n) for p in prompts]


def write_random_draft(out: Path, hidden: int, vocab: int, layer_ids: tuple[int, ...],
                       block: int = 5, k3_layout: bool = False, seed: int = 0) -> Path:
    """A random DSpark draft for a tiny target: this project's layout, or the released
    k3_dspark one (the target's embedding of its last token id is the mask)."""
    from kdaserve.model.dspark import DraftConfig, DSparkDraft

    torch.manual_seed(seed)
    extra = dict(layout="k3_dspark", mask_token_id=vocab - 2, rope_interleaved=True,
                 q_lora_rank=16) if k3_layout else {}
    dc = DraftConfig(hidden_size=hidden, vocab_size=vocab, target_layer_ids=layer_ids,
                     block_size=block, num_attention_heads=2, kv_lora_rank=8,
                     qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                     intermediate_size=32, markov_rank=4, **extra)
    draft = DSparkDraft(dc)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3)
    draft.save_pretrained(out)
    return out
