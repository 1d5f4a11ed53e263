"""MXFP4 (OCP microscaling FP4) as compressed-tensors `mxfp4-pack-quantized` stores it.

A weight [..., K] becomes `weight_packed` uint8 [..., K/2] (two E2M1 codes per byte, the even
element in the low nibble) and `weight_scale` uint8 [..., K/32] (one E8M0 exponent per 32
consecutive values: scale = 2^(s - 127)). An E2M1 code is sign (bit 3) and a magnitude index
into {0, 0.5, 1, 1.5, 2, 3, 4, 6}. This is the torch reference; the compiled CPU MoE kernel
reads the same bytes.
"""

from __future__ import annotations

import functools

import torch

GROUP = 32
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents -> fp32 2^(s-127), exactly (s = 0 is the subnormal 2^-127; 255,
    NaN in E8M0, reads as inf)."""
    s = scale.to(torch.int32)
    bits = torch.where(s > 0, s << 23, torch.full_like(s, 0x400000))
    return bits.view(torch.float32)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """packed [..., K/2] uint8, scale [..., K/32] uint8 -> [..., K] in `dtype` (into `out`,
    a reused buffer, when given)."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError("MXFP4 weights must be uint8 (weight_packed and weight_scale)")
    k = packed.shape[-1] * 2
    if scale.shape[-1] * GROUP != k or packed.shape[:-1] != scale.shape[:-1]:
        raise ValueError(f"MXFP4 shapes disagree: packed {tuple(packed.shape)}, "
                         f"scale {tuple(scale.shape)} (want K/2 and K/32 of one K)")
    lut = _lut(packed.device)
    codes = torch.stack([packed & 0x0F, packed >> 4], -1).reshape(*packed.shape[:-1], k)
    vals = lut[codes.long()]                                                  # [..., K]
    mult = e8m0_to_float(scale)
    res = (vals.view(*scale.shape, GROUP) * mult.unsqueeze(-1)).reshape(vals.shape)
    if out is not None:
        return out.copy_(res)
    return res.to(dtype)


@functools.cache
def _lut(device: torch.device) -> torch.Tensor:
    """The E2M1 values on `device`, copied there once: a host-to-device copy inside a step
    would break a CUDA graph capture (engine/decode_graphs.py)."""
    return E2M1_VALUES.to(device=device)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] (K % 32 == 0) -> (packed uint8 [..., K/2], scale uint8 [..., K/32]).
    Scale per group: 2^(floor(log2(amax)) - 2), as the OCP MX spec does (the largest value maps
    near E2M1's 6 = 1.5 * 2^2); each value rounds to the nearest code (ties to the lower
    magnitude index), saturating at 6."""
    k = w.shape[-1]
    if k % GROUP:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {GROUP}, got {k}")
    g = w.float().reshape(*w.shape[:-1], k // GROUP, GROUP)
    amax = g.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=1e-38))) - 2,
                      torch.full_like(amax, -127.0)).clamp(-127, 127)
    scale = (exp + 127).to(torch.uint8)
    x = g / e8m0_to_float(scale).unsqueeze(-1)
    mags = E2M1_VALUES[:8]
    idx = (x.abs().unsqueeze(-1) - mags).abs().argmin(-1)                     # [..., G, 32]
    codes = (idx | ((x < 0).to(idx.dtype) << 3)).to(torch.uint8).reshape(w.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), scale.contiguous()
