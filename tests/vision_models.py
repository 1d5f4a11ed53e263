"""A tiny random vision model directory (kimi_k25 layout, kdaserve's own save) with a BPE
tokenizer that has Kimi's media tokens: for engine and server tests of the image path."""

from __future__ import annotations

from pathlib import Path

import torch

from kdaserve.model.kimi_k3 import KimiK3ForConditionalGeneration
from kdaserve.model.loader import save_model
from kdaserve.model.registry import load_config
from kdaserve.model_config import ModelConfig
from kdaserve.train.bpe import DEFAULT_SPECIALS, save_tokenizer, train_bpe_tokenizer

MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")
TEXT = dict(
    hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
    num_hidden_layers=4, num_attention_heads=3, kv_lora_rank=12, q_lora_rank=None,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 2,
                        "head_dim": 8, "short_conv_kernel_size": 4},
    num_experts=6, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
    routed_scaling_factor=1.5,
)
VISION = dict(patch_size=14, pos_emb_height=8, pos_emb_width=8, num_attention_heads=2,
              num_hidden_layers=2, hidden_size=32, intermediate_size=48)


def vision_config(vocab: int, placeholder: int, eos: int = 0, **text_over) -> ModelConfig:
    return load_config({
        "model_type": "kimi_k25", "image_token_id": placeholder, "tie_word_embeddings": False,
        "text_config": {**TEXT, "vocab_size": vocab, "eos_token_id": eos, **text_over},
        "vision_config": VISION, "projection_hidden_size": 32,
    })


def random_vision_model(cfg: ModelConfig, seed: int = 0) -> KimiK3ForConditionalGeneration:
    torch.manual_seed(seed)
    m = KimiK3ForConditionalGeneration(cfg, chunk_size=16)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
            elif name.endswith("A_log"):
                p.uniform_(0, 1.5)
            elif name.endswith("dt_bias"):
                p.normal_(0, 1)
        for _, b in m.named_buffers():
            b.normal_(0, 0.1)
    return m.eval()


def build_tiny_vision_model(out: Path, texts: list[str], vocab_target: int = 300,
                            seed: int = 0) -> Path:
    tok = train_bpe_tokenizer(texts, vocab_size=vocab_target,
                              special_tokens=DEFAULT_SPECIALS + MEDIA_TOKENS)
    save_tokenizer(tok, out, model_max_length=4096)
    cfg = vision_config(tok.get_vocab_size(with_added_tokens=True),
                        tok.token_to_id("<|media_pad|>"))
    save_model(random_vision_model(cfg, seed), out)
    return out
