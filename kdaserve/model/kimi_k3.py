"""Kimi K3's language model: the Kimi Linear skeleton with K3's blocks (SiTU, latent MXFP4
MoE, full-rank KDA gate with lower-bounded decay, gated MLA: see their modules) and block
attention-residuals in place of the residual stream (model/attn_res.py). Text weights sit under
`language_model.` as in the released checkpoint. With a complete `vision_config` the MoonViT
tower and projector sit beside it as `vision_tower` / `mm_projector` (model/vision/); the same
class serves transformers' kimi_k25 layout (a kimi_linear text model under the tower).

Speculative capture: with attention-residuals on, `capture_layers` returns the in-block running
sum P after the layer (MLP output included), the stream the reference deployment feeds DSpark.
The mixed sublayer input is a per-sublayer view of the same sources, and the bank is shared
by every later position, so P is the one stream that is the layer's own contribution.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kdaserve.model.attn_res import ResidualBank, attn_res_mix
from kdaserve.model.base import DecoderLayer, HybridForCausalLM, build_layers
from kdaserve.model.batch import ForwardBatch
from kdaserve.model.layers import RMSNorm, embedding
from kdaserve.model.vision.tower import build_vision, encode
from kdaserve.model_config import ModelConfig


class KimiK3DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, kda_index: int, mla_index: int,
                 chunk_size: int) -> None:
        super().__init__(cfg, layer, kda_index, mla_index, chunk_size)
        bs = cfg.attn_res_block_size
        self.use_attn_res = bs is not None
        if bs is not None:
            h = cfg.hidden_size
            self.is_block_start = layer % bs == 0
            self.self_attention_res_norm = RMSNorm(h, cfg.rms_norm_eps)
            self.self_attention_res_proj = nn.Linear(h, 1, bias=False)
            self.mlp_res_norm = RMSNorm(h, cfg.rms_norm_eps)
            self.mlp_res_proj = nn.Linear(h, 1, bias=False)

    def forward_res(self, partial: torch.Tensor, bank: ResidualBank, fb: ForwardBatch
                    ) -> torch.Tensor:
        """The in-block running sum P [T, H] after this layer (bank updated at block starts)."""
        h = attn_res_mix(bank, partial, self.self_attention_res_norm.weight,
                         self.self_attention_res_proj.weight)
        y = self.self_attn(self.input_layernorm(h), fb)
        if self.is_block_start:
            bank.append(partial)
            partial = y
        else:
            partial = partial + y
        h = attn_res_mix(bank, partial, self.mlp_res_norm.weight, self.mlp_res_proj.weight)
        return partial + self.feed_forward(self.post_attention_layernorm(h), fb)


class KimiK3TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, chunk_size: int) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = build_layers(cfg, chunk_size, KimiK3DecoderLayer)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attn_res_block_size is not None:
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(cfg.hidden_size, 1, bias=False)


class KimiK3LanguageModel(nn.Module):
    def __init__(self, cfg: ModelConfig, chunk_size: int) -> None:
        super().__init__()
        self.model = KimiK3TextModel(cfg, chunk_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


class KimiK3ForConditionalGeneration(HybridForCausalLM):
    def __init__(self, cfg: ModelConfig, chunk_size: int = 16) -> None:
        super().__init__()
        self.config = cfg
        self.chunk_size = chunk_size
        self.language_model = KimiK3LanguageModel(cfg, chunk_size)
        vision = build_vision(cfg)
        if vision is not None:
            self.vision_tower, self.mm_projector = vision

    def drop_vision(self) -> None:
        """Serve text only (a checkpoint that ships no vision weights)."""
        for name in ("vision_tower", "mm_projector"):
            if hasattr(self, name):
                delattr(self, name)

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int]]
                      ) -> list[torch.Tensor]:
        """[tokens_i, hidden] text-space embeddings of each image (see model/vision)."""
        return encode(self.vision_tower, self.mm_projector, pixels, grids)

    @property
    def model(self) -> KimiK3TextModel:  # type: ignore[override]
        return self.language_model.model

    @property
    def lm_head(self) -> nn.Linear:  # type: ignore[override]
        return self.language_model.lm_head

    def new_bank(self) -> ResidualBank | None:
        if self.config.attn_res_block_size is None:
            return None
        return ResidualBank(self.config.rms_norm_eps)

    def run_stage(self, x: torch.Tensor, fb: ForwardBatch, layers: Iterable[int],
                  bank: ResidualBank | None, capture_layers: tuple[int, ...] = (),
                  captured: list[torch.Tensor] | None = None) -> torch.Tensor:
        if bank is None:
            return super().run_stage(x, fb, layers, bank, capture_layers, captured)
        for i in layers:           # x is the in-block running sum P
            x = self.model.layers[i].forward_res(x, bank, fb)
            if i in capture_layers:
                captured.append(x)
        return x

    def final_hidden(self, x: torch.Tensor, bank: ResidualBank | None) -> torch.Tensor:
        if bank is None:
            return x
        m = self.model
        return attn_res_mix(bank, x, m.output_attn_res_norm.weight,
                            m.output_attn_res_proj.weight)
