"""FP8 (e4m3) weights with block scales, DeepSeek-V3's layout (also Kimi K2's and others'):
`weight` float8_e4m3fn [N, K] and `weight_scale_inv` fp32 [ceil(N/bh), ceil(K/bw)], one
multiplier per (bh x bw) block (128 x 128 in those checkpoints; the name notwithstanding, the
weight is fp8 * weight_scale_inv). This is the torch math; the loader dequantizes on load
(kdaserve/model/fp8_checkpoint.py)."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def dequantize_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor,
                          block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """w [N, K] fp8, scale_inv [ceil(N/bh), ceil(K/bw)] -> [N, K] fp32 (one rounding)."""
    n, k = w.shape
    bh, bw = block
    if scale_inv.shape != ((n + bh - 1) // bh, (k + bw - 1) // bw):
        raise ValueError(f"weight_scale_inv {tuple(scale_inv.shape)} does not tile a "
                         f"{n}x{k} weight in {bh}x{bw} blocks")
    s = scale_inv.float().repeat_interleave(bh, 0)[:n].repeat_interleave(bw, 1)[:, :k]
    return w.float() * s


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (fp8 [N, K], scale_inv fp32 [ceil(N/bh), ceil(K/bw)]): each block's
    amax maps to e4m3's 448 (tests and checkpoint writers)."""
    n, k = w.shape
    bh, bw = block
    gn, gk = (n + bh - 1) // bh, (k + bw - 1) // bw
    pad = torch.zeros(gn * bh, gk * bw, dtype=torch.float32)
    pad[:n, :k] = w.float()
    blocks = pad.view(gn, bh, gk, bw)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(gn * bh, gk * bw)[:n, :k].contiguous(), scale
