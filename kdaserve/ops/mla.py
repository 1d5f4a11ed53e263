"""MLA attention over latents: absorbed decode and expanded prefill.

Legend: B sequences, Q queries, L keys, H heads, N nope dim, R rope dim, Dc kv_lora_rank,
Vd value dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mla_decode_absorbed(
    q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, mask: torch.Tensor,
    w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One query per sequence against its cached latents, never expanding K/V.

    q_nope [B,H,N], q_pe [B,H,R], latents [B,L,Dc+R] (normed latent ‖ rope key), mask [B,L] bool,
    w_uk [H,N,Dc], w_uv [H,Vd,Dc] (the two halves of kv_b_proj). Returns [B,H,Vd].
    """
    return mla_absorbed(q_nope[:, None], q_pe[:, None], latents, mask[:, None], w_uk, w_uv,
                        scale)[:, 0]


def mla_absorbed(
    q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, mask: torch.Tensor,
    w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Q queries per sequence: q_nope [B,Q,H,N], q_pe [B,Q,H,R], latents [B,L,Dc+R],
    mask [B,Q,L] bool (True: may attend). Returns [B,Q,H,Vd]."""
    dc = w_uk.shape[-1]
    c, k_pe = latents[..., :dc], latents[..., dc:]
    q_lat = torch.einsum("bqhn,hnc->bqhc", q_nope, w_uk)
    scores = torch.einsum("bqhc,blc->bqhl", q_lat, c)
    if k_pe.shape[-1]:
        scores = scores + torch.einsum("bqhr,blr->bqhl", q_pe, k_pe)
    scores = (scores.float() * scale).masked_fill(~mask[:, :, None, :], float("-inf"))
    probs = scores.softmax(-1).to(c.dtype)
    out_lat = torch.einsum("bqhl,blc->bqhc", probs, c)
    return torch.einsum("bqhc,hvc->bqhv", out_lat, w_uv)


def mla_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
) -> torch.Tensor:
    """q [B,Q,H,N+R], k [B,L,H,N+R], v [B,L,H,Vd]; mask [B,1,Q,L] bool or None (plain causal,
    Q == L). Returns [B,Q,H,Vd]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, is_causal=mask is None, scale=scale,
    )
    return out.transpose(1, 2)
