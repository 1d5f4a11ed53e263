"""Build tiny random checkpoints with transformers' KimiLinearForCausalLM (an independent
reference)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_hf_checkpoint(out: Path, *, seed: int = 0, vocab: int = 96, hidden: int = 64,
                       layers: int = 5, kda_layers=(1, 2, 3, 5), mla_layers=(4,),
                       experts: int = 8, top_k: int = 2, n_group: int = 1, topk_group: int = 1):
    """Save a random KimiLinear (few KDA + MLA layers, MoE with a shared expert, first layer
    dense, non-zero correction bias) and return the transformers model (fp32, eval)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = KimiLinearConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, num_local_experts=experts, num_experts_per_tok=top_k,
        n_shared_experts=1, n_group=n_group, topk_group=topk_group,
        linear_attn_config={"kda_layers": list(kda_layers), "full_attn_layers": list(mla_layers),
                            "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4},
        first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        routed_scaling_factor=2.446,
    )
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "A_log" not in name:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(out)
    return model
