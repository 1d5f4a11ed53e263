"""The MLA token mixer: only [normed latent ‖ rope key] per token is cached."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.model.batch import ForwardBatch
from kdaserve.model.layers import RMSNorm
from kdaserve.model_config import ModelConfig
from kdaserve.ops import fp8_latents
from kdaserve.ops.mla import (
    mla_decode_absorbed,
    mla_decode_split_k,
    mla_prefill_attention,
    mla_prefill_blockwise,
)
from kdaserve.ops.rope import apply_rope, softmax_scale


class MultiHeadLatentAttention(nn.Module):
    """Legend: T tokens, H heads, N nope dim, R rope dim, Dc kv_lora_rank, Vd value dim.

    K3's gated MLA (`mla_use_output_gate`): o_proj(attn(x) · sigmoid(g_proj(x))), the gate
    [H·Vd] read from the layer's (normed) input x.
    """

    def __init__(self, cfg: ModelConfig, mla_index: int) -> None:
        super().__init__()
        hidden, h = cfg.hidden_size, cfg.num_attention_heads
        self.mla_index = mla_index
        self.num_heads = h
        self.nope, self.rope, self.v_dim = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                            cfg.v_head_dim)
        self.kv_lora_rank = cfg.kv_lora_rank
        self.use_rope = not cfg.mla_use_nope
        self.rope_theta = cfg.rope_theta
        # drafts: DeepSeek-style interleaved pairs and YaRN (K3's DSpark); targets are NoPE
        self.rope_interleaved = bool(getattr(cfg, "rope_interleaved", False))
        self.rope_scaling = getattr(cfg, "rope_scaling", None)
        self.scale = softmax_scale(cfg.qk_head_dim, self.rope_scaling)
        qk = cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, hidden, bias=False)
        if getattr(cfg, "mla_use_output_gate", False):
            self.g_proj = nn.Linear(hidden, h * self.v_dim, bias=False)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rope part [T, ..., R] rotated to its positions [T]."""
        return apply_rope(x, positions, self.rope_theta, self.rope_interleaved, self.rope_scaling)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(
            self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.nope + self.rope)

    def latents(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T, Dc+R]: what the cache stores for each token."""
        ckv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(ckv[:, : self.kv_lora_rank])
        k_pe = ckv[:, self.kv_lora_rank:]
        if self.use_rope and self.rope:
            k_pe = self.rotate(k_pe, positions)
        return torch.cat([c, k_pe], -1)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_uk [H,N,Dc], W_uv [H,Vd,Dc]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope:]

    def expand(self, lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [B,L,Dc+R] -> keys [B,L,H,N+R], values [B,L,H,Vd]."""
        b, l_, _ = lat.shape
        kv = self.kv_b_proj(lat[..., : self.kv_lora_rank]).view(b, l_, self.num_heads, -1)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope:]
        k_pe = lat[..., self.kv_lora_rank:].unsqueeze(2).expand(b, l_, self.num_heads, self.rope)
        return torch.cat([k_nope, k_pe], -1), v

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        T, Td = x.shape[0], fb.num_decode_tokens
        q = self.queries(x)                                                     # [T,H,N+R]
        if self.use_rope and self.rope:
            q = torch.cat([q[..., : self.nope], self.rotate(q[..., self.nope:], fb.positions)], -1)
        lat = self.latents(x, fb.positions)                                     # [T,Dc+R]
        lay = fb.mla
        pages = flat = None
        if fb.cache is not None:
            pages = fb.cache.mla_pages[self.mla_index]                       # [NB,bs,Dc+R]
            flat = pages.view(-1, pages.shape[-1])
            flat.index_copy_(0, lay.slot_mapping, fp8_latents.pack(lat)
                             if fp8_latents.is_packed(flat) else lat.to(flat.dtype))
        outs = []
        if Td:
            w_uk, w_uv = self.absorbed_weights()
            q_nope, q_pe = q[:Td, :, : self.nope], q[:Td, :, self.nope:]
            if lay.decode_blockwise:
                outs.append(mla_decode_split_k(q_nope, q_pe, pages, lay.decode_ctx_blocks,
                                               lay.decode_kv_lens, w_uk, w_uv, self.scale))
            else:
                ctx = fp8_latents.as_float(pages.index_select(
                    0, lay.decode_ctx_blocks.reshape(-1)).view(Td, -1, pages.shape[-1]),
                    x.dtype)                                                   # [Td,Lk,Dc+R]
                outs.append(mla_decode_absorbed(q_nope, q_pe, ctx, lay.decode_ctx_mask, w_uk,
                                                w_uv, self.scale))
        if T > Td:
            Bp, Qp = lay.prefill_q_idx.shape
            qp = torch.cat([q[Td:], q.new_zeros(1, *q.shape[1:])], 0)[lay.prefill_q_idx]
            if pages is None or lay.prefill_blockwise:
                own = torch.cat([lat[Td:], lat.new_zeros(1, lat.shape[1])], 0)[
                    lay.prefill_q_idx]                                         # [Bp,Qp,Dc+R]
            if lay.prefill_blockwise:
                o = mla_prefill_blockwise(qp, own, self.expand, self.scale, pages=pages,
                                          ctx_blocks=lay.prefill_ctx_blocks,
                                          ctx_lens=lay.prefill_ctx_lens)       # [Bp,Qp,H,Vd]
            else:
                ctx = own if pages is None else fp8_latents.as_float(pages.index_select(
                    0, lay.prefill_ctx_blocks.reshape(-1)).view(
                    Bp, -1, pages.shape[-1]), x.dtype)                         # [Bp,Lp,Dc+R]
                if lay.prefill_causal:          # fresh prompts: their own rows, no mask
                    ctx = ctx[:, :Qp]
                k, v = self.expand(ctx)
                o = mla_prefill_attention(qp, k, v, lay.prefill_mask, self.scale)  # [Bp,Qp,H,Vd]
            outs.append(o.reshape(Bp * Qp, self.num_heads, self.v_dim)[lay.prefill_unpad_idx])
        o = torch.cat(outs, 0) if len(outs) > 1 else outs[0]
        o = o.reshape(T, self.num_heads * self.v_dim)
        if hasattr(self, "g_proj"):
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)
