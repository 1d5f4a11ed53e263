"""The FP8 MLA latent cache (`--kv-cache-dtype fp8`): each cached token's latent [Dc+R] as
float8 e4m3 with its own fp32 scale (its largest magnitude over e4m3's 448), packed into one
byte row [Dc+R+4] of a uint8 page tensor: the scale rides in the token's last four bytes.

Why one tensor: everything that moves pages as bytes (the offload tiers, snapshots of the
block pool, transfers between instances) moves the scales with them, unchanged; only the
writer (the MLA layer) and the readers (the attention paths, through `read`) know the
packing. A 1M-token request's latents take (Dc+R+4) bytes a token instead of 2 (Dc+R) in bf16:
580 vs 1,152 for K3's Dc=512, R=64.

Per-token scales keep a token's error relative to its own size (e4m3: 3 mantissa bits, a
relative step of 2^-4 at most), whatever the other tokens of its page hold.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn


def is_packed(pages: torch.Tensor) -> bool:
    """True for an FP8 latent page tensor (uint8 rows with their scales)."""
    return pages.dtype == torch.uint8


def packed_width(latent_dim: int) -> int:
    return latent_dim + SCALE_BYTES


def pack(lat: torch.Tensor) -> torch.Tensor:
    """lat [T, D] float -> [T, D+4] uint8: e4m3 values, then the fp32 scale's bytes."""
    x = lat.float()
    scale = (x.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (x / scale).to(FP8).view(torch.uint8)
    return torch.cat([q, scale.contiguous().view(torch.uint8)], -1)


def read(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D+4] uint8 -> [..., D] in dtype (each value times its token's scale)."""
    d = packed.shape[-1] - SCALE_BYTES
    vals = packed[..., :d].contiguous().view(FP8).float()
    scale = packed[..., d:].contiguous().view(torch.float32)             # [..., 1]
    return (vals * scale).to(dtype)


def as_float(pages_slice: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A gathered slice of pages in dtype, whichever cache dtype holds them."""
    return read(pages_slice, dtype) if is_packed(pages_slice) else pages_slice.to(dtype)
