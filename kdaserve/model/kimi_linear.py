"""Kimi Linear: the hybrid decoder with the HF Kimi Linear module names."""

from __future__ import annotations

from torch import nn

from kdaserve.model.base import FP32_PARAM_SUFFIXES, DecoderLayer, HybridForCausalLM, build_layers
from kdaserve.model.layers import RMSNorm, embedding
from kdaserve.model_config import ModelConfig

__all__ = ["FP32_PARAM_SUFFIXES", "DecoderLayer", "KimiLinearForCausalLM", "KimiLinearModel"]


class KimiLinearModel(nn.Module):
    def __init__(self, cfg: ModelConfig, chunk_size: int) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = build_layers(cfg, chunk_size)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class KimiLinearForCausalLM(HybridForCausalLM):
    def __init__(self, cfg: ModelConfig, chunk_size: int = 16) -> None:
        super().__init__()
        self.config = cfg
        self.chunk_size = chunk_size
        self.model = KimiLinearModel(cfg, chunk_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
