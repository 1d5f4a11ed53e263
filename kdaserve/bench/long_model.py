"""The models `kdaserve bench long` measures (kdaserve/bench/long.py): a tiny random hybrid
configured for 1M positions in two shapes, or a checkpoint as it is, and the same
architecture made all-MLA for the comparison."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

SHAPES = ("toy", "proportional")


def bench_config(max_len: int = 1 << 20, shape: str = "toy") -> dict:
    """A bench model's config.json: 4 layers, KDA ×3 then MLA.

    toy: ~1 MB of weights, one MLA head: the 1M-token prefill ends in tens of minutes, but its
    128k cache (25 MiB) is 25x its weights, so its decode step at 128k is almost only the
    latent read. proportional: the same layer pattern with the released Kimi Linear's
    proportion of cached latent bytes at 128k to weight bytes read per token (1 GiB of
    latents at 128k against 6 GB of active bf16 weights, 0.18; here 40 MiB against 226 MB of
    fp32 weights, 0.18), so TPOT(128k)/TPOT(1k) says what a user of the released model meets.
    """
    if shape == "proportional":
        cfg = bench_config(max_len)
        cfg.update({
            "hidden_size": 512, "intermediate_size": 8192, "first_k_dense_replace": 4,
            "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64,
            "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        })
        cfg["linear_attn_config"] = dict(cfg["linear_attn_config"], num_heads=4, head_dim=128)
        return cfg
    if shape != "toy":
        raise ValueError(f"unknown bench shape {shape!r}; one of {SHAPES}")
    return {
        "model_type": "kimi_linear", "vocab_size": 1024, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 4, "rms_norm_eps": 1e-5,
        "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4],
                               "num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4},
        "num_attention_heads": 1, "num_key_value_heads": 1, "kv_lora_rank": 32,
        "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
        "mla_use_nope": True, "num_experts": 8, "num_experts_per_token": 2,
        "num_shared_experts": 1, "moe_intermediate_size": 64, "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.0, "model_max_length": max_len, "eos_token_id": 0,
    }


def make_model_dir(out: Path, base: str | None, all_mla: bool, seed: int = 0,
                   shape: str = "toy") -> Path:
    """A checkpoint to measure: `base` as is, or (no base) the bench config with random
    weights; all_mla: the same architecture with every layer MLA, random weights."""
    if base is not None and not all_mla:
        return Path(base)
    from kdaserve.model.loader import save_model
    from kdaserve.model.random_init import init_random
    from kdaserve.model.registry import build_model, load_config

    cfg = load_config(base if base is not None else bench_config(shape=shape))
    if all_mla:
        cfg = replace(cfg, kda_layers=(), mla_layers=tuple(range(cfg.num_hidden_layers)))
    model = init_random(build_model(cfg), seed=seed).eval()
    path = out / ("all_mla" if all_mla else "hybrid")
    save_model(model, path)
    return path
