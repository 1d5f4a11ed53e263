"""A tiny random Kimi K2.5 (kimi_k25 with a kimi_linear text model) built with transformers: the
independent reference for the vision path."""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE_TOKEN = 90          # placeholder id in the tiny vocab


def make_hf_k25_checkpoint(out: Path, *, seed: int = 0, vocab: int = 96, hidden: int = 64):
    """Save a random Kimi_K25ForConditionalGeneration (2-layer MoonViT of width 32, pos-emb table
    6x6 so that most images interpolate it; 5-layer KDA/MLA MoE text model) in transformers'
    own module layout, and return the transformers model (fp32, eval)."""
    import transformers
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration, KimiLinearConfig

    transformers.logging.set_verbosity_error()
    text = KimiLinearConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1,
        linear_attn_config={"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4],
                            "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4},
        first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        routed_scaling_factor=2.446)
    vision = dict(patch_size=14, pos_emb_height=6, pos_emb_width=6, num_attention_heads=2,
                  num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                  rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    cfg = Kimi_K25Config(text_config=text.to_dict(), vision_config=vision,
                         projection_hidden_size=32, image_token_id=IMAGE_TOKEN,
                         video_token_id=91, vision_start_token_id=88, vision_end_token_id=89,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" in name:
                continue
            if p.dim() >= 2:
                p.normal_(0, 0.2)
            elif "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(out, save_original_format=False)
    return model
